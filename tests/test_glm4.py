"""GLM-4 dense (``models.glm4``, ``loading.glm4``) against float64 transformers.

A tiny random ``Glm4ForCausalLM`` saved by transformers with ``save_pretrained`` (fused
``gate_up_proj``, q/k/v biases, untied head, partial rotary factor 0.5, every weight random: the
four norms per block included, so a missing or misplaced post-norm shows). The reference is
transformers' forward in float64, its ``Glm4RMSNorm`` (which casts to float32 inside) replaced by
the same function in float64. Ours runs in float32 through ``Scorer``: per-token log-probs within
1e-4; the partial interleaved rotary matters (the same model with full rotary is far off); chunks
and shared prefixes give the same bits as each request alone in deterministic mode.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import VOCAB, byte_tokenizer

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.loading import load_model
from logprobe.loading.glm4 import glm4_config
from logprobe.loading.loader import parallel_context

transformers = pytest.importorskip("transformers")
from transformers.models.glm4 import modeling_glm4 as hfglm4  # noqa: E402

TOL = 1e-4


def _norm64(self, x):
    """transformers' Glm4RMSNorm in float64 (its ``.to(float32)`` would round)."""
    x = x.double()
    return self.weight.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture(scope="module")
def glm4_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfglm4.Glm4RMSNorm, "forward", _norm64)
    d = tmp_path_factory.mktemp("glm4")
    cfg = transformers.Glm4Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
        bos_token_id=1, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Glm4ForCausalLM._from_config(cfg, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_((0.2 if p.dim() == 1 else 0.12) * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(d))
    byte_tokenizer()[0].save_pretrained(str(d))
    yield d, model.double()
    mp.undo()


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def _sequences() -> list[dict]:
    rng = random.Random(5)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    return [{"prompt_token_ids": tok(p), "completion_token_ids": tok(c)} for p, c in ((10, 30), (1, 99), (60, 40))]


def _worst(scorer, ref, seqs) -> float:
    worst = 0.0
    for seq, res in zip(seqs, scorer.logprobs(seqs)):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lo = len(seq["prompt_token_ids"]) - 1
        tgt = _reference(ref, ids)[lo:len(ids) - 1].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
    return worst


def test_logprobs_match_float64_transformers(glm4_dir):
    path, ref = glm4_dir
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert scorer.info.backend == "native" and type(scorer.loaded.model).__name__ == "Glm4Model"
    cfg = scorer.loaded.model.config
    assert cfg.attention_bias and not cfg.tie_word_embeddings and cfg.rope_scaling["partial_rotary_factor"] == 0.5
    seqs = _sequences()
    worst = _worst(scorer, ref, seqs)
    print(f"glm4: max |delta| {worst:.2e}")
    assert worst < TOL
    # the partial rotary is exercised: the same weights with every dim turned are far off
    rope = ref.model.rotary_emb
    saved = rope.inv_freq.clone()
    full = 1.0 / (500.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    try:
        rope.inv_freq = full.float()
        hfcfg = ref.config
        hfcfg.rope_parameters["partial_rotary_factor"] = 1.0
        assert _worst(scorer, ref, seqs) > 1e-2
    finally:
        rope.inv_freq = saved
        ref.config.rope_parameters["partial_rotary_factor"] = 0.5


def test_chunks_and_shared_prefixes_bitwise(glm4_dir):
    path, ref = glm4_dir
    loaded = load_model(str(path), "cpu", "float32")
    rng = random.Random(2)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    ctx = tok(40)
    reqs = [ScoreRequest(ctx + tok(n), len(ctx), top_k=k, entropy=e) for n, k, e in ((25, 5, True), (8, 0, False),
                                                                                     (33, 64, False))]
    reqs += [ScoreRequest(tok(100), 3), ScoreRequest(tok(7), 1, temperature=0.7)]
    alone_scorer = Scorer(loaded, config=EngineConfig(deterministic=True, share_prefixes=False))
    alone = [alone_scorer.engine.run([r])[0] for r in reqs]
    for r, a in zip(reqs, alone):
        lp = torch.log_softmax(_reference(ref, r.tokens) / r.temperature, -1)[r.score_begin - 1:-1]
        assert (a.logprobs.double() - lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0]).abs().max() < TOL
    for budget, share in ((48, True), (64, False), (1 << 20, True)):
        cfg = EngineConfig(max_batch_tokens=budget, deterministic=True, share_prefixes=share)
        out = Scorer(loaded, config=cfg).engine.run(reqs)
        for a, b in zip(alone, out):
            for name in ("logprobs", "entropy", "topk_logprobs", "topk_ids"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (budget, share, name)


def test_hooks_capture_resid_post(glm4_dir):
    path, ref = glm4_dir
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    seq = {"prompt_token_ids": list(range(10, 30)), "completion_token_ids": list(range(30, 45))}
    tokens = seq["prompt_token_ids"] + seq["completion_token_ids"]
    res = scorer.logprobs([seq], capture=[{"at": ["blocks.1.resid_post"], "positions": "all"}])[0]
    with torch.no_grad():
        hs = ref(input_ids=torch.tensor([tokens]), use_cache=False, output_hidden_states=True).hidden_states
    got = res.captures[0].value.double()
    assert (got - hs[2][0]).abs().max() < 1e-4 * max(1.0, hs[2].abs().max().item())


def test_config_refusals(glm4_dir):
    path, _ = glm4_dir
    raw = json.loads((path / "config.json").read_text())
    cfg = glm4_config(raw)
    assert cfg.family == "glm4" and cfg.rope_theta == 500.0
    for key, value, field in [
        ("hidden_act", "gelu", "config.hidden_act"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "config.rope_parameters.rope_type"),
        ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
        ("num_hidden_layers", "3", "config.num_hidden_layers"),
    ]:
        bad = dict(raw, **{key: value})
        with pytest.raises(LogprobeError) as e:
            glm4_config(bad)
        assert e.value.field == field, (key, e.value.field)
    old = {k: v for k, v in raw.items() if k != "rope_parameters"}  # older configs: top-level keys, default 0.5
    old_cfg = glm4_config(dict(old, rope_theta=10000.0))
    assert old_cfg.rope_theta == 10000.0 and old_cfg.rope_scaling["partial_rotary_factor"] == 0.5
    assert parallel_context(cfg, 1, 2).size == 2  # tensor parallelism: tests/test_tp_families.py
    with pytest.raises(LogprobeError) as e:
        parallel_context(cfg, 0, 3)
    assert e.value.field == "tensor_parallel_size"
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    with pytest.raises(LogprobeError, match="weights missing"):  # all or nothing: tests/test_update_gemma4_glm4_gpt_oss.py
        scorer.update_weights({"model.norm.weight": torch.zeros(64)})
