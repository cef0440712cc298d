"""DeepSeek-V3-style models (``models.deepseek``, ``loading.deepseek``) against float64 transformers.

Tiny random ``deepseek_v3`` checkpoints saved by transformers' own ``DeepseekV3ForCausalLM``
(``save_pretrained``, per-expert tensors) with the byte tokenizer: block 0 dense
(``first_k_dense_replace=1``), the others 8 routed experts in 4 groups of which 2 survive, 2 per
token, one shared expert. Three variants: the low-rank q path with interleaved rope (the released
layout); a plain ``q_proj`` (``q_lora_rank`` null) with rotate-half rope and attention biases;
YaRN rope with ``mscale`` != ``mscale_all_dim`` (both the cos/sin factor and the softmax scale
differ from 1) on sequences longer than ``original_max_position_embeddings``. Every weight is
random, norms and the score-correction bias included (transformers initialises them to 1 and 0).

The reference is transformers' forward in float64 with its RMSNorm computed in float64 (its
``.to(torch.float32)`` would round); its router stays float32 as transformers defines it (ours is
float32 too). Per-token log-probs agree to 1e-4 over more than 50 tokens of several sequences.
Routing near-ties: the float64 run's gaps (group scores around the ``topk_group``-th, chosen
experts around the k-th) must exceed ``MIN_MARGIN`` on every scored row (asserted; seeds chosen),
and grouped routing must change some token's experts (it would otherwise be untested).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import VOCAB, byte_tokenizer, random_sequences
from test_determinism import random_mix, same

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.loading import load_model
from logprobe.loading.deepseek import deepseek_config, deepseek_param_name
from logprobe.loading.loader import parallel_context
from logprobe.models.caps import ModelCaps

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hfds  # noqa: E402

TOL = 1e-4
MIN_MARGIN = 1e-5
KINDS = ["qlora", "plain_q", "yarn"]
SEEDS = {"qlora": 0, "plain_q": 1, "yarn": 2}
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, max_position_embeddings=512, initializer_range=0.1, bos_token_id=1, eos_token_id=0,
            routed_scaling_factor=2.5, norm_topk_prob=True)
VARIANTS = {
    "qlora": dict(num_hidden_layers=4, q_lora_rank=24, rope_interleave=True),
    "plain_q": dict(num_hidden_layers=3, q_lora_rank=None, rope_interleave=False, attention_bias=True),
    "yarn": dict(num_hidden_layers=3, q_lora_rank=24, rope_interleave=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
}


def make_model(kind: str):
    cfg = transformers.DeepseekV3Config(**BASE, **VARIANTS[kind])
    return transformers.DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="eager",
                                                           experts_implementation="eager")


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
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
def ds_dirs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(hfds.DeepseekV3RMSNorm, "forward", _norm64)
    out = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp(kind)
        torch.manual_seed(SEEDS[kind])
        model = make_model(kind).float().eval()
        _randomise(model, seed=SEEDS[kind])
        model.save_pretrained(str(d))
        byte_tokenizer()[0].save_pretrained(str(d))
        out[kind] = (d, model.double())
    yield out
    mp.undo()


def _reference(model, ids: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """float64 log-probs [L, V] and each MoE block's (router logits [L, E], bias [E], chosen ids [L, k])."""
    routers: list = []
    hooks = [m.register_forward_hook(lambda mod, _i, o: routers.append((o[0], mod.e_score_correction_bias, o[2])))
             for m in model.modules() if isinstance(m, hfds.DeepseekV3TopkRouter)]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    finally:
        for h in hooks:
            h.remove()
    return torch.log_softmax(logits, dim=-1), routers


def _routing_stats(logits: torch.Tensor, bias: torch.Tensor, chosen: torch.Tensor, rows: int) -> tuple[float, int]:
    """(the smallest selection gap over the first ``rows`` rows, how many rows grouped routing changed)."""
    choice = (torch.sigmoid(logits.double()) + bias.double())[:rows]  # [L, E]
    g = choice.view(rows, 4, 2)
    group = g.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values  # [L, 4]
    margin = (group[:, 1] - group[:, 2]).min().item()  # topk_group = 2
    kept = choice.clone()
    keep = g.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    mask = torch.zeros(rows, 4, dtype=torch.bool).scatter_(1, keep, True).repeat_interleave(2, dim=1)
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


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_match_float64_transformers(kind, ds_dirs):
    path, ref = ds_dirs[kind]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert scorer.info.backend == "native" and type(scorer.loaded.model).__name__ == "DeepseekModel"
    seqs = _sequences()
    out = scorer.logprobs(seqs)
    compared, worst, margin, changed = 0, 0.0, float("inf"), 0
    for seq, res in zip(seqs, out):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lp, routers = _reference(ref, ids)
        lo, hi = len(seq["prompt_token_ids"]) - 1, len(ids) - 1
        tgt = lp[lo:hi].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
        compared += len(tgt)
        for logits, bias, chosen in routers:  # rows 0..hi-1 feed the scored rows (causal)
            m, c = _routing_stats(logits, bias, chosen, hi)
            margin, changed = min(margin, m), changed + c
    assert compared > 50 and len(seqs) >= 5
    assert max(len(s["prompt_token_ids"]) + len(s["completion_token_ids"]) for s in seqs) > 64
    assert changed > 0, "grouped routing never changed a token's experts: the test would not see it"
    assert margin > MIN_MARGIN, f"router near-tie {margin:.2e}: pick another seed"
    print(f"{kind}: max |delta| {worst:.2e} over {compared} tokens, router margin {margin:.2e}, "
          f"{changed} rows rerouted by groups")
    assert worst < TOL, f"{kind}: max |delta log-prob| {worst:.2e} over {compared} tokens"


def test_config_reading(ds_dirs):
    raw = json.loads((ds_dirs["yarn"][0] / "config.json").read_text())
    cfg = deepseek_config(raw)
    assert (cfg.q_lora_rank, cfg.qk_head_dim, cfg.first_k_dense_replace, cfg.moe.n_group, cfg.moe.topk_group) == \
        (24, 24, 1, 4, 2)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.scale != cfg.qk_head_dim ** -0.5
    # the hub's layout: rope_theta at the top, rope_scaling with "type"
    hub = dict(raw, rope_theta=10000.0, rope_scaling=dict(raw["rope_parameters"], type="yarn"))
    hub.pop("rope_parameters")
    hub["rope_scaling"].pop("rope_type")
    assert deepseek_config(hub).rope_scaling == cfg.rope_scaling
    plain = deepseek_config(json.loads((ds_dirs["plain_q"][0] / "config.json").read_text()))
    assert plain.q_lora_rank is None and not plain.rope_interleave and plain.rope_scaling is None
    for key, value, field in [
        ("quantization_config", {"quant_method": "bitsandbytes"}, "quantization_config"),
        ("topk_method", "greedy", "config.topk_method"),
        ("scoring_func", "softmax", "config.scoring_func"),
        ("hidden_act", "gelu", "config.hidden_act"),
        ("num_key_value_heads", 2, "config.num_key_value_heads"),
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "config.rope_parameters.rope_type"),
        ("topk_group", 5, "config.topk_group"),
        ("n_group", 3, "config.n_group"),
    ]:
        with pytest.raises(LogprobeError) as e:
            deepseek_config(dict(raw, **{key: value}))
        assert e.value.field == field, (key, e.value)
    assert parallel_context(cfg, 0, 2, None, 2).experts == 2  # split (tests/test_moe_parallel.py)
    with pytest.raises(LogprobeError) as e:
        parallel_context(cfg, 0, 3)
    assert e.value.field == "tensor_parallel_size" and "attention heads" in str(e.value)
    assert deepseek_param_name("model.layers.3.eh_proj.weight", cfg, "f") is None  # MTP layer (3 layers)
    assert deepseek_param_name("model.layers.0.mlp.shared_experts.up_proj.weight", cfg, "f") == \
        "layers.0.mlp.shared_expert.up_proj.weight"
    with pytest.raises(LogprobeError, match="unexpected tensor"):
        deepseek_param_name("mtp.0.weight", cfg, "f")


def test_mtp_layer_skipped_and_partial_update_refused(ds_dirs, tmp_path, caplog):
    """A checkpoint with the released models' extra MTP layer (``model.layers.{num_hidden_layers}``)
    scores the same; a partial weight update is refused."""
    import shutil

    from safetensors.torch import save_file

    src, _ = ds_dirs["plain_q"]
    d = tmp_path / "with_mtp"
    shutil.copytree(src, d)
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
               "model.layers.3.shared_head.norm.weight": torch.ones(64)}, str(d / "model-mtp.safetensors"))
    seqs = _sequences()[:2]
    with caplog.at_level(logging.WARNING, logger="logprobe.loading.deepseek"):
        scorer = Scorer(str(d), device="cpu", dtype="float32", progress=False)
    assert "multi-token-prediction layer 3" in caplog.text
    base = Scorer(str(src), device="cpu", dtype="float32", progress=False)
    for a, b in zip(scorer.logprobs(seqs), base.logprobs(seqs)):
        assert torch.equal(a.logprobs, b.logprobs)
    with pytest.raises(LogprobeError, match="missing"):  # a partial update (tests/test_update_families.py)
        scorer.update_weights({"lm_head.weight": torch.zeros(VOCAB, 64)})


def test_capture_router_and_hooks(ds_dirs):
    """Router scores of an MoE block against the reference's sigmoid; block 0 (dense) has no router
    point; steering with a zero vector changes nothing; routed experts are the reference's choice
    and replay to the same bits."""
    path, ref = ds_dirs["qlora"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    seq = {"prompt_token_ids": list(range(10, 40)), "completion_token_ids": list(range(40, 60))}
    tokens = seq["prompt_token_ids"] + seq["completion_token_ids"]
    res = scorer.logprobs([seq], capture=[{"at": ["blocks.1.router", "blocks.*.resid_post"], "positions": "all"}])[0]
    got = {c.at: c.value for c in res.captures}
    _, routers = _reference(ref, tokens)
    assert got["blocks.1.router"].shape == (len(tokens), 8)
    assert (got["blocks.1.router"].double() - torch.sigmoid(routers[0][0].double())).abs().max() < 1e-5
    assert got["blocks.3.resid_post"].shape == (len(tokens), 64)
    with pytest.raises(LogprobeError, match="no router"):
        scorer.logprobs([seq], capture=[{"at": "blocks.0.router"}])
    plain = scorer.logprobs([seq])[0].logprobs
    steered = scorer.logprobs([seq], steer=[{"at": "blocks.1.attn_out", "vector": [0.0] * 64}])[0]
    assert torch.equal(steered.logprobs, plain)
    # routed experts (R3): the grouped router's choice, per MoE block; replaying them changes nothing
    routed = torch.as_tensor(scorer.logprobs([seq], return_routed_experts=True)[0].routed_experts)
    assert routed.shape == (len(tokens) - 1, 3, 2)
    for j, (_, _, chosen) in enumerate(routers):
        assert torch.equal(routed[:, j].sort(-1).values.long(), chosen[:len(tokens) - 1].sort(-1).values)
    replayed = scorer.logprobs([dict(seq, routed_experts=routed)])[0]
    assert torch.equal(replayed.logprobs, plain)


@pytest.mark.parametrize("kind", ["qlora", "yarn"])
def test_chunks_and_shared_prefixes_are_bitwise(kind, ds_dirs):
    """Deterministic mode: each request alone, or packed with shared prefixes and cut into chunks by
    a 64-token budget (``test_determinism.random_mix``: shared contexts, duplicates, a prefix of
    another, partial windows, mixed head options), gives the same bits."""
    loaded = load_model(str(ds_dirs[kind][0]), "cpu", "float32")
    assert ModelCaps.of(loaded.model) == ModelCaps(context=True, hooks=True, tensor_parallel=True)
    reqs = random_mix(seed=3, vocab=VOCAB)
    alone = [Scorer(loaded, config=EngineConfig(deterministic=True, share_prefixes=False)).engine.run([r])[0]
             for r in reqs]
    for budget in (64, 1 << 20):
        cfg = EngineConfig(max_batch_tokens=budget, deterministic=True, share_prefixes=True)
        for a, b in zip(alone, Scorer(loaded, config=cfg).engine.run(reqs)):
            same(a, b, exact=True)


@pytest.mark.slow  # slow tier (pytest -m slow): starts two worker processes (~10 s)
def test_data_parallel_and_tensor_parallel_refused(ds_dirs):
    """Two data-parallel worker processes give the single process's bits; a tensor-parallel size that
    does not divide the heads is refused before any process starts, naming tensor_parallel_size
    (TP and EP = 2 and 4: tests/test_moe_parallel.py)."""
    path, _ = ds_dirs["qlora"]
    seqs = _sequences()
    # deterministic mode: each worker packs its share of the sequences differently, and without it an
    # expert's product depends on how many rows it gets
    one = Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True).logprobs(seqs)
    with Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True,
                data_parallel_size=2) as dp:
        two = dp.logprobs(seqs)
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(one, two))
    with pytest.raises(LogprobeError) as e:
        Scorer(str(path), device="cpu", dtype="float32", progress=False, tensor_parallel_size=3)
    assert e.value.field == "tensor_parallel_size" and "attention heads" in str(e.value)
