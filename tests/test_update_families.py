"""Weight updates (``loading.update``) for the families beyond the Llama one: latent attention
(``deepseek_v3``, rotate-half and interleaved rope), the sigmoid-router MoEs (``glm4_moe``,
``minimax_m2``), Gemma 3 (text and the multimodal checkpoint's names) and the hybrid linear-attention
Qwen models (Qwen3.5 dense and MoE, Qwen3-Next with its fused ``in_proj_qkvz`` / ``in_proj_ba``).

Each test saves a tiny random checkpoint A and, from the same transformers model re-randomised, a
checkpoint B. A scorer loaded from A and given B's tensors (``update_weights`` with the
checkpoint's names, with transformers' in-memory ``state_dict`` names, and ``load_weights`` of B's
directory) must then give bitwise the log-probs of a fresh scorer loaded from B. The collective
protocol's ``covers`` (``loading.collective``) must agree that B's names cover the model. Unknown,
missing and mis-shaped tensors are refused, naming them, with A's weights left in force.
"""

from __future__ import annotations

import pytest
import torch
from helpers import byte_tokenizer, random_sequences
from safetensors.torch import load_file

from logprobe import LogprobeError, Scorer
from logprobe.loading.collective import Declared, check_declared, covers
from logprobe.loading.update import weight_slots

transformers = pytest.importorskip("transformers")
import test_deepseek  # noqa: E402
import test_gemma3  # noqa: E402
import test_moe_sigmoid_families  # noqa: E402
import test_qwen3_next  # noqa: E402

KINDS = {
    "deepseek_qlora": lambda: test_deepseek.make_model("qlora"),
    "deepseek_plain_q": lambda: test_deepseek.make_model("plain_q"),
    "glm4_moe": lambda: test_moe_sigmoid_families.make_model("glm4_moe"),
    "minimax_m2": lambda: test_moe_sigmoid_families.make_model("minimax_m2"),
    "gemma3_text": lambda: test_gemma3._model("gemma3_text"),
    "gemma3": lambda: test_gemma3._model("gemma3"),
    "qwen3_5_text": lambda: test_qwen3_next.make_model("qwen3_5_text"),
    "qwen3_5_moe": lambda: test_qwen3_next.make_model("qwen3_5_moe"),
    "qwen3_next": lambda: test_qwen3_next.make_model("qwen3_next"),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and float buffer (the routers' score-correction bias too) drawn anew."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if not t.is_floating_point() or "rotary" in name or name.endswith("inv_freq"):
                continue
            if name.endswith("A_log"):
                t.copy_(torch.empty(t.shape).uniform_(0.01, 16, generator=gen).log())
            elif t.dim() == 1:
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))


@pytest.fixture(scope="module", params=list(KINDS))
def pair(request, tmp_path_factory):
    """(checkpoint A, checkpoint B, B's in-memory state_dict) of one family."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    torch.manual_seed(0)
    model = KINDS[kind]().float().eval()
    dirs = []
    for seed in (1, 2):
        _randomise(model, seed)
        d = root / f"w{seed}"
        model.save_pretrained(str(d))
        byte_tokenizer()[0].save_pretrained(str(d))
        dirs.append(d)
    memory = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return kind, dirs[0], dirs[1], memory


def _sequences() -> list[dict]:
    return random_sequences(4, seed=11, max_prompt=25, max_completion=30)


def _checkpoint(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _same(a: Scorer, b: Scorer, seqs) -> bool:
    return all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a.logprobs(seqs), b.logprobs(seqs)))


def _declared(named) -> list:
    """(name, tensor) pairs -> the metadata a trainer sends before broadcasting them."""
    return [(n, t.dtype, tuple(t.shape)) for n, t in named]


def test_update_equals_fresh_load(pair):
    kind, a, b, memory = pair
    seqs = _sequences()
    fresh = Scorer(str(b), device="cpu", dtype="float32", progress=False)
    scorer = Scorer(str(a), device="cpu", dtype="float32", progress=False)
    assert not _same(scorer, fresh, seqs)  # the new weights change the numbers
    new = _checkpoint(b)
    assert covers(scorer.loaded.model, list(new.items()))
    for named in (new, memory):  # what a trainer declares before broadcasting: taken, every weight named
        declared = check_declared(scorer.loaded.model, _declared(named.items()), Declared())
        assert declared.units == set(weight_slots(scorer.loaded.model)), kind
    key = next(k for k in new if k.endswith("o_proj.weight"))
    assert not covers(scorer.loaded.model, [(k, v) for k, v in new.items() if k != key])
    scorer.update_weights(new)
    assert _same(scorer, fresh, seqs), f"{kind}: update_weights (checkpoint names) != fresh load"

    again = Scorer(str(a), device="cpu", dtype="float32", progress=False)
    again.update_weights(iter(list(memory.items())))  # transformers' in-memory names, streamed
    assert _same(again, fresh, seqs), f"{kind}: update_weights (in-memory names) != fresh load"

    third = Scorer(str(a), device="cpu", dtype="float32", progress=False)
    third.load_weights(str(b))
    assert _same(third, fresh, seqs), f"{kind}: load_weights != fresh load"


def test_refusals_leave_old_weights(pair):
    kind, a, b, _ = pair
    seqs = _sequences()[:2]
    scorer = Scorer(str(a), device="cpu", dtype="float32", progress=False)
    before = [r.logprobs for r in scorer.logprobs(seqs)]
    new = _checkpoint(b)
    key = next(k for k in new if k.endswith("o_proj.weight"))
    bad = [
        ({**new, "model.layers.0.self_attn.surprise.weight": torch.zeros(4, 4)}, "surprise"),
        ({k: v for k, v in new.items() if k != key}, "missing"),
        ({**new, key: torch.zeros(new[key].shape[0] + 1, new[key].shape[1])}, "has shape"),
        ({**new, key: torch.full(new[key].shape, float("nan"))}, "non-finite"),
    ]
    for tensors, words in bad:
        with pytest.raises(LogprobeError, match=words):
            scorer.update_weights(tensors)
    after = [r.logprobs for r in scorer.logprobs(seqs)]
    assert all(torch.equal(x, y) for x, y in zip(before, after)), kind


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo worker processes per kind
@pytest.mark.parametrize("kind", ["qwen3_next_dense", "gemma3_text"])
def test_tensor_parallel_update_equals_fresh_load(kind, tmp_path):
    """TP = 2 (a rank holds its heads' rows; the Gated DeltaNet's q/k/v rows and conv channels as
    three ranges, cut from Qwen3-Next's fused in_proj_qkvz) updated with whole tensors: deterministic
    mode equals a fresh TP = 1 load of the new weights bitwise (TP = 2 equals TP = 1 there)."""
    import test_hybrid_tp

    from logprobe.config import EngineConfig

    torch.manual_seed(0)
    make = (lambda: test_hybrid_tp._make("qwen3_next")) if kind == "qwen3_next_dense" else KINDS[kind]
    model = make().float().eval()
    dirs = []
    for seed in (1, 2):
        _randomise(model, seed)
        model.save_pretrained(str(tmp_path / f"w{seed}"))
        byte_tokenizer()[0].save_pretrained(str(tmp_path / f"w{seed}"))
        dirs.append(tmp_path / f"w{seed}")
    seqs = _sequences()
    det = EngineConfig(deterministic=True, progress=False)
    want = Scorer(str(dirs[1]), device="cpu", dtype="float32", config=det).logprobs(seqs)
    with Scorer(str(dirs[0]), device="cpu", dtype="float32", config=det,
                tensor_parallel_size=2) as s:
        s.update_weights(_checkpoint(dirs[1]))
        got = s.logprobs(seqs)
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(got, want)), kind
