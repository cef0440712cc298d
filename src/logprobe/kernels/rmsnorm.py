"""Batch-invariant RMSNorm in Triton: one program per row, one fixed reduction tree.

PyTorch's CUDA reductions choose how many threads share a row from the tensor's shape, so
``x.pow(2).mean(-1)`` of a row can round differently with more or fewer rows in the batch. Here
each row is reduced alone over a [BLOCK] vector (BLOCK = next power of two of H; narrow rows a few
to a program, ``rows_per_program``, each still along its own axis): the same additions in the same
order whatever else is in the batch. Same function as
``layers.norm.RMSNorm`` (its reference): float32 statistics, cast to the activation dtype, then
the gain in that dtype.

``gated_rmsnorm`` fuses the gated output norm of linear-attention mixers into one pass:
``(w * (x / rms(x)).to(x.dtype)) * silu(z.float())``, rounded once to x's dtype, with exactly the
roundings of ``gated_rmsnorm_reference`` (``invariant_rmsnorm`` followed by PyTorch's SiLU gate).
"""

from __future__ import annotations

import torch

from ..errors import LogprobeError
from . import interpreting, triton_available

FLOAT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # what gated_rmsnorm rounds to
libdevice = None
if triton_available():
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import libdevice
    except Exception:  # pragma: no cover - a Triton without it: tl.exp on CUDA too
        libdevice = None

    @triton.jit(do_not_specialize=["R"])  # varies with the batch: one compiled kernel
    def _rmsnorm(x_ptr, w_ptr, y_ptr, R, H, HEADS, stride_xt, stride_xh, stride_y, eps, ROUND_NORMED: tl.constexpr,
                 BLOCK: tl.constexpr, ROWS: tl.constexpr):
        # ROWS rows a program, each reduced along its own axis: a row's additions are the same
        # wherever it sits in the block (every row of the [ROWS, BLOCK] tile has one layout)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        ok = (rows < R)[:, None] & (cols < H)[None, :]
        # row r is head r % HEADS of token r // HEADS: x may be a strided view (a fused projection's slice)
        xr = (rows // HEADS) * stride_xt + (rows % HEADS) * stride_xh
        x = tl.load(x_ptr + xr[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        ms = tl.sum(x * x, axis=1) / H  # [ROWS]
        xn = x * (1.0 / tl.sqrt(ms + eps))[:, None]
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
        if ROUND_NORMED:
            y = w[None, :] * xn.to(x_ptr.dtype.element_ty)  # round to the activation dtype first, as the reference
        else:
            y = w[None, :] * xn  # float32 gain, float32 product: rounded once, by the store
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y, mask=ok)


    @triton.jit
    def _round_to(v, KIND: tl.constexpr):
        # float32 v -> the nearest value of FLOAT_KINDS[KIND] (ties to even), kept in float32. The
        # bfloat16 rounding is done on the bits: the interpreter's float32 -> bfloat16 cast truncates
        # and its bfloat16 arithmetic runs on the raw uint16 words, so no bfloat16 value is computed
        # with; the store's final cast then only carries an exactly representable value
        if KIND == 1:
            bits = v.to(tl.uint32, bitcast=True)
            up = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(v != v, v, up.to(tl.float32, bitcast=True))  # NaN stays NaN
        elif KIND == 2:
            return v.to(tl.float16).to(tl.float32)
        else:
            return v

    @triton.jit(do_not_specialize=["R"])  # varies with the batch: one compiled kernel
    def _gated_rmsnorm(x_ptr, z_ptr, w_ptr, y_ptr, R, H, HEADS, stride_x, stride_zt, stride_zh, stride_y, eps,
                       X_KIND: tl.constexpr, P_KIND: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                       BLOCK: tl.constexpr, ROWS: tl.constexpr):
        # the statistics exactly as _rmsnorm (same tile, same expressions: the same bits on CUDA)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        ok = (rows < R)[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        ms = tl.sum(x * x, axis=1) / H  # [ROWS]
        xn = _round_to(x * (1.0 / tl.sqrt(ms + eps))[:, None], X_KIND)  # (x / rms).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        normed = _round_to(w[None, :] * xn, P_KIND)  # w * normed in promote(w, x): exact product, one rounding
        # row r is head r % HEADS of token r // HEADS: z may be a strided view (a fused projection's slice)
        zr = (rows // HEADS) * stride_zt + (rows % HEADS) * stride_zh
        z = tl.load(z_ptr + zr[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if LIBDEVICE_EXP:  # CUDA's expf, as PyTorch's SiLU; the division correctly rounded as there
            e = libdevice.exp(-z)
        else:
            e = tl.exp(-z)
        gate = tl.math.div_rn(z, 1.0 + e)  # exp overflows to inf for z << 0: z / inf = -0, SiLU's limit
        y = _round_to(normed * gate, X_KIND)
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def rows_per_program(width: int) -> int:
    """Rows one program normalises: enough for about 2048 elements, so the per-head norms of q and
    k (Qwen3: rows of head_dim = 128, 32 per token) are not one tiny program each (on an H200 those
    took 6% of Qwen3-MoE's W1). A function of the width only, never of the number of rows.

    >>> [rows_per_program(w) for w in (128, 96, 2048, 4096)]
    [16, 16, 1, 1]
    """
    block = 1 << max(0, (width - 1).bit_length())  # next power of two
    return max(1, 2048 // block)


def _check(x: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    if x.shape[-1] != weight.shape[0]:
        raise LogprobeError("x", f"width {x.shape[-1]} does not match the norm's {weight.shape[0]}")
    if not triton_available() or not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        raise LogprobeError("device", f"the {name} runs on CUDA (or CPU under TRITON_INTERPRET=1)")


def invariant_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_normed: bool = True) -> torch.Tensor:
    """x [..., H] -> RMSNorm(x) * weight, each row computed alone (contiguous). A per-head norm's
    x [T, heads, H] is read where it lies, strided (q or k as a slice of a fused projection's
    output): copying it first took 3% of Qwen3-30B-A3B's W1 on an H200.

    ``round_normed`` (``layers.norm.RMSNorm``): x / rms(x) is rounded to x's dtype before the gain,
    the product computed in promote(weight, x). False (the float32 norms: Gemma's and Qwen3.5's
    offset gain, gpt-oss's): ``weight`` is float32, x / rms(x) * weight is computed in float32 and
    rounded once to x's dtype, as ``(x.float() / rms * weight).to(x.dtype)`` in PyTorch, without the
    float32 copies of x and of the output."""
    _check(x, weight, "invariant RMSNorm")
    if not round_normed and weight.dtype != torch.float32:
        raise LogprobeError("weight", f"a norm computed in float32 takes a float32 gain, not {weight.dtype}")
    shape, H = x.shape, x.shape[-1]
    if x.dim() == 3 and x.stride(2) == 1:
        x2, heads, stride_t, stride_h = x, shape[1], x.stride(0), x.stride(1)
    else:
        x2 = x.reshape(-1, H)  # [R, H]
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        heads, stride_t, stride_h = 1, x2.stride(0), 0
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if round_normed else x.dtype
    y = torch.empty(shape, dtype=out_dtype, device=x.device).view(-1, H)  # [R, H]
    R = y.shape[0]
    if R:
        rows = rows_per_program(H)
        _rmsnorm[(triton.cdiv(R, rows),)](x2, weight.contiguous(), y, R, H, heads, stride_t, stride_h, y.stride(0),
                                          float(eps), ROUND_NORMED=round_normed, BLOCK=triton.next_power_of_2(H),
                                          ROWS=rows)
    return y.view(shape)


def gated_rmsnorm_reference(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What ``gated_rmsnorm`` computes, in separate steps: ``invariant_rmsnorm`` (``w * (x /
    rms(x)).to(x.dtype)`` in promote(w, x)), times PyTorch's float32 SiLU of z, rounded to x's dtype."""
    return (invariant_rmsnorm(x, weight, eps) * torch.nn.functional.silu(z.float())).to(x.dtype)


def gated_rmsnorm_supports(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gated_rmsnorm`` takes these: float32 / bfloat16 / float16 (it computes in float32,
    so float64 stays with the reference), z of x's shape."""
    return (x.dtype in FLOAT_KINDS and weight.dtype in FLOAT_KINDS and z.dtype in FLOAT_KINDS
            and z.shape == x.shape and x.dim() >= 1)


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., Hv, D], z [..., Hv, D] (the gate; any strides with a unit last one, e.g. a slice of a
    fused projection viewed as heads), weight [D] -> ``gated_rmsnorm_reference(x, z, weight, eps)``
    in one pass, each row reduced alone (as ``invariant_rmsnorm``; its bits do not depend on the
    other rows). On CUDA SiLU's exp is libdevice's (CUDA's ``expf``, as PyTorch's) and the division
    correctly rounded, so the result is meant to equal the reference bit for bit; the interpreter
    uses NumPy's exp (a float32 ulp or so from PyTorch's CPU SiLU).

        >>> x, z = torch.randn(3, 2, 4), torch.randn(3, 2, 8)[..., :4]  # z: a strided view
        >>> y = gated_rmsnorm(x, z, torch.ones(4), 1e-6)  # doctest: +SKIP
        >>> torch.equal(y, gated_rmsnorm_reference(x, z, torch.ones(4), 1e-6))  # doctest: +SKIP
        True
    """
    _check(x, weight, "gated RMSNorm")
    if not gated_rmsnorm_supports(x, z, weight):
        raise LogprobeError("z", f"x {x.dtype} {tuple(x.shape)}, z {z.dtype} {tuple(z.shape)} and weight "
                            f"{weight.dtype}: need one shape and float32/bfloat16/float16", "use gated_rmsnorm_reference")
    shape, H = x.shape, x.shape[-1]
    x2 = x.reshape(-1, H)  # [R, D]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    heads = shape[-2] if x.dim() >= 2 else 1
    z3 = z.reshape(-1, heads, H)  # [T, Hv, D]: a view where z's strides allow, else a copy
    if z3.stride(2) != 1:
        z3 = z3.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    R = x2.shape[0]
    if R:
        rows = rows_per_program(H)
        _gated_rmsnorm[(triton.cdiv(R, rows),)](
            x2, z3, weight.contiguous(), y, R, H, heads, x2.stride(0), z3.stride(0), z3.stride(1), y.stride(0),
            float(eps), X_KIND=FLOAT_KINDS[x.dtype], P_KIND=FLOAT_KINDS[torch.promote_types(weight.dtype, x.dtype)],
            LIBDEVICE_EXP=x.is_cuda and libdevice is not None, BLOCK=triton.next_power_of_2(H), ROWS=rows)
    return y.view(shape)
