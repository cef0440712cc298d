"""The hybrid linear-attention Qwen families (``models.qwen3_next``) against float64 transformers.

Four tiny random checkpoints, saved by transformers' own classes with ``save_pretrained``: Qwen3.5
dense (``Qwen3_5ForCausalLM``), Qwen3.5 multimodal (``Qwen3_5ForConditionalGeneration``: text
weights under ``model.language_model.``, a vision tower to skip), Qwen3.5 MoE multimodal
(``Qwen3_5MoeForConditionalGeneration``) and Qwen3-Next (fused ``in_proj_qkvz`` / ``in_proj_ba``,
one dense block through ``mlp_only_layers``). Each has linear- and full-attention blocks and every
weight random, the (1 + w) norms, A_log, dt_bias and the gated norm included (transformers
initialises the norms to the identity, which would hide a w vs 1 + w mix-up).

The reference is transformers' forward in float64. Its gated delta rule, gated norm and (1 + w)
RMSNorm cast to float32 inside, so those code objects run with ``torch.float32`` read as float64
(as ``test_gated_delta`` does): the reference is float64 throughout. Ours runs in float32 through
``Scorer`` (the engine, the packed batch, the log-prob head); per-token log-probs must agree to
1e-4 over more than 50 tokens of several sequences, some longer than the rule's 64-token chunk.

MoE near-ties: as in ``test_moe``, the float64 router's gap between the k-th and (k+1)-th
probability of every scored token must exceed ``MIN_MARGIN`` (asserted; the float32 router's error
is ~1e-7, so both pick the same experts and the 1e-4 comparison is not luck). The MoE seeds were
chosen so that it holds.
"""

from __future__ import annotations

import inspect
import json
import random
import types

import pytest
import torch
from helpers import VOCAB, byte_tokenizer, random_sequences

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.loading import load_model
from logprobe.loading.hybrid import hybrid_config, hybrid_param_name
from logprobe.loading.loader import parallel_context
from logprobe.models.caps import ModelCaps

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf35  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf35moe  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as hfnext  # noqa: E402

TOL = 1e-4
MIN_MARGIN = 1e-4
KINDS = ["qwen3_5_text", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
SEEDS = {"qwen3_5_text": 100, "qwen3_5": 101, "qwen3_5_moe": 109, "qwen3_next": 103}  # MoE: chosen for MIN_MARGIN
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=512, initializer_range=0.1, bos_token_id=1, eos_token_id=0,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"], **LINEAR)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)


def make_model(kind: str):
    """transformers' model of ``kind``: eager attention and experts (its grouped_mm has no float64)."""
    model = _config_and_class(kind)
    return model[1]._from_config(model[0], attn_implementation="eager", experts_implementation="eager")


def _config_and_class(kind: str):
    tf = transformers
    if kind == "qwen3_5_text":  # partial rotary 1/2 of the head here (0.25 is the default, the next ones)
        cfg = tf.Qwen3_5TextConfig(**TEXT, intermediate_size=96, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
        return cfg, tf.Qwen3_5ForCausalLM
    if kind == "qwen3_5":
        mrope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                 "mrope_interleaved": True}  # as the hub's configs (text positions: every section the same)
        return (tf.Qwen3_5Config(text_config=dict(**TEXT, intermediate_size=96, rope_parameters=mrope),
                                 vision_config=VISION),
                tf.Qwen3_5ForConditionalGeneration)
    if kind == "qwen3_5_moe":
        return (tf.Qwen3_5MoeConfig(text_config=dict(**TEXT, **MOE), vision_config=VISION),
                tf.Qwen3_5MoeForConditionalGeneration)
    if kind == "qwen3_next":  # block 2 dense (mlp_only_layers), top-2 renormalised
        return (tf.Qwen3NextConfig(**TEXT, **MOE, intermediate_size=96, mlp_only_layers=[2], norm_topk_prob=True),
                tf.Qwen3NextForCausalLM)
    raise ValueError(kind)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log())
            elif p.dim() == 1:  # norms (offsets and the gated norm's weight), dt_bias
                p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


class _TorchFloat32IsFloat64:
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _float64(fn):
    """``fn``'s code with ``torch.float32`` meaning float64 (and ``.float()`` left to the caller)."""
    fn = inspect.unwrap(fn)
    out = types.FunctionType(fn.__code__, dict(fn.__globals__, torch=_TorchFloat32IsFloat64()), fn.__name__,
                             fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _offset_norm64(self, x):
    """transformers' (1 + w) RMSNorm in float64 (its ``.float()`` casts would round to float32)."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.double())


@pytest.fixture(scope="module")
def float64_reference():
    """transformers' hybrid modules computing in float64 while the fixture lives."""
    mp = pytest.MonkeyPatch()
    for mod, prefix in ((hf35, "Qwen3_5"), (hf35moe, "Qwen3_5Moe"), (hfnext, "Qwen3Next")):
        mp.setattr(mod, "torch_chunk_gated_delta_rule", _float64(mod.torch_chunk_gated_delta_rule))
        gated = getattr(mod, f"{prefix}RMSNormGated")
        mp.setattr(gated, "forward", _float64(gated.forward))
        mp.setattr(getattr(mod, f"{prefix}RMSNorm"), "forward", _offset_norm64)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory, float64_reference):
    out = {}
    for i, kind in enumerate(KINDS):
        d = tmp_path_factory.mktemp(kind)
        torch.manual_seed(i)
        model = make_model(kind).float().eval()
        _randomise(model, seed=SEEDS[kind])
        model.save_pretrained(str(d))
        byte_tokenizer()[0].save_pretrained(str(d))
        out[kind] = (d, model.double())
    return out


def _reference(model, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """float64 log-probs [L, V] and each MoE block's router probabilities [L, E]."""
    routers: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: routers.append(torch.softmax(o[0].double(), -1)))
             for name, m in model.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    finally:
        for h in hooks:
            h.remove()
    return torch.log_softmax(logits, dim=-1), routers


def _sequences() -> list[dict]:
    seqs = random_sequences(4, seed=7, max_prompt=30, max_completion=60)
    seqs.append({"prompt_token_ids": list(range(2, 42)), "completion_token_ids": list(range(60, 100))})  # 80 tokens
    return seqs


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_match_float64_transformers(kind, hybrid_dirs):
    path, ref = hybrid_dirs[kind]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    assert scorer.info.backend == "native"
    assert type(scorer.loaded.model).__name__ == "HybridModel"
    seqs = _sequences()
    out = scorer.logprobs(seqs)
    compared, worst, margin = 0, 0.0, float("inf")
    for seq, res in zip(seqs, out):
        ids = seq["prompt_token_ids"] + seq["completion_token_ids"]
        lp, routers = _reference(ref, ids)
        lo, hi = len(seq["prompt_token_ids"]) - 1, len(ids) - 1
        tgt = lp[lo:hi].gather(1, torch.tensor(seq["completion_token_ids"])[:, None])[:, 0]
        worst = max(worst, (res.logprobs.double() - tgt).abs().max().item())
        compared += len(tgt)
        for p in routers:  # rows 0..hi-1 feed the scored rows (causal)
            top = p[:hi].topk(3, dim=-1).values
            margin = min(margin, (top[:, 1] - top[:, 2]).min().item())
    assert compared > 50 and len(seqs) >= 5
    assert max(len(s["prompt_token_ids"]) + len(s["completion_token_ids"]) for s in seqs) > 64
    if kind in ("qwen3_5_moe", "qwen3_next"):
        assert margin > MIN_MARGIN, f"router near-tie {margin:.2e}: pick another seed"
    print(f"{kind}: max |delta| {worst:.2e} over {compared} tokens, router margin {margin:.2e}")
    assert worst < TOL, f"{kind}: max |delta log-prob| {worst:.2e} over {compared} tokens"


def test_packed_and_alone_agree(hybrid_dirs):
    """A sequence scored alone and packed among others: the same numbers (linear state per segment)."""
    path, _ = hybrid_dirs["qwen3_5"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    seqs = _sequences()
    together = scorer.logprobs(seqs)
    for seq, res in zip(seqs, together):
        alone = scorer.logprobs([seq])[0]
        assert (alone.logprobs - res.logprobs).abs().max().item() < 1e-5


def test_config_refusals(hybrid_dirs):
    raw = json.loads((hybrid_dirs["qwen3_5"][0] / "config.json").read_text())
    cfg = hybrid_config(raw)
    assert cfg.family == "qwen3_5_text" and cfg.layer_types[1] == "full_attention" and cfg.rotary_dim == 8
    for key, value, field in [
        ("attention_bias", True, "config.text_config.attention_bias"),
        ("layer_types", ["linear_attention", "sliding_attention"] * 2, "config.text_config.layer_types"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
         "config.text_config.rope_parameters.rope_type"),
        ("hidden_act", "gelu", "config.text_config.hidden_act"),
    ]:
        bad = json.loads(json.dumps(raw))
        bad["text_config"][key] = value
        with pytest.raises(LogprobeError) as e:
            hybrid_config(bad)
        assert e.value.field == field
    assert parallel_context(cfg, 0, 2).size == 2  # dense: split by heads (tests/test_hybrid_tp.py)
    moe = hybrid_config(json.loads((hybrid_dirs["qwen3_5_moe"][0] / "config.json").read_text()))
    assert parallel_context(moe, 0, 2, None, 2).experts == 2  # experts split (tests/test_moe_parallel.py)
    with pytest.raises(LogprobeError) as e:
        parallel_context(moe, 0, 4)
    assert e.value.field == "tensor_parallel_size" and "linear_num_key_heads 2" in str(e.value)


def _mix(seed: int) -> list[ScoreRequest]:
    """Groups sharing a 70-token context (shared prefixes cut back to 64, the state grid), and long
    requests (chunks at 64s under a small budget)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    ctx = tok(70)
    reqs = [ScoreRequest(ctx + tok(rng.randint(1, 20)), rng.choice([70, 1])) for _ in range(3)]
    return reqs + [ScoreRequest(tok(n), 1) for n in (5, 150)]


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_chunks_and_shared_prefixes_are_bitwise(kind, hybrid_dirs):
    """Deterministic mode: each request alone, or packed with shared prefixes and cut into chunks
    by small budgets, gives the same bits (the engine cuts on ``caps.state_align``)."""
    loaded = load_model(str(hybrid_dirs[kind][0]), "cpu", "float32")
    assert ModelCaps.of(loaded.model).state_align == 64
    reqs = _mix(4)
    alone = [Scorer(loaded, config=EngineConfig(deterministic=True, share_prefixes=False)).engine.run([r])[0]
             for r in reqs]
    for budget in (64, 100, 1 << 20):
        cfg = EngineConfig(max_batch_tokens=budget, deterministic=True, share_prefixes=True)
        for a, b in zip(alone, Scorer(loaded, config=cfg).engine.run(reqs)):
            assert torch.equal(a.logprobs, b.logprobs), budget


def test_capture_router_and_hooks(hybrid_dirs):
    """Router probabilities of a MoE block against the float64 reference's; a router point of the
    dense block (Qwen3-Next's mlp_only_layers) is refused; steering with a zero vector changes nothing."""
    path, ref = hybrid_dirs["qwen3_next"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    seq = {"prompt_token_ids": list(range(10, 40)), "completion_token_ids": list(range(40, 60))}
    tokens = seq["prompt_token_ids"] + seq["completion_token_ids"]
    res = scorer.logprobs([seq], capture=[{"at": ["blocks.0.router", "blocks.*.resid_post"], "positions": "all"}])[0]
    got = {c.at: c.value for c in res.captures}
    _, routers = _reference(ref, tokens)
    assert got["blocks.0.router"].shape == (len(tokens), 8)
    assert (got["blocks.0.router"].double() - routers[0]).abs().max() < 1e-5
    assert got["blocks.3.resid_post"].shape == (len(tokens), 64)
    with pytest.raises(LogprobeError, match="no router"):
        scorer.logprobs([seq], capture=[{"at": "blocks.2.router"}])
    steered = scorer.logprobs([seq], steer=[{"at": "blocks.1.attn_out", "vector": [0.0] * 64}])[0]
    assert torch.equal(steered.logprobs, scorer.logprobs([seq])[0].logprobs)


def test_hub_style_configs_and_keys(hybrid_dirs):
    """Qwen3-Next as the hub ships its config (no layer_types: full_attention_interval; rope_theta and
    partial_rotary_factor at the top), and the checkpoint keys the loader skips or refuses."""
    raw = json.loads((hybrid_dirs["qwen3_next"][0] / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        raw.pop(key)
    raw.update(full_attention_interval=2, rope_theta=1e6, partial_rotary_factor=0.25, rope_scaling=None)
    cfg = hybrid_config(raw)
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert (cfg.rope_theta, cfg.rotary_dim, cfg.moe.dense_layers, cfg.moe.norm_topk_prob) == (1e6, 8, (2,), True)
    assert hybrid_param_name("mtp.layers.0.mlp.gate.weight", cfg, "f") is None
    assert hybrid_param_name("model.visual.blocks.0.attn.qkv.weight", cfg, "f") is None
    assert hybrid_param_name("model.language_model.layers.0.linear_attn.conv1d.weight", cfg, "f") == \
        "layers.0.linear_attn.conv_weight"
    with pytest.raises(LogprobeError, match="unexpected tensor"):
        hybrid_param_name("vision_tower.proj.weight", cfg, "f")
    raw["quantization_config"] = {"quant_method": "fp8"}
    with pytest.raises(LogprobeError) as e:
        hybrid_config(raw)
    assert e.value.field == "quantization_config"


def test_partial_weight_update_refused(hybrid_dirs):
    path, _ = hybrid_dirs["qwen3_5"]
    scorer = Scorer(str(path), device="cpu", dtype="float32", progress=False)
    with pytest.raises(LogprobeError, match="missing"):  # a partial update (tests/test_update_families.py)
        scorer.update_weights({"lm_head.weight": torch.zeros(VOCAB, 64)})


@pytest.mark.slow  # starts gloo workers, ~7 s
def test_data_parallel_and_moe_tensor_parallel_refused(hybrid_dirs):
    """Two data-parallel worker processes give the single process's bits; with heads split
    (``attention_parallel="tensor"``) a tensor-parallel size that does not split the
    mixture-of-experts model's heads is refused before any process starts, naming
    tensor_parallel_size (sizes that split it: tests/test_moe_parallel.py); by data (the default
    with whole experts a rank) the heads need not split."""
    path, _ = hybrid_dirs["qwen3_5"]
    seqs = _sequences()
    one = Scorer(str(path), device="cpu", dtype="float32", progress=False).logprobs(seqs)
    with Scorer(str(path), device="cpu", dtype="float32", progress=False, data_parallel_size=2) as dp:
        two = dp.logprobs(seqs)
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(one, two))
    with pytest.raises(LogprobeError) as e:
        Scorer(str(hybrid_dirs["qwen3_5_moe"][0]), device="cpu", dtype="float32", progress=False,
               tensor_parallel_size=4, attention_parallel="tensor")
    assert e.value.field == "tensor_parallel_size" and "linear_num_key_heads" in str(e.value)
    from logprobe.loading.loader import describe_model, parallel_context

    cfg = describe_model(str(hybrid_dirs["qwen3_5_moe"][0]), "cpu", tokenizer=False).model.config
    assert parallel_context(cfg, 3, 4, None, 4).attention == "data"
