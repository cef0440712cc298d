"""The k largest values of each row, in Triton: a mixture of experts' router choosing its experts.

``torch.topk`` of 8 of 128 router probabilities over 60,000 rows took 377 µs on an H200 (1.9% of
Qwen3-30B-A3B's W1; a stable sort of the row, 376 µs, was no faster). Here one program takes
``ROWS`` rows whole (at most ``MAX_WIDTH`` columns) and picks the largest k times: the largest
value not taken yet, at its first column (ties by column). Only comparisons: the values are the
row's own, so the result is ``topk_reference``'s exactly and a row's result never depends on the
rows beside it. Worked example, k = 2 of [0.1, 0.7, 0.2, 0.7]: 0.7 at column 1, then 0.7 at 3.

NaN is larger than every number, as ``torch.topk`` orders it (a router that makes NaN has broken
weights; the row's NaNs come first, by column).
"""

from __future__ import annotations

import torch

from ..errors import LogprobeError
from . import interpreting, triton_available

MAX_WIDTH = 1024  # columns a row may have: one program holds ROWS of them

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["R"])  # varies with the batch: one compiled kernel
    def _topk_rows(x_ptr, v_ptr, i_ptr, R, E, stride_x, K: tl.constexpr, BLOCK: tl.constexpr,
                   ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        cols = tl.arange(0, BLOCK)  # [BLOCK]
        inside = (rows < R)[:, None] & (cols < E)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        nan = x != x
        free = inside  # columns not taken yet
        for j in range(K):  # a loop, not unrolled: the compile time does not grow with k
            # a NaN outranks every number: the first free NaN, else the first free column at the largest value
            any_nan = tl.max((nan & free).to(tl.int32), axis=1) > 0  # [ROWS]
            best = tl.max(tl.where(free & ~nan, x, float("-inf")), axis=1)  # [ROWS]
            hit = free & tl.where(any_nan[:, None], nan, (x == best[:, None]) & ~nan)
            col = tl.min(tl.where(hit, cols[None, :], BLOCK), axis=1)  # [ROWS]: first column hit
            col = tl.where(col < BLOCK, col, tl.min(tl.where(free, cols[None, :], BLOCK), axis=1))  # -inf only: first free
            picked = cols[None, :] == col[:, None]
            value = tl.max(tl.where(picked, x, float("-inf")), axis=1)  # the picked column's value (-0.0 kept)
            value = tl.where(any_nan, float("nan"), value)
            ok = rows < R
            tl.store(v_ptr + rows * K + j, value.to(v_ptr.dtype.element_ty), mask=ok)
            tl.store(i_ptr + rows * K + j, col.to(tl.int64), mask=ok)
            free = free & ~picked


def topk_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: the k largest of each row of x [..., E], largest first, equal values by
    column (the order a stable sort, descending, gives them), NaN first."""
    key = torch.where(torch.isnan(x), torch.full_like(x, float("inf")), x)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]
    return x.gather(-1, order), order


def runs_here(x: torch.Tensor, k: int) -> bool:
    """Whether ``topk_rows`` takes x: on CUDA (or the CPU under the interpreter), float32 / bf16 /
    fp16, at most ``MAX_WIDTH`` columns, 1 <= k <= them."""
    return (triton_available() and (x.is_cuda or (interpreting() and x.device.type == "cpu"))
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.dim() >= 1
            and 1 <= k <= x.shape[-1] <= MAX_WIDTH)


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., E] -> (values [..., k] in x's dtype, columns [..., k] int64): ``topk_reference`` in
    one Triton pass over x."""
    if not runs_here(x, k):
        raise LogprobeError("x", f"top-{k} of {tuple(x.shape)} {x.dtype} on {x.device} is not this kernel's",
                            "use torch.topk")
    E = x.shape[-1]
    x2 = x.reshape(-1, E)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    v = torch.empty(R, k, dtype=x.dtype, device=x.device)
    i = torch.empty(R, k, dtype=torch.int64, device=x.device)
    if R:
        block = triton.next_power_of_2(E)
        rows = max(1, min(64, 4096 // block))
        _topk_rows[(triton.cdiv(R, rows),)](x2, v, i, R, E, x2.stride(0), K=k, BLOCK=block, ROWS=rows)
    return v.view(*x.shape[:-1], k), i.view(*x.shape[:-1], k)
