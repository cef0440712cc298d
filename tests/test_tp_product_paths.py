"""Deterministic mode's TP invariance needs every product to run the same way at every TP size: a
layer that takes the Triton fixed-tile matmul at one size and cuBLAS row tiles at another (or
column blocks of another width) rounds its columns otherwise. Each rank's model is built on the
meta device (no weights, no process group) at TP = 1, 2 and 4, on the Llama-3-8B and
Qwen3-30B-A3B shapes (2 layers), and every layer's CUDA product path and column-block width are
compared by name with TP = 1's."""

from __future__ import annotations

import pytest
import torch

from logprobe.config import EngineConfig, numerics_for
from logprobe.layers.linear import Linear, cuda_product
from logprobe.layers.moe import Experts
from logprobe.loading.hf import native_config
from logprobe.loading.loader import parallel_context
from logprobe.models.moe import native_model_class

SHAPES = {
    "llama-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=2,
                     num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, rms_norm_eps=1e-5,
                     rope_theta=5e5, max_position_embeddings=8192),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=2,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=8192),
}


def _paths(cfg, size: int, rank: int, experts: int) -> dict[str, tuple]:
    """Layer name -> (CUDA product, column-block widths) in rank ``rank`` of ``size``'s model under
    deterministic mode's CUDA numerics; expert matrices -> their block widths."""
    ctx = parallel_context(cfg, rank, size, None, experts)
    with torch.device("meta"):
        model = native_model_class(cfg)(cfg, ctx=ctx)
    model.fuse_projections()
    model.set_numerics(numerics_for(EngineConfig(deterministic=True), "cuda", tp_size=size, tp_blocks=ctx.blocks))
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            blocks = m.blocks
            out[name] = (cuda_product(m.numerics.matmul, blocks), sorted(set(blocks or [])) or None)
        elif isinstance(m, Experts):
            out[name] = {k: sorted(set(v or [])) or None for k, v in m.col_blocks.items()}
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("size", [2, 4])
def test_every_layer_takes_one_product_path_at_every_tp_size(shape, size):
    cfg, why = native_config(SHAPES[shape])
    assert cfg is not None, why
    one = _paths(cfg, 1, 0, 1)
    assert one["layers.0.self_attn.qkv_proj"][0] == "triton"  # the fused q|k|v keeps its blocks
    for experts in sorted({1, size} if cfg.moe is not None else {1}):
        for rank in range(size):
            got = _paths(cfg, size, rank, experts)
            assert got.keys() == one.keys()
            differ = {n: (one[n], got[n]) for n in one if got[n] != one[n]}
            assert not differ, f"TP={size} EP={experts} rank {rank}: {differ}"


def test_a_layer_without_blocks_at_one_size_is_caught():
    """The comparison can fail: a fused q|k|v whose k part has no blocks takes cuBLAS."""
    assert cuda_product("cublas", None) != cuda_product("cublas", [128, 128])
