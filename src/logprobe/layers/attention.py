"""Causal attention over a packed batch: block-diagonal by ``cu_seqlens``, no padding.

Sequence ``i`` occupies rows ``cu_seqlens[i]:cu_seqlens[i+1]`` and attends to itself only.
This portable version runs PyTorch SDPA once per sequence (exact and memory-light on CPU);
faster GPU paths implement the same signature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_gpu import flash_varlen_attention


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; Hq must be a multiple of Hkv (GQA)."""
    if q.is_cuda and (o := flash_varlen_attention(q, k, v, cu_seqlens, scale, sliding_window)) is not None:
        return o  # one varlen FlashAttention call for the batch (layers/attention_gpu.py)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end == start:
            continue
        # 4-D inputs let SDPA pick its fused (flash) CPU kernel instead of the math path
        qs = q[start:end].transpose(0, 1)[None]  # [1, Hq, L, D]
        ks = k[start:end].transpose(0, 1)[None]  # [1, Hkv, L, D]
        vs = v[start:end].transpose(0, 1)[None]
        length = end - start
        if sliding_window is not None and length > sliding_window:
            i = torch.arange(length, device=q.device)
            # token i sees j with i - window < j <= i (the transformers convention)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < sliding_window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)  # [L, Hq, D]
    return out
