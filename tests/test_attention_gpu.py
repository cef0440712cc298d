"""Varlen FlashAttention (layers/attention_gpu.py) against the portable per-sequence SDPA loop."""

from __future__ import annotations

import pytest
import torch

from logprobe.layers import attention
from logprobe.layers.attention_gpu import flash_varlen_attention


def test_not_applicable_returns_none():
    q = torch.randn(5, 4, 16)
    assert flash_varlen_attention(q, q[:, :2], q[:, :2], [0, 5], 0.25) is None  # CPU: portable loop


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_varlen_matches_portable_loop(window, dtype):
    g = torch.Generator().manual_seed(0)
    lengths = [1, 37, 300, 5, 128]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    T, Hq, Hkv, D = cu[-1], 8, 2, 64
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    out = flash_varlen_attention(*(x.to("cuda", dtype) for x in (q, k, v)), cu, D**-0.5, window)
    assert out is not None and out.shape == (T, Hq, D)
    ref = attention.packed_causal_attention(q, k, v, cu, D**-0.5, window)  # float32 on CPU
    err = (out.float().cpu() - ref).abs().max().item()
    assert err < 2e-2, err
