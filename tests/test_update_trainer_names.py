"""A trainer's own call, ``update_weights(model.named_parameters())``, on the families whose
transformers model holds a weight as a buffer: the sigmoid routers' ``mlp.gate.e_score_correction_bias``
(DeepSeek-V3, GLM-4.5) and Gemma 4's per-block ``layer_scalar``. ``named_parameters()`` lacks them.

Each kind saves a tiny random transformers model as checkpoint A, then draws its parameters anew
(the buffers unchanged: what a trainer's gradient steps do) and saves checkpoint B. A scorer loaded
from A given the live model's ``named_parameters()`` (a stream) scores as a fresh scorer of B,
bitwise, and says which buffers it kept, by transformers' names. Then the buffers change too (as
aux-loss-free load balancing changes the bias) and ``named_parameters()`` + ``named_buffers()``
(a list) gives bitwise a fresh load of that checkpoint C. Some buffers sent and others not are
refused, and so is a layer's expert stack left out, named as the trainer sends it
(``experts.gate_up_proj``), not per expert.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import byte_tokenizer, random_sequences

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig

transformers = pytest.importorskip("transformers")
import test_deepseek  # noqa: E402
import test_gemma4  # noqa: E402
import test_moe_sigmoid_families  # noqa: E402

DET = EngineConfig(deterministic=True, progress=False)
KINDS = {
    "deepseek_v3": (lambda: test_deepseek.make_model("qlora"), "model.layers.1.mlp.gate.e_score_correction_bias"),
    "glm4_moe": (lambda: test_moe_sigmoid_families.make_model("glm4_moe"),
                 "model.layers.1.mlp.gate.e_score_correction_bias"),
    "gemma4": (lambda: test_gemma4._model("gemma4"), "model.language_model.layers.0.layer_scalar"),
}


def _draw(tensors, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in tensors:
            if t.is_floating_point() and "rotary" not in name and not name.endswith(("inv_freq", "embed_scale")):
                t.copy_((1.0 if t.dim() == 1 else 0.0) + 0.1 * torch.randn(t.shape, generator=gen))


def _save(model, d) -> str:
    model.save_pretrained(str(d))
    byte_tokenizer()[0].save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request, tmp_path_factory):
    """(kind, the live transformers model at C, checkpoints A, B, C, a buffer's transformers name)."""
    make, buffer = KINDS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = make().float().eval()
    _draw(model.named_parameters(), 1)
    _draw(model.named_buffers(), 2)
    a = _save(model, root / "a")
    _draw(model.named_parameters(), 3)  # a trainer's step: parameters only
    b = _save(model, root / "b")
    params_b = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    _draw(model.named_buffers(), 4)  # the bias balanced anew too
    c = _save(model, root / "c")
    assert buffer in dict(model.named_buffers()) and buffer not in dict(model.named_parameters())
    return request.param, model, params_b, a, b, c, buffer


def _lps(s: Scorer, seqs) -> list[torch.Tensor]:
    return [r.logprobs for r in s.logprobs(seqs)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_named_parameters_then_buffers_equal_fresh_loads(kind, caplog):
    name, model, params_b, a, b, c, buffer = kind
    seqs = random_sequences(2, seed=5, max_prompt=16, max_completion=16)
    scorer = Scorer(a, device="cpu", dtype="float32", config=DET)
    old, fresh_b = _lps(scorer, seqs), _lps(Scorer(b, device="cpu", dtype="float32", config=DET), seqs)
    assert not _same(old, fresh_b)
    with caplog.at_level(logging.WARNING, logger="logprobe.loading.update"):
        scorer.update_weights(iter(params_b))  # named_parameters(): a stream without the buffers
    got = _lps(scorer, seqs)
    assert _same(got, fresh_b), f"{name}: named_parameters() != fresh load"
    assert f"kept {len([n for n, _ in model.named_buffers() if n.endswith(buffer.rpartition('.')[2])])}" \
        in caplog.text and buffer in caplog.text, caplog.text

    fresh_c = _lps(Scorer(c, device="cpu", dtype="float32", config=DET), seqs)
    assert not _same(got, fresh_c)  # the buffers changed the numbers
    scorer.update_weights(list(model.named_parameters()) + list(model.named_buffers()))
    assert _same(_lps(scorer, seqs), fresh_c), f"{name}: named_parameters() + named_buffers() != fresh load"


def _per_expert(params) -> list[tuple[str, torch.Tensor]]:
    """The stacked experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])
    under checkpoint names, one matrix per expert."""
    out = []
    for n, w in params:
        if n.endswith(".mlp.experts.gate_up_proj"):
            base, half = n.removesuffix("gate_up_proj"), w.shape[1] // 2
            out += [(f"{base}{e}.{p}.weight", w[e, k * half:(k + 1) * half])
                    for e in range(w.shape[0]) for k, p in enumerate(("gate_proj", "up_proj"))]
        elif n.endswith(".mlp.experts.down_proj"):
            out += [(f"{n.removesuffix('down_proj')}{e}.down_proj.weight", w[e]) for e in range(w.shape[0])]
    return out


def test_partial_buffers_and_missing_experts_refused(kind):
    name, model, _, a, _, _, buffer = kind
    scorer = Scorer(a, device="cpu", dtype="float32", config=DET)
    params = list(model.named_parameters())
    with pytest.raises(LogprobeError, match=r"1 weight missing: " + buffer.replace(".", r"\.")):
        scorer.update_weights(params + [(n, t) for n, t in model.named_buffers()
                                        if n.endswith(buffer.rpartition(".")[2]) and n != buffer])
    if name == "gemma4":
        return
    stack = "model.layers.1.mlp.experts.gate_up_proj"
    with pytest.raises(LogprobeError, match=r"1 weight missing: model\.layers\.1\.mlp\.experts\.gate_up_proj;"):
        scorer.update_weights([(n, t) for n, t in params if n != stack])
    one = _per_expert(params)
    rest = [(n, t) for n, t in params if ".mlp.experts." not in n]
    scorer.update_weights(rest + one)  # checkpoint names, one expert at a time
    with pytest.raises(LogprobeError, match=r"1 weight missing: model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight;"):
        scorer.update_weights(rest + [p for p in one if p[0] != "model.layers.1.mlp.experts.3.down_proj.weight"])
