r"""Triton kernel for the short causal depthwise convolution of Gated DeltaNet layers.

``causal_conv1d_triton`` computes what ``layers.gated_delta.causal_conv1d`` computes: one program per
(token tile, channel tile); each token reads its K - 1 predecessors from its own sequence, or from the
sequence's initial state (sequence starts come from ``cu_seqlens`` on the device, no host sync). Taps
are accumulated in float32 oldest first, each product rounded before its add (FMA contraction off), the
bias added after, as the reference does; so the taps/bias part is bitwise equal to the PyTorch form.
Every output element depends on its own sequence's inputs only: batch-invariant by construction.
SiLU is ``a / (1 + exp(-a))`` in float32 (a few ulp from PyTorch's CUDA SiLU, not bitwise).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is optional
    triton = None


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _conv_kernel(x_ptr, w_ptr, b_ptr, s_ptr, seq_ptr, start_ptr, y_ptr, T, C,
                     K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr):
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        tm = t < T
        cm = c < C
        m = tm[:, None] & cm[None, :]
        n = tl.load(seq_ptr + t, mask=tm, other=0)
        start = tl.load(start_ptr + t, mask=tm, other=0)
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(K):  # oldest tap first, as the reference
            p = t - (K - 1) + j
            inside = p >= start
            xv = tl.load(x_ptr + p[:, None] * C + c[None, :], mask=m & inside[:, None], other=0.0)
            si = (K - 1) - (start - p)  # index into the state when p precedes the sequence
            sv = tl.load(s_ptr + (n[:, None] * C + c[None, :]) * (K - 1) + si[:, None],
                         mask=m & (~inside)[:, None], other=0.0)
            v = tl.where(inside[:, None], xv.to(tl.float32), sv.to(tl.float32))
            w = tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)
            prod = v * w[None, :]
            acc = prod if j == 0 else acc + prod
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y_ptr + t[:, None] * C + c[None, :], acc.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _final_kernel(x_ptr, s_ptr, cu_ptr, f_ptr, C, K: tl.constexpr, BC: tl.constexpr):
        n = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        start = tl.load(cu_ptr + n)
        end = tl.load(cu_ptr + n + 1)
        for i in tl.static_range(K - 1):
            p = end - (K - 1) + i
            if p >= start:
                v = tl.load(x_ptr + p * C + c, mask=cm, other=0.0)
            else:
                v = tl.load(s_ptr + (n * C + c) * (K - 1) + (K - 1) - (start - p), mask=cm, other=0.0)
            tl.store(f_ptr + (n * C + c) * (K - 1) + i, v.to(f_ptr.dtype.element_ty), mask=cm)


def causal_conv1d_triton(x, weight, cu_seqlens=None, initial_state=None, bias=None, activation="silu",
                         *, block_t: int = 32, block_c: int = 128):
    """Same contract as ``layers.gated_delta.causal_conv1d`` (x [T, C], weight [C, K], initial_state
    [N, C, K - 1] or None; returns ``(y [T, C], finals [N, C, K - 1])`` in x's dtype)."""
    if triton is None:
        raise RuntimeError("causal_conv1d_triton needs Triton; use kernels.gated_delta.causal_conv1d_batched")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    if x.dtype == torch.float64:
        raise ValueError("causal_conv1d_triton computes in float32; use layers.gated_delta.causal_conv1d")
    T, C = x.shape
    K = weight.shape[-1]
    dev = x.device
    if cu_seqlens is None:
        cu = torch.tensor([0, T], dtype=torch.int64, device=dev)
    else:
        cu = torch.as_tensor(cu_seqlens, device=dev).to(torch.int64)
    N = cu.numel() - 1
    state = initial_state
    if state is None:
        state = torch.zeros((N, C, K - 1), dtype=x.dtype, device=dev)
    elif tuple(state.shape) != (N, C, K - 1):
        raise ValueError(f"initial_state must be {(N, C, K - 1)}, got {tuple(state.shape)}")
    x = x.contiguous()
    state = state.contiguous()
    w = weight.reshape(C, K).contiguous()
    tok = torch.arange(T, device=dev)
    seq = torch.searchsorted(cu[1:], tok, right=True)  # [T] sequence of each token (empty ones skipped)
    start = cu[seq]  # [T] its sequence's first token
    y = torch.empty((T, C), dtype=torch.float32, device=dev)  # cast by torch: round-to-nearest as the reference
    finals = torch.empty((N, C, K - 1), dtype=x.dtype, device=dev)
    b = bias.contiguous() if bias is not None else w
    opts = {} if dev.type != "cuda" else {"enable_fp_fusion": False}  # products rounded before adds
    if T:
        grid = (triton.cdiv(T, block_t), triton.cdiv(C, block_c))
        _conv_kernel[grid](x, w, b, state, seq, start, y, T, C, K=K, HAS_BIAS=bias is not None,
                           SILU=activation is not None, BT=block_t, BC=block_c, **opts)
    if N:
        _final_kernel[(N, triton.cdiv(C, block_c))](x, state, cu, finals, C, K=K, BC=block_c)
    return y.to(x.dtype), finals
