"""Deterministic mode: every per-token number is bitwise the same whatever else is in the batch,
the order of requests, the batch budget (so chunk size) and prefix sharing; otherwise within
1e-5 (float32 CPU). Compared as raw bits, not with a tolerance."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import ref_logprobs

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import RequestResult, ScoreRequest
from logprobe.engine.scheduler import Chunk, plan_work
from logprobe.loading import load_model

BUDGETS = [64, 100, 257, 1 << 20]  # 1 << 20: everything in one batch


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def random_mix(seed: int, vocab: int = 300) -> list[ScoreRequest]:
    """Requests with shared contexts (multiple choice, RL groups), duplicates, a request that is a
    prefix of another, partial score windows and mixed head options."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, vocab) for _ in range(n)]  # noqa: E731
    reqs = []
    for _ in range(3):  # groups sharing a context
        ctx = tok(rng.randint(16, 70))
        for _ in range(rng.randint(2, 4)):
            cont = tok(rng.randint(1, 40))
            sb = len(ctx) if rng.random() < 0.6 else rng.randint(1, len(ctx) + len(cont) - 1)
            reqs.append(ScoreRequest(ctx + cont, sb, temperature=rng.choice([1.0, 0.7]),
                                     top_k=rng.choice([0, 0, 3]), entropy=rng.random() < 0.3))
    for _ in range(3):  # unrelated ones
        t = tok(rng.randint(2, 90))
        reqs.append(ScoreRequest(t, rng.randint(1, len(t) - 1)))
    reqs.append(ScoreRequest(list(reqs[0].tokens), reqs[0].score_begin))  # a duplicate
    reqs.append(ScoreRequest(reqs[1].tokens[: len(reqs[1].tokens) - 1] or reqs[1].tokens, 1))  # a prefix of another
    return reqs


def same(a: RequestResult, b: RequestResult, exact: bool) -> None:
    for name in ("logprobs", "entropy", "topk_logprobs", "ranks", "topk_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is None:
            continue
        if exact or name in ("ranks", "topk_ids"):
            if name in ("ranks", "topk_ids") and not exact:
                continue  # a near-tie may flip with float32 rounding
            assert torch.equal(bits(x), bits(y)), name
        else:
            assert (x - y).abs().max() < 1e-5, name


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return {k: load_model(str(tiny_dirs[k][0]), "cpu", "float32") for k in ("llama", "llama3", "qwen2", "mistral")}


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "mistral"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_random_mixes(kind, deterministic, loaded, tiny_dirs):
    reqs = random_mix(seed=len(kind))
    alone_engine = Scorer(loaded[kind], config=EngineConfig(deterministic=deterministic, share_prefixes=False))
    alone = [alone_engine.engine.run([r])[0] for r in reqs]
    ref = tiny_dirs[kind][1]
    for r, a in zip(reqs, alone):  # alone is right (float64 reference)
        lp = ref_logprobs(ref, r.tokens, r.temperature)[r.score_begin - 1:-1]
        want = lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0]
        assert (a.logprobs.double() - want).abs().max() < 1e-4
    rng = random.Random(1)
    for budget in BUDGETS:
        for share in (True, False):
            order = list(range(len(reqs)))
            rng.shuffle(order)
            cfg = EngineConfig(max_batch_tokens=budget, deterministic=deterministic, share_prefixes=share)
            out = Scorer(loaded[kind], config=cfg).engine.run([reqs[i] for i in order])
            for i, res in zip(order, out):
                same(alone[i], res, deterministic)
    # the mixes did exercise trees and chunks
    inputs = [r.tokens[:-1] for r in reqs]
    assert any(t.shared for b in plan_work(inputs, 257) for t in b)
    assert any(isinstance(b[0], Chunk) and b[0].begin > 0 for b in plan_work(inputs, 64))


@pytest.mark.parametrize("deterministic", [True, False])
def test_suffix_invariance(deterministic, loaded):
    """Appending tokens after a sequence never changes the log-probs of the tokens before them."""
    scorer = Scorer(loaded["mistral"], config=EngineConfig(deterministic=deterministic, max_batch_tokens=50))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, 300, (200,), generator=g).tolist()
    full = scorer.engine.run([ScoreRequest(tokens, 1)])[0].logprobs
    for n in (2, 17, 64, 65, 130):
        short = scorer.engine.run([ScoreRequest(tokens[:n], 1)])[0].logprobs
        if deterministic:
            assert torch.equal(bits(short), bits(full[: n - 1]))
        else:
            assert (short - full[: n - 1]).abs().max() < 1e-5


def test_mixed_batches_per_request_options(loaded):
    """A request's options (score window, temperature, top-k, entropy) never change another's
    numbers: per-request windows, no batch-wide switches."""
    scorer = Scorer(loaded["llama"], deterministic=True, progress=False)
    g = torch.Generator().manual_seed(5)
    t = torch.randint(2, 300, (60,), generator=g).tolist()
    plain = ScoreRequest(t, 1)
    others = [ScoreRequest(t, 40), ScoreRequest(t[:30], 29, temperature=0.3, top_k=50, entropy=True),
              ScoreRequest(t + [7, 8], 2, top_k=300)]
    base = scorer.engine.run([plain])[0]
    mixed = scorer.engine.run(others + [plain])
    same(base, mixed[-1], exact=True)
    same(scorer.engine.run([others[0]])[0], mixed[0], exact=True)
    assert torch.equal(bits(mixed[0].logprobs), bits(base.logprobs[39:]))  # a window of the same rows
    top = scorer.engine.run([ScoreRequest(t[:30], 29, temperature=0.3, top_k=2)])[0]
    assert torch.equal(bits(top.topk_logprobs), bits(mixed[1].topk_logprobs[:, :2]))


@pytest.mark.slow  # slow tier (pytest -m slow): random mixes on the real model (tests/test_golden_bits.py pins its bits in the fast tier)
def test_default_model_mix_bitwise(default_scorer):
    """The real model, once: a random mix alone vs shuffled in a 257-token budget with sharing."""
    reqs = random_mix(seed=9, vocab=49152)
    det = Scorer(default_scorer.loaded, config=EngineConfig(deterministic=True, share_prefixes=False))
    alone = [det.engine.run([r])[0] for r in reqs]
    order = list(range(len(reqs)))
    random.Random(2).shuffle(order)
    out = Scorer(default_scorer.loaded, config=EngineConfig(max_batch_tokens=257, deterministic=True)) \
        .engine.run([reqs[i] for i in order])
    for i, res in zip(order, out):
        same(alone[i], res, exact=True)


@pytest.mark.slow  # slow tier: ~9 s of CLI processes
def test_cli_deterministic_flag(tmp_path):
    """``--deterministic`` (and its old name) through the streaming CLI: shared prompts, a tiny
    budget that chunks, and the same bits as a plain run."""
    import json

    from logprobe.cli.main import build_parser, main

    assert build_parser().parse_args(["score", "a", "b", "--deterministic"]).deterministic
    prompt = list(range(100, 140))
    rows = [{"prompt_token_ids": prompt, "completion_token_ids": [5 + i, 6, 7 + i]} for i in range(3)]
    rows.append({"prompt_token_ids": list(range(200, 260)), "completion_token_ids": [1, 2]})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outs = []
    for budget in ("8192", "16"):
        dst = tmp_path / f"out{budget}.jsonl"
        assert main(["logprobs", "--input", str(src), "--output", str(dst), "--deterministic",
                     "--max-batch-tokens", budget, "--device", "cpu", "--dtype", "float32"]) == 0
        outs.append({r["index"]: r["logprobs"] for r in map(json.loads, dst.read_text().splitlines())})
    assert outs[0] == outs[1] and sorted(outs[0]) == [0, 1, 2, 3]


def test_deterministic_config_is_validated():
    from dataclasses import replace

    from logprobe.config import Deterministic, EngineConfig
    from logprobe.errors import LogprobeError

    with pytest.raises(LogprobeError, match="deterministic.matmul"):
        Deterministic(matmul="cutlass")
    with pytest.raises(LogprobeError, match="deterministic.cuda_tile"):
        EngineConfig(deterministic=Deterministic(cuda_tile=0))
    with pytest.raises(LogprobeError, match="deterministic"):
        EngineConfig(deterministic="yes")
    det = EngineConfig(deterministic=True).deterministic
    assert det == Deterministic() and det.matmul == "cublas" and det.cuda_tile == 2048
    assert EngineConfig().deterministic is None and EngineConfig(deterministic=False).deterministic is None
    assert replace(EngineConfig(), deterministic=True).deterministic == Deterministic()  # normalised in replace too
    assert replace(EngineConfig(deterministic=True), deterministic=False).deterministic is None


def test_engines_sharing_a_model_each_run_under_their_own_numerics(loaded):
    """A default and a deterministic engine on one model, alternating: each pass runs under the
    numerics of the engine that launched it (``layers.numerics``), so each engine's results are
    the bits it gives alone; an unchanged config hands nothing new to the layers."""
    from logprobe.config import Numerics
    from logprobe.engine.runner import Engine
    from logprobe.layers.linear import Linear

    model = loaded["llama"].model
    reqs = random_mix(seed=11)[:5]
    det = Engine(model, EngineConfig(max_batch_tokens=64, deterministic=True), torch.device("cpu"))
    fast = Engine(model, EngineConfig(max_batch_tokens=64), torch.device("cpu"))
    first = det.run(reqs)
    assert fast.run(reqs) and all(m.numerics == Numerics() for m in model.modules() if isinstance(m, Linear))
    again = det.run(reqs)
    for a, b in zip(first, again):
        same(a, b, exact=True)
    held = model.numerics
    assert held.row_tile == 128 and held.column_blocks and held == det.numerics
    det.run(reqs[:1])
    assert model.numerics is held  # the same config: the layers were not handed a new object


def test_passes_run_autotuned_kernels_pinned_in_deterministic_mode(loaded):
    """Every forward pass runs inside its engine's tuning mode: the autotuners pinned in
    deterministic mode (``kernels.tuning.pinned``: no timed configuration), as tuned in default
    mode; engines of both modes on one model alternate."""
    pytest.importorskip("triton")
    from logprobe.engine.runner import Engine
    from logprobe.kernels import tuning

    model = loaded["llama"].model
    seen = []
    hook = model.register_forward_pre_hook(lambda *_: seen.append(tuning._PINNED.get()))
    try:
        engines = [Engine(model, EngineConfig(max_batch_tokens=64, deterministic=d), torch.device("cpu"))
                   for d in (True, False)]
        for e in engines:  # on CPU no tuning is bound: bind one, as on CUDA
            e.tuning = tuning.KernelTuning("Test GPU", None, packages=("no.such.package",)).start()
        for e, pinned in (*zip(engines, (True, False)), (engines[0], True)):
            seen.clear()
            assert e.run(random_mix(seed=3)[:3]) and seen and set(seen) == {pinned}
    finally:
        hook.remove()
    assert tuning._PINNED.get() is False
