"""Batch-invariant RMSNorm in Triton: one program per row, one fixed reduction tree.

PyTorch's CUDA reductions choose how many threads share a row from the tensor's shape, so
``x.pow(2).mean(-1)`` of a row can round differently with more or fewer rows in the batch. Here
each row is reduced alone over a [BLOCK] vector (BLOCK = next power of two of H; narrow rows a few
to a program, ``rows_per_program``, each still along its own axis): the same additions in the same
order whatever else is in the batch. Same function as
``layers.norm.RMSNorm`` (its reference): float32 statistics, cast to the activation dtype, then
the gain in that dtype.
"""

from __future__ import annotations

import torch

from ..errors import LogprobeError
from . import interpreting, triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _rmsnorm(x_ptr, w_ptr, y_ptr, R, H, stride_x, stride_y, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        # ROWS rows a program, each reduced along its own axis: a row's additions are the same
        # wherever it sits in the block (every row of the [ROWS, BLOCK] tile has one layout)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        ok = (rows < R)[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        ms = tl.sum(x * x, axis=1) / H  # [ROWS]
        xn = x * (1.0 / tl.sqrt(ms + eps))[:, None]
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
        y = w[None, :] * xn.to(x_ptr.dtype.element_ty)  # round to the activation dtype first, as the reference
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y, mask=ok)


def rows_per_program(width: int) -> int:
    """Rows one program normalises: enough for about 2048 elements, so the per-head norms of q and
    k (Qwen3: rows of head_dim = 128, 32 per token) are not one tiny program each (on an H200 those
    took 6% of Qwen3-MoE's W1). A function of the width only, never of the number of rows.

    >>> [rows_per_program(w) for w in (128, 96, 2048, 4096)]
    [16, 16, 1, 1]
    """
    block = 1 << max(0, (width - 1).bit_length())  # next power of two
    return max(1, 2048 // block)


def invariant_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> RMSNorm(x) * weight, each row computed alone."""
    if x.shape[-1] != weight.shape[0]:
        raise LogprobeError("x", f"width {x.shape[-1]} does not match the norm's {weight.shape[0]}")
    if not triton_available() or not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        raise LogprobeError("device", "the invariant RMSNorm runs on CUDA (or CPU under TRITON_INTERPRET=1)")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # [R, H]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    H = shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    R = x2.shape[0]
    if R:
        rows = rows_per_program(H)
        _rmsnorm[(triton.cdiv(R, rows),)](x2, weight.contiguous(), y, R, H, x2.stride(0), y.stride(0), float(eps),
                                          BLOCK=triton.next_power_of_2(H), ROWS=rows)
    return y.view(shape)
