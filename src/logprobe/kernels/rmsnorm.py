"""Batch-invariant RMSNorm in Triton: one program per row, one fixed reduction tree.

PyTorch's CUDA reductions choose how many threads share a row from the tensor's shape, so
``x.pow(2).mean(-1)`` of a row can round differently with more or fewer rows in the batch. Here
each row is reduced alone over a [BLOCK] vector (BLOCK = next power of two of H): the same
additions in the same order whatever else is in the batch. Same function as
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
    def _rmsnorm(x_ptr, w_ptr, y_ptr, H, stride_x, stride_y, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        ms = tl.sum(x * x, axis=0) / H
        xn = x * (1.0 / tl.sqrt(ms + eps))
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        y = w * xn.to(x_ptr.dtype.element_ty)  # round to the activation dtype first, as the reference
        tl.store(y_ptr + row * stride_y + cols, y, mask=ok)


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
    if x2.shape[0]:
        _rmsnorm[(x2.shape[0],)](x2, weight.contiguous(), y, H, x2.stride(0), y.stride(0), float(eps),
                                 BLOCK=triton.next_power_of_2(H))
    return y.view(shape)
