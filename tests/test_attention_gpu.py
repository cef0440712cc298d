"""Varlen FlashAttention (layers/attention_gpu.py) against the portable per-segment SDPA path,
on plain packed batches and on the shapes prefix trees and chunk caches make (context spans)."""

from __future__ import annotations

import pytest
import torch

from logprobe.layers import attention
from logprobe.layers.attention import AttentionMeta, KVCache, Segment
from logprobe.layers.attention_gpu import flash_varlen_attention

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_not_applicable_returns_none():
    q = torch.randn(5, 4, 16)
    assert flash_varlen_attention(q, q[:, :2], q[:, :2], [0, 5], [0, 5], 0.25) is None  # CPU: portable path


def _portable(q, k, v, meta, scale, window):
    """The CPU float32 reference: packed_attention with the GPU path out of the way."""
    return attention.packed_attention(q, k, v, meta, 0, scale, window)


@cuda
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_varlen_matches_portable(window, dtype):
    g = torch.Generator().manual_seed(0)
    lengths = [1, 37, 300, 5, 128]
    T, Hq, Hkv, D = sum(lengths), 8, 2, 64
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    ref = _portable(q, k, v, AttentionMeta.packed(lengths), D**-0.5, window)
    out = attention.packed_attention(*(x.to("cuda", dtype) for x in (q, k, v)), AttentionMeta.packed(lengths), 0,
                                     D**-0.5, window)
    assert out.shape == (T, Hq, D)
    err = (out.float().cpu() - ref).abs().max().item()
    assert err < 2e-2, err


@cuda
@pytest.mark.parametrize("window", [None, 8])
def test_flash_tree_and_cache_match_portable(window):
    """A prefix (rows 0:40) with two branches seeing it, and a chunk that sees 50 cached rows."""
    g = torch.Generator().manual_seed(1)
    Hq, Hkv, D = 4, 2, 64
    tree = AttentionMeta([Segment(0, 40), Segment(40, 57, ((0, 40),)), Segment(57, 60, ((0, 40),))])
    q, k, v = (torch.randn(60, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    ref = _portable(q, k, v, tree, D**-0.5, window)
    gpu_tree = AttentionMeta(list(tree.segments))
    out = attention.packed_attention(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), gpu_tree, 0, D**-0.5, window)
    assert (out.float().cpu() - ref).abs().max().item() < 2e-2

    past_k, past_v = (torch.randn(50, Hkv, D, generator=g) for _ in range(2))
    q, k, v = (torch.randn(30, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    cpu_cache = KVCache([past_k], [past_v])
    ref = _portable(q, k, v, AttentionMeta([Segment(0, 30, ((0, 50),))], cache=cpu_cache, past=50), D**-0.5, window)
    gpu_cache = KVCache([past_k.to("cuda", torch.bfloat16)], [past_v.to("cuda", torch.bfloat16)])
    meta = AttentionMeta([Segment(0, 30, ((0, 50),))], cache=gpu_cache, past=50)
    out = attention.packed_attention(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), meta, 0, D**-0.5, window)
    assert (out.float().cpu() - ref).abs().max().item() < 2e-2
