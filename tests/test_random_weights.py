"""Random-weight shards (``load_format="dummy"``, ``loading.dummy``): each rank builds its own shard
of a config at random, through the family's builder and FP8 block layers.

Tiny configs, no checkpoint: a directory of config.json and the byte tokenizer. DeepSeek-V3's shape
(latent attention with the low-rank q path, 8 routed experts in 4 groups of which 2 survive, top-2,
one shared expert, a dense first block) as FP8 blocks of 24 x 16 (rank ranges start and end inside
blocks); Qwen3-MoE (FP8) and GLM-4.5 (bf16 layout: float).

* the pairs a rank's builder takes are the whole model's cut as the loader cuts a checkpoint:
  every rank's tensors, FP8 codes and row scales equal the one-rank model's rows, and a tensor a
  rank holds whole is the same bits on every rank (its hash compared);
* the seed changes the weights, the same seed gives the same bits, ``skew`` widens the hot
  experts' router rows only; refusals name the field and the fix;
* (slow) through ``Scorer(..., load_format="dummy")``: gloo workers at TP = EP = 2 and 4 score
  finite log-probs, in deterministic mode bitwise those of one process (8 ranks would need a
  model of 8 column blocks: 30 s and more of gloo on two cores).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from helpers import VOCAB, byte_tokenizer, random_sequences

from logprobe import LogprobeError, Scorer
from logprobe.config import EngineConfig
from logprobe.layers.fp8_block_linear import FP8BlockExperts, FP8BlockLinear
from logprobe.loading.dummy import RandomWeights, random_tensors
from logprobe.loading.hf import read_config
from logprobe.loading.loader import describe_model, load_model, parallel_context
from logprobe.loading.registry import Load, family_of
from logprobe.loading.sharding import rank_cut

transformers = pytest.importorskip("transformers")

FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [24, 16]}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=512, bos_token_id=1, eos_token_id=0)


def _config(kind: str) -> dict:
    tf = transformers
    if kind == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                                  num_attention_heads=4,
                                  num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                                  n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32,
                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_hidden_layers=2,
                                  q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True)
        return {**cfg.to_dict(), "quantization_config": FP8_BLOCKS}
    if kind == "deepseek_v3_8":  # eight column blocks, 16 experts, 8 vocabulary chunks: TP = EP = 8
        cfg = tf.DeepseekV3Config(**{**COMMON, "vocab_size": 512}, intermediate_size=128, moe_intermediate_size=32,
                                  num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
                                  n_routed_experts=16, num_experts_per_tok=2, n_group=8, topk_group=2,
                                  first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8,
                                  qk_nope_head_dim=16, v_head_dim=16, num_hidden_layers=2, q_lora_rank=24,
                                  routed_scaling_factor=2.5, norm_topk_prob=True)
        return {**cfg.to_dict(), "quantization_config": {**FP8_BLOCKS, "weight_block_size": [8, 16]}}
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=32, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, norm_topk_prob=True)
        return {**cfg.to_dict(), "quantization_config": FP8_BLOCKS}
    cfg = tf.Glm4MoeConfig(**COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_experts_per_tok=2, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                           n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, use_qk_norm=True,
                           attention_bias=True, routed_scaling_factor=2.5, norm_topk_prob=True,
                           partial_rotary_factor=0.5)
    return cfg.to_dict()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for kind in ("deepseek_v3", "qwen3_moe", "glm4_moe", "deepseek_v3_8"):
        d = tmp_path_factory.mktemp(kind)
        (d / "config.json").write_text(json.dumps(_config(kind)))
        byte_tokenizer()[0].save_pretrained(str(d))
        out[kind] = d
    return out


def _pairs(path, size: int = 1, rank: int = 0, attention: str | None = None, weights=RandomWeights()) -> dict:
    """(name -> tensor or FP8 layer) of rank ``rank`` of ``size`` (TP = EP), as its builder takes them;
    and the rank's meta model (its cuts)."""
    cfg = describe_model(str(path), "cpu", "float32", tokenizer=False).model.config
    family = family_of(cfg)
    ctx = parallel_context(cfg, rank, size, None, size, attention) if size > 1 else None
    pairs = dict(random_tensors(family, cfg, read_config(path), ctx, Load(torch.device("cpu"), torch.float32), weights))
    with torch.device("meta"):
        model = family.build_meta(cfg, ctx)
    return pairs, model


def _parts(w) -> list[torch.Tensor]:
    """What a value holds: a tensor, or an FP8 layer's codes (as bytes) and row scales."""
    if isinstance(w, (FP8BlockLinear, FP8BlockExperts)):
        return [w.qweight.view(torch.uint8), w.scale]
    return [w]


def _digest(w) -> str:
    h = hashlib.sha256()
    for t in _parts(w):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("kind,size,attention", [("deepseek_v3", 2, None), ("deepseek_v3", 4, None),
                                                 ("deepseek_v3", 2, "tensor"), ("deepseek_v3", 4, "tensor"),
                                                 ("qwen3_moe", 2, "tensor"), ("glm4_moe", 2, None)])
def test_shards_are_cuts_of_the_whole(dirs, kind, size, attention):
    whole, _ = _pairs(dirs[kind])
    assert any(isinstance(w, FP8BlockExperts) for w in whole.values()) == (kind != "glm4_moe")
    held_whole, split = {}, 0
    for rank in range(size):
        pairs, model = _pairs(dirs[kind], size, rank, attention)
        for name, w in pairs.items():
            cut = rank_cut(model, name)
            want = _parts(whole[name])
            got = _parts(w)
            if cut is None:  # replicated: the same bits on every rank
                assert held_whole.setdefault(name, _digest(w)) == _digest(w), (name, rank)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), name
                continue
            split += 1
            for a, b in zip(got, want):  # codes [rows, in] and row scales [rows, G]: cut as the whole's rows
                assert torch.equal(a, cut(b)), (name, rank)
    assert split and held_whole  # both kinds were compared


def test_seed_and_skew(dirs):
    a, _ = _pairs(dirs["deepseek_v3"])
    b, _ = _pairs(dirs["deepseek_v3"])
    c, _ = _pairs(dirs["deepseek_v3"], weights=RandomWeights(seed=1))
    s, _ = _pairs(dirs["deepseek_v3"], weights=RandomWeights(skew=0.5))
    assert all(_digest(a[n]) == _digest(b[n]) for n in a)
    assert all(_digest(a[n]) != _digest(c[n]) for n in a if not n.endswith(("bias", "mlp.e_score_correction_bias")))
    router = "layers.1.mlp.gate.weight"
    assert torch.equal(s[router][:1], a[router][:1] * 1.5) and torch.equal(s[router][1:], a[router][1:])
    assert all(_digest(a[n]) == _digest(s[n]) for n in a if n != router)
    codes = a["layers.1.mlp.experts.gate_proj"].qweight.float()
    assert codes.abs().max() <= 448 and 200 < codes.std() < 300  # uniform codes over e4m3's range


def test_one_process_scores(dirs):
    with Scorer(str(dirs["deepseek_v3"]), device="cpu", dtype="float32", progress=False, load_format="dummy") as s:
        assert s.info.name.endswith("(random)")
        out = s.logprobs(random_sequences(3, seed=1))
    lp = torch.cat([r.logprobs for r in out])
    assert torch.isfinite(lp).all() and -12 < lp.mean() < -2  # log(300) = 5.7: spread, not peaked


def test_refusals(dirs, tmp_path):
    path = str(dirs["deepseek_v3"])
    with pytest.raises(LogprobeError) as e:
        load_model(path, "cpu", "float32", load_format="zeros")
    assert e.value.field == "load_format" and "dummy" in str(e.value)
    with pytest.raises(LogprobeError) as e:
        load_model(path, "cpu", "float32", weights="dense", load_format="dummy")
    assert e.value.field == "weights"
    with pytest.raises(LogprobeError) as e:
        Scorer(path, device="cpu", dtype="float32", load_format="dummy", cache=str(tmp_path / "c"))
    assert e.value.field == "cache"
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    cfg = transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    (gemma / "config.json").write_text(json.dumps(cfg.to_dict()))
    byte_tokenizer()[0].save_pretrained(str(gemma))
    with pytest.raises(LogprobeError) as e:
        load_model(str(gemma), "cpu", "float32", load_format="dummy")
    assert e.value.field == "load_format" and "Gemma" in str(e.value)
    awq = tmp_path / "awq"
    awq.mkdir()
    (awq / "config.json").write_text(json.dumps({**_config("glm4_moe"), "quantization_config": {"quant_method": "awq"}}))
    byte_tokenizer()[0].save_pretrained(str(awq))
    with pytest.raises(LogprobeError) as e:
        load_model(str(awq), "cpu", "float32", load_format="dummy")
    assert e.value.field in ("load_format", "quantization_config")


def _bits(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x.logprobs, y.logprobs) and torch.equal(x.entropy, y.entropy)
                                    for x, y in zip(a, b))


SIZES = {"deepseek_v3": (2, 4), "qwen3_moe": (2,), "glm4_moe": (2,), "deepseek_v3_8": (4, 8)}


@pytest.mark.slow  # slow tier: 2, 4 and 8 gloo worker processes (~7 s for DeepSeek-V3 at 2 and 4)
@pytest.mark.parametrize("kind", list(SIZES))
def test_sizes_bitwise_one_process(dirs, kind):
    seqs = random_sequences(4, seed=2)
    cfg = EngineConfig(deterministic=True, progress=False)
    with Scorer(str(dirs[kind]), device="cpu", dtype="float32", config=cfg, load_format="dummy") as one:
        want = one.logprobs(seqs, entropy=True)
    assert all(torch.isfinite(r.logprobs).all() for r in want)
    for n in SIZES[kind]:
        with Scorer(str(dirs[kind]), device="cpu", dtype="float32", config=cfg, tensor_parallel_size=n,
                    expert_parallel_size=n, load_format="dummy") as s:
            assert _bits(s.logprobs(seqs, entropy=True), want), (kind, n)
