"""GLM-4.5 / 4.6 (``glm4_moe``) and MiniMax-M2 (``minimax_m2``) natively (``models.glm4_moe``,
``models.minimax_m2``, ``loading.sigmoid_moe``) against float64 transformers.

Tiny random checkpoints saved by transformers' own ``Glm4MoeForCausalLM`` / ``MiniMaxM2ForCausalLM``
(``save_pretrained``: per-expert tensors; MiniMax under Mixtral's ``block_sparse_moe.experts.{e}.w1``
names) with the byte tokenizer, hidden 64, 3 blocks, 8 experts, 2 per token, head_dim 16 of which the
first 8 rotate (partial rotary, rotate half). glm4_moe: block 0 dense (``first_k_dense_replace=1``),
4 expert groups of which 2 survive, one shared expert, q/k norm per head, attention biases,
``routed_scaling_factor`` 2.5. minimax_m2: q/k norm over the whole projection, sigmoid router with
its score-correction bias, no groups, no shared expert. Every weight is random, norms and the bias
included.

The reference is transformers' forward in float64 with its RMSNorm in float64. Per-token log-probs
agree to 1e-4 over more than 50 tokens. Routing near-ties: the float64 run's selection gaps must
exceed ``MIN_MARGIN`` on every scored row (asserted); for GLM, grouped routing must change some
token's experts.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from helpers import VOCAB, byte_tokenizer, random_sequences
from test_determinism import random_mix, same

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.loading import load_model
from logprobe.loading.loader import parallel_context
from logprobe.loading.sigmoid_moe import sigmoid_moe_config
from logprobe.models.caps import ModelCaps

transformers = pytest.importorskip("transformers")
from transformers.models.glm4_moe import modeling_glm4_moe as hfglm  # noqa: E402
from transformers.models.minimax_m2 import modeling_minimax_m2 as hfmm  # noqa: E402

TOL = 1e-4
MIN_MARGIN = 1e-5
FAMILIES = ["glm4_moe", "minimax_m2"]
SEEDS = {"glm4_moe": 0, "minimax_m2": 0}
GROUPS = {"glm4_moe": (4, 2), "minimax_m2": (1, 1)}  # (n_group, topk_group)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.1,
              bos_token_id=1, eos_token_id=0, pad_token_id=None)


def make_model(family: str):
    if family == "glm4_moe":
        cfg = transformers.Glm4MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                                         n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                                         use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5,
                                         norm_topk_prob=True, partial_rotary_factor=0.5)
        cls = transformers.Glm4MoeForCausalLM
    else:
        cfg = transformers.MiniMaxM2Config(**COMMON, intermediate_size=32, num_local_experts=8, rotary_dim=8)
        cls = transformers.MiniMaxM2ForCausalLM
    return cls._from_config(cfg, attn_implementation="eager", experts_implementation="eager")


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:  # projections, experts, the router, biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def _norm64(self, x):
    x = x.double()
    return self.weight.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfglm.Glm4MoeRMSNorm, "forward", _norm64)
    mp.setattr(hfmm.MiniMaxM2RMSNorm, "forward", _norm64)
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(family)
        torch.manual_seed(SEEDS[family])
        model = make_model(family).float().eval()
        _randomise(model, seed=SEEDS[family])
        model.save_pretrained(str(d))
        byte_tokenizer()[0].save_pretrained(str(d))
        out[family] = (d, model.double())
    yield out
    mp.undo()


def _reference(model, ids: list[int]):
    """float64 log-probs [L, V] and each MoE block's (router logits [L, E], bias [E], chosen ids [L, k])."""
    routers: list = []
    hooks = []
    for m in model.modules():
        if isinstance(m, hfglm.Glm4MoeTopkRouter):
            hooks.append(m.register_forward_hook(
                lambda mod, _i, o: routers.append((o[0], mod.e_score_correction_bias, o[2]))))
        elif isinstance(m, hfmm.MiniMaxM2TopKRouter):
            hooks.append(m.register_forward_hook(lambda mod, i, o: routers.append((o[0], i[1], o[2]))))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    finally:
        for h in hooks:
            h.remove()
    return torch.log_softmax(logits, dim=-1), routers


def _routing_stats(logits, bias, chosen, rows: int, groups: tuple[int, int]) -> tuple[float, int]:
    """(the smallest selection gap over the first ``rows`` rows, how many rows grouped routing changed)."""
    G, kg = groups
    choice = (torch.sigmoid(logits.double()) + bias.double())[:rows]  # [L, E]
    E = choice.shape[1]
    g = choice.view(rows, G, E // G)
    margin = float("inf")
    kept = choice.clone()
    if kg < G:
        group = g.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values  # [L, G]
        margin = (group[:, kg - 1] - group[:, kg]).min().item()
        keep = g.topk(2, dim=-1).values.sum(-1).topk(kg, dim=-1).indices
        mask = torch.zeros(rows, G, dtype=torch.bool).scatter_(1, keep, True).repeat_interleave(E // G, dim=1)
        kept[~mask] = -torch.inf
    top = kept.sort(dim=-1, descending=True).values
    margin = min(margin, (top[:, 1] - top[:, 2]).min().item())  # k = 2
    ungrouped = choice.topk(2, dim=-1).indices.sort(-1).values
    changed = (ungrouped != chosen[:rows].sort(-1).values).any(-1).sum().item()
    return margin, changed


def _sequences() -> list[dict]:
    seqs = random_sequences(4, seed=7, max_prompt=30, max_completion=50)
    seqs.append({"prompt_token_ids": list(range(2, 42)), "completion_token_ids": list(range(60, 100))})  # 80 tokens
    return seqs


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_match_float64_transformers(family, dirs):
    path, ref = dirs[family]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    want = {"glm4_moe": "Glm4MoeModel", "minimax_m2": "MiniMaxM2Model"}[family]
    assert scorer.info.backend == "native" and type(scorer.loaded.model).__name__ == want
    seqs = _sequences()
    out = scorer.logprobs(seqs)
    compared, worst, margin, changed = 0, 0.0, float("inf"), 0
    for seq, res in zip(seqs, out):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lp, routers = _reference(ref, ids)
        assert len(routers) == (2 if family == "glm4_moe" else 3)
        lo, hi = len(seq["prompt_token_ids"]) - 1, len(ids) - 1
        tgt = lp[lo:hi].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
        compared += len(tgt)
        for logits, bias, chosen in routers:  # rows 0..hi-1 feed the scored rows (causal)
            m, c = _routing_stats(logits, bias, chosen, hi, GROUPS[family])
            margin, changed = min(margin, m), changed + c
    assert compared > 50 and len(seqs) >= 5
    if family == "glm4_moe":
        assert changed > 0, "grouped routing never changed a token's experts: the test would not see it"
    assert margin > MIN_MARGIN, f"router near-tie {margin:.2e}: pick another seed"
    print(f"{family}: max |delta| {worst:.2e} over {compared} tokens, router margin {margin:.2e}, "
          f"{changed} rows rerouted by groups")
    assert worst < TOL, f"{family}: max |delta log-prob| {worst:.2e} over {compared} tokens"


@pytest.mark.parametrize("family", FAMILIES)
def test_chunks_and_shared_prefixes_are_bitwise(family, dirs):
    """Deterministic mode: each request alone, or packed with shared prefixes and cut into chunks by a
    64-token budget (``test_determinism.random_mix``), gives the same bits."""
    loaded = load_model(str(dirs[family][0]), "cpu", "float32")
    assert ModelCaps.of(loaded.model) == ModelCaps(context=True, hooks=True, tensor_parallel=True)
    reqs = random_mix(seed=3, vocab=VOCAB)
    alone = [Scorer(loaded, config=EngineConfig(deterministic=True, share_prefixes=False)).engine.run([r])[0]
             for r in reqs]
    for budget in (64, 1 << 20):
        cfg = EngineConfig(max_batch_tokens=budget, deterministic=True, share_prefixes=True)
        for a, b in zip(alone, Scorer(loaded, config=cfg).engine.run(reqs)):
            same(a, b, exact=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_capture_mtp_skipped_and_refusals(family, dirs, tmp_path, caplog):
    """Router scores are the reference's sigmoid; an extra MTP layer is skipped with a note and scores
    the same; weight updates and tensor_parallel_size 3 (not dividing the 4 heads) are refused,
    naming the field (TP = 2 splits: tests/test_moe_parallel.py)."""
    from safetensors.torch import save_file

    src, ref = dirs[family]
    d = tmp_path / "with_mtp"
    shutil.copytree(src, d)
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128)}, str(d / "model-mtp.safetensors"))
    seqs = _sequences()[:2]
    with caplog.at_level(logging.WARNING, logger="logprobe.loading.sigmoid_moe"):
        scorer = Scorer(str(d), device="cpu", dtype="float32", progress=False)
    assert "multi-token-prediction layer 3" in caplog.text
    base = Scorer(str(src), device="cpu", dtype="float32", progress=False)
    for a, b in zip(scorer.logprobs(seqs), base.logprobs(seqs)):
        assert torch.equal(a.logprobs, b.logprobs)
    seq = {"prompt_token_ids": list(range(10, 40)), "completion_token_ids": list(range(40, 60))}
    tokens = seq["prompt_token_ids"] + seq["completion_token_ids"]
    res = base.logprobs([seq], capture=[{"at": ["blocks.1.router"], "positions": "all"}])[0]
    _, routers = _reference(ref, tokens)
    got = res.captures[0].value
    assert got.shape == (len(tokens), 8)
    assert (got.double() - torch.sigmoid(routers[1 if family == "minimax_m2" else 0][0].double())).abs().max() < 1e-5
    with pytest.raises(LogprobeError, match="missing"):  # a partial update (tests/test_update_families.py)
        scorer.update_weights({"lm_head.weight": torch.zeros(VOCAB, 64)})
    assert parallel_context(base.loaded.model.config, 0, 2, None, 2).experts == 2
    with pytest.raises(LogprobeError) as e:
        parallel_context(base.loaded.model.config, 0, 3)
    assert e.value.field == "tensor_parallel_size"


@pytest.mark.parametrize("raw, field", [
    ({"model_type": "glm4_moe", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "config.rope_parameters.rope_type"),
    ({"model_type": "glm4_moe", "hidden_act": "gelu"}, "config.hidden_act"),
    ({"model_type": "glm4_moe", "quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ({"model_type": "minimax_m2", "scoring_func": "softmax"}, "config.scoring_func"),
    ({"model_type": "minimax_m2", "use_routing_bias": False}, "config.use_routing_bias"),
    ({"model_type": "minimax_m2", "qk_norm_type": "per_head"}, "config.qk_norm_type"),
    ({"model_type": "minimax_m2", "attn_type_list": [0, 1]}, "config.attn_type_list"),
    ({"model_type": "minimax_m2", "shared_intermediate_size": 64}, "config.shared_intermediate_size"),
])
def test_config_refusals_name_the_key(raw, field):
    with pytest.raises(LogprobeError) as e:
        sigmoid_moe_config(raw)
    assert e.value.field == field


def test_released_config_shapes():
    """The hub's config.json keys (top-level rope_theta / partial_rotary_factor / rotary_dim) read as
    transformers reads them."""
    glm = sigmoid_moe_config({"model_type": "glm4_moe", "hidden_size": 5120, "num_attention_heads": 96,
                              "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 1000000,
                              "n_group": 1, "topk_group": 1, "n_routed_experts": 160, "first_k_dense_replace": 3,
                              "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "rope_scaling": None})
    assert (glm.head_dim, glm.rotary_dim, glm.rope_theta, glm.moe.dense_layers) == (128, 64, 1e6, (0, 1, 2))
    mm = sigmoid_moe_config({"model_type": "minimax_m2", "rotary_dim": 64, "head_dim": 128, "rope_theta": 5e6,
                             "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                             "qk_norm_type": "per_layer", "attn_type_list": [1] * 62, "shared_intermediate_size": 0,
                             "use_mtp": True, "num_mtp_modules": 3})
    assert (mm.rotary_dim, mm.qk_norm_full, mm.moe.n_group, mm.moe.shared_intermediate_size) == (64, True, 1, 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_routed_experts_replay_and_steering(family, dirs):
    """Routed experts (R3) are the reference's choice in each MoE block and replay to the same bits;
    steering with a zero vector changes nothing; GLM's dense block 0 has no router point; a
    tensor-parallel size not dividing the heads is refused naming tensor_parallel_size."""
    path, ref = dirs[family]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    seq = {"prompt_token_ids": list(range(10, 40)), "completion_token_ids": list(range(40, 60))}
    tokens = seq["prompt_token_ids"] + seq["completion_token_ids"]
    _, routers = _reference(ref, tokens)
    plain = scorer.logprobs([seq])[0].logprobs
    routed = torch.as_tensor(scorer.logprobs([seq], return_routed_experts=True)[0].routed_experts)
    assert routed.shape == (len(tokens) - 1, 2 if family == "glm4_moe" else 3, 2)  # [L, MoE blocks, k]
    for j, (_, _, chosen) in enumerate(routers):
        assert torch.equal(routed[:, j].sort(-1).values.long(), chosen[:len(tokens) - 1].sort(-1).values)
    assert torch.equal(scorer.logprobs([dict(seq, routed_experts=routed)])[0].logprobs, plain)
    steered = scorer.logprobs([seq], steer=[{"at": "blocks.1.attn_out", "vector": [0.0] * 64}])[0]
    assert torch.equal(steered.logprobs, plain)
    if family == "glm4_moe":
        with pytest.raises(LogprobeError, match="no router"):
            scorer.logprobs([seq], capture=[{"at": "blocks.0.router"}])
    with pytest.raises(LogprobeError) as e:
        Scorer(str(path), device="cpu", dtype="float32", progress=False, tensor_parallel_size=3)
    assert e.value.field == "tensor_parallel_size"
