"""Packed (varlen) causal attention on CUDA: one FlashAttention-2 call per layer for the whole batch.

Same result as ``attention.packed_attention``'s portable path (one SDPA call per segment): query
segment s is rows ``cu_q[s]:cu_q[s+1]`` of q [T, Hq, D], its keys rows ``cu_k[s]:cu_k[s+1]`` of
k/v [K, Hkv, D] (context first, then its own rows), causal with the diagonal aligned bottom-right.
The portable loop costs one launch (and, for GQA, a slower SDPA path) per sequence and layer,
which dominated GPU time on batches of many short sequences; PyTorch's bundled FlashAttention-2
takes the packed tensors with cumulative sequence offsets directly, supports GQA (Hkv divides
Hq) and a sliding window, and never crosses sequences.

Applies to float16 / bfloat16 on CUDA with head_dim <= 256 (FlashAttention's limits); anything
else returns None and the caller runs the portable loop.
"""

from __future__ import annotations

import torch


def flash_varlen_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [K, Hkv, D]
    v: torch.Tensor,  # [K, Hkv, D]
    cu_q: list[int],
    cu_k: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """-> [T, Hq, D], or None when this path does not apply."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0 and q.shape[1] % k.shape[1] == 0):
        return None
    max_q = max((b - a for a, b in zip(cu_q[:-1], cu_q[1:])), default=0)
    max_k = max((b - a for a, b in zip(cu_k[:-1], cu_k[1:])), default=0)
    if max_q == 0:
        return torch.empty_like(q)
    cq = torch.tensor(cu_q, dtype=torch.int32, device=q.device)  # [B + 1]
    ck = cq if cu_k == cu_q else torch.tensor(cu_k, dtype=torch.int32, device=q.device)
    # token i sees j with i - window < j <= i (the transformers convention): left = window - 1
    left = -1 if sliding_window is None else sliding_window - 1
    try:
        out = torch.ops.aten._flash_attention_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), cq, ck, max_q, max_k, 0.0, True, False,
            scale=scale, window_size_left=left, window_size_right=0 if sliding_window is not None else -1)
    except (RuntimeError, TypeError, NotImplementedError):  # a build without flash, or an older signature
        return None
    return out[0]  # [T, Hq, D]
