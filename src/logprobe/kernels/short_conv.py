r"""Triton kernel for the short causal depthwise convolution of Gated DeltaNet layers.

``causal_conv1d_triton`` computes what ``layers.gated_delta.causal_conv1d`` computes: one program per
(token tile, channel tile); each token reads its K - 1 predecessors from its own sequence, or from the
sequence's initial state (sequence starts come from ``cu_seqlens`` on the device, no host sync). Taps
are accumulated in float32 oldest first, each product rounded before its add (FMA contraction off), the
bias added after, as the reference does; so the taps/bias part is bitwise equal to the PyTorch form.
Every output element depends on its own sequence's inputs only (no autotuning, the grid fixed by the
tile sizes): batch-invariant and TP-invariant (a rank's channels are computed alone) by construction.

SiLU is PyTorch's formula ``a / (1 + exp(-a))`` in float32 with a correctly rounded division. On CUDA
``exp`` is libdevice's ``__nv_expf``, the routine behind CUDA's ``expf`` that PyTorch's SiLU kernel
calls, so the result is expected to equal the PyTorch path bit for bit (``bench/gpu_gated_delta.py``
reports it); Triton's own ``tl.exp`` (an approximate ``ex2``) would move it a few ulp. The interpreter
(CPU) has no libdevice and uses NumPy's ``exp``: a few ulp from PyTorch's CPU SiLU, not bitwise.

    >>> x = torch.arange(12.0).view(6, 2) / 4          # [T, C], two sequences: rows 0..2 and 3..5
    >>> w = torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 2)   # [C, K]: y_t = x_{t-1} + x_t
    >>> y, finals = causal_conv1d_triton(x, w, [0, 3, 6], activation=None)  # doctest: +SKIP
    >>> y[:, 0].tolist(), finals[1, 0].tolist()          # doctest: +SKIP
    ([0.0, 0.5, 1.5, 1.5, 3.5, 4.5], [1.5, 2.0, 2.5])
"""

from __future__ import annotations

import torch

from . import host_values_to, triton_available

CUDA_OPTIONS = {"enable_fp_fusion": False}  # no FMA contraction: each product rounded before its add
triton = None
libdevice = None
if triton_available():
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import libdevice
    except Exception:  # pragma: no cover - a Triton without it: tl.exp on CUDA too
        libdevice = None

    @triton.jit(do_not_specialize=["T"])  # varies with the batch: one compiled kernel
    def _conv_kernel(x_ptr, w_ptr, b_ptr, s_ptr, seq_ptr, start_ptr, y_ptr, T, C, stride_x,
                     K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr):
        # int64 rows: T * C passes 2^31 at 262k tokens of 8192 channels
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
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
            xv = tl.load(x_ptr + p[:, None] * stride_x + c[None, :], mask=m & inside[:, None], other=0.0)
            si = (K - 1) - (start - p)  # index into the state when p precedes the sequence
            sv = tl.load(s_ptr + (n[:, None] * C + c[None, :]) * (K - 1) + si[:, None],
                         mask=m & (~inside)[:, None], other=0.0)
            v = tl.where(inside[:, None], xv.to(tl.float32), sv.to(tl.float32))
            w = tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)
            prod = v * w[None, :]
            acc = prod if j == 0 else acc + prod
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
        if SILU:  # PyTorch's x / (1 + exp(-x)), the division correctly rounded as there
            if LIBDEVICE_EXP:
                e = libdevice.exp(-acc)
            else:
                e = tl.exp(-acc)
            acc = tl.math.div_rn(acc, 1.0 + e)
        tl.store(y_ptr + t[:, None] * C + c[None, :], acc.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _final_kernel(x_ptr, s_ptr, cu_ptr, f_ptr, C, stride_x, K: tl.constexpr, BC: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        start = tl.load(cu_ptr + n)
        end = tl.load(cu_ptr + n + 1)
        for i in tl.static_range(K - 1):
            p = end - (K - 1) + i
            if p >= start:
                v = tl.load(x_ptr + p * stride_x + c, mask=cm, other=0.0)
            else:
                v = tl.load(s_ptr + (n * C + c) * (K - 1) + (K - 1) - (start - p), mask=cm, other=0.0)
            tl.store(f_ptr + (n * C + c) * (K - 1) + i, v.to(f_ptr.dtype.element_ty), mask=cm)


def causal_conv1d_triton(x, weight, cu_seqlens=None, initial_state=None, bias=None, activation="silu",
                         *, block_t: int = 32, block_c: int = 128):
    """Same contract as ``layers.gated_delta.causal_conv1d``: x [T, C] (any row stride); weight [C, K]; cu_seqlens a
    list, a CPU tensor (checked to rise from 0 to T) or a device tensor (trusted: no host sync);
    initial_state [N, C, K - 1] (oldest first, rounded to x's dtype as the reference rounds it) or
    None. Returns ``(y [T, C], finals [N, C, K - 1])`` in x's dtype, finals being each sequence's
    last K - 1 inputs (reaching into its initial state when it is shorter). Computes in float32, so
    float64 inputs are refused (the reference keeps them float64)."""
    if triton is None:
        raise RuntimeError("causal_conv1d_triton needs Triton; use kernels.gated_delta.causal_conv1d_batched")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    if torch.float64 in (x.dtype, weight.dtype, getattr(bias, "dtype", None)):
        raise ValueError("causal_conv1d_triton computes in float32; use layers.gated_delta.causal_conv1d")
    T, C = x.shape
    K = weight.shape[-1]
    dev = x.device
    cu = _cu_seqlens(cu_seqlens, T, dev)
    N = cu.numel() - 1
    state = initial_state
    if state is None:
        state = torch.zeros((N, C, K - 1), dtype=x.dtype, device=dev)
    elif tuple(state.shape) != (N, C, K - 1):
        raise ValueError(f"initial_state must be {(N, C, K - 1)}, got {tuple(state.shape)}")
    if x.stride(1) != 1:  # rows may be strided (a slice of the fused projection's output): no copy
        x = x.contiguous()
    state = state.to(x.dtype).contiguous()
    w = weight.reshape(C, K).contiguous()
    tok = torch.arange(T, device=dev)
    seq = torch.searchsorted(cu[1:], tok, right=True)  # [T] sequence of each token (empty ones skipped)
    start = cu[seq]  # [T] its sequence's first token
    # On CUDA the kernel rounds to x's dtype as it stores (to nearest even, as torch's cast); the
    # interpreter's bfloat16 rounding differs, so there it stores float32 and torch casts.
    cuda = dev.type == "cuda"
    y = torch.empty((T, C), dtype=x.dtype if cuda else torch.float32, device=dev)
    finals = torch.empty((N, C, K - 1), dtype=x.dtype, device=dev)
    b = bias.contiguous() if bias is not None else w
    opts = CUDA_OPTIONS if cuda else {}
    if T:
        grid = (triton.cdiv(T, block_t), triton.cdiv(C, block_c))
        _conv_kernel[grid](x, w, b, state, seq, start, y, T, C, x.stride(0), K=K, HAS_BIAS=bias is not None,
                           SILU=activation is not None, LIBDEVICE_EXP=cuda and libdevice is not None,
                           BT=block_t, BC=block_c, **opts)
    if N:
        _final_kernel[(N, triton.cdiv(C, block_c))](x, state, cu, finals, C, x.stride(0), K=K, BC=block_c)
    return y.to(x.dtype), finals


def _cu_seqlens(cu_seqlens, total: int, device) -> torch.Tensor:
    """``cu_seqlens`` as an int64 tensor on ``device``; host values are checked (a device tensor is
    trusted: reading it back would stall the stream)."""
    if cu_seqlens is None:
        return host_values_to([0, total], torch.int64, device)
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type != "cpu":
        return cu_seqlens.to(device=device, dtype=torch.int64)
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if not cu or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to {total}, got {cu}")
    return host_values_to(cu, torch.int64, device)  # pinned, not blocking: no host sync
