"""Deterministic mode's raw bits on the default model and on tiny random Qwen3 and Llama-3
models, pinned by a file written before a refactor of the numerics (``tests/data/golden_bits.json``).

A change that moves code but not arithmetic leaves every float32 bit of these results equal.
Rewrite the file only for a change that is meant to move the numbers, and say so in its commit:

    .venv/bin/python tests/test_golden_bits.py --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_bits.json"
TEXT = ("The tower is 324 metres (1,063 ft) tall, about the same height as an 81-storey building, "
        "and the tallest structure in Paris. Its base is square, measuring 125 metres on each side.")


def bits(t: torch.Tensor) -> str:
    """Every float32 bit of ``t``, as hex of its little-endian bytes."""
    return t.detach().to(torch.float32).contiguous().numpy().tobytes().hex()


def sequences(n: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(2, vocab, (5 + 7 * i,), generator=g).tolist()
        c = torch.randint(2, vocab, (3 + 5 * i,), generator=g).tolist()
        out.append({"prompt_token_ids": p, "completion_token_ids": c})
    return out


def scorer_bits(s, vocab: int) -> dict[str, str]:
    """The results of each job kind, deterministic mode, as raw bits."""
    out = {}
    seqs = sequences(4, vocab, seed=1)
    for name, kw in {"plain": {}, "options": dict(temperature=0.7, top_k=5, entropy=True)}.items():
        for i, r in enumerate(s.logprobs(seqs, **kw)):
            out[f"logprobs.{name}.{i}"] = bits(r.logprobs)
            if r.entropy is not None:
                out[f"entropy.{name}.{i}"] = bits(r.entropy)
                out[f"topk.{name}.{i}"] = bits(r.topk_logprobs) + ":" + str(r.topk_ids.tolist())
    ppl = s.perplexity(TEXT, context_length=32, stride=8, return_token_nlls=True)
    out["perplexity.nlls"] = bits(torch.tensor(ppl.token_nlls[0], dtype=torch.float64).float())
    out["perplexity.value"] = float(ppl.perplexity).hex()
    for i, r in enumerate(s.score("The capital of France is", [" Paris", " London", " a city in Europe"])):
        out[f"score.{i}"] = float(r.log_prob).hex()
    return out


def collect(tmp: Path) -> dict[str, dict[str, str]]:
    from helpers import make_hf_dir

    from logprobe import Scorer

    out = {}
    s = Scorer(device="cpu", dtype="float32", progress=False, deterministic=True)
    out["default"] = scorer_bits(s, s.info.vocab_size)
    for i, kind in enumerate(["qwen3", "llama3"]):
        d = tmp / kind
        d.mkdir(parents=True, exist_ok=True)
        make_hf_dir(d, kind, seed=10 + i)
        s = Scorer(str(d), device="cpu", dtype="float32", progress=False, deterministic=True)
        out[kind] = scorer_bits(s, 258)
    return out


def test_deterministic_bits_equal_the_golden_file(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    got = collect(tmp_path)
    assert got.keys() == golden.keys()
    for model, rows in golden.items():
        for key, want in rows.items():
            assert got[model][key] == want, f"{model} {key}: bits moved"


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if "--write" not in sys.argv:
        sys.exit("usage: tests/test_golden_bits.py --write")
    with tempfile.TemporaryDirectory() as d:
        GOLDEN.write_text(json.dumps(collect(Path(d)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
