"""Batch-invariant matrix product in Triton: ``y = x @ W.T (+ b)`` with one fixed tile shape.

cuBLAS picks its kernel (tile shape, split-K) from the matrix shape, so a row's result can change
with how many rows came with it. Here every output tile [BLOCK_M, BLOCK_N] is a K loop of
``tl.dot`` over BLOCK_K slices in order, float32 accumulator, no split-K, and the tile shape
never depends on M: row i's numbers depend only on row i, W and b. This is what deterministic
mode runs on CUDA (``layers.linear.Linear`` with ``row_tile`` set). The pure-PyTorch reference
is ``F.linear`` (equal within float32 rounding of the accumulation order, tested).

Programs run in groups of GROUP_M row tiles (column tiles within a group vary fastest) so tiles
running together share their weight tiles in L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LogprobeError
from . import interpreting, triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """This program's (row tile, column tile): groups of GROUP_M row tiles, column tiles
        varying fastest within a group, so programs running together share weight tiles in L2."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m

    @triton.jit(do_not_specialize=["M"])  # M changes every batch: one compiled kernel for all
    def _matmul(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        rk = tl.arange(0, BLOCK_K)  # [BK]
        xp = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]  # [BM, BK]
        wp = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BK, BN]: W^T tile
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(xp, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(wp, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
            xp += BLOCK_K
            wp += BLOCK_K
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        yp = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    """Tile shape; the default was the fastest of six on llama-8b's shapes on an H100 (0.72-0.77
    of cuBLAS, docs/perf.md)."""

    block_m: int = 256
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


DEFAULT_CONFIG = MatmulConfig()


def check_operands(x: torch.Tensor, weight: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], weight [N, K] of one 16/32-bit float dtype on a device a Triton kernel can run
    on; both returned with unit stride in K."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise LogprobeError("x", f"shapes {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise LogprobeError("x", f"dtypes {x.dtype} and {weight.dtype} must match (bf16, fp16 or fp32)")
    if not triton_available() or not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        raise LogprobeError("device", f"{what} runs on CUDA (or CPU under TRITON_INTERPRET=1)")
    return (x if x.stride(1) == 1 else x.contiguous()), (weight if weight.stride(1) == 1 else weight.contiguous())


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     config: MatmulConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype, row-wise batch invariant."""
    x, weight = check_operands(x, weight, "the invariant matmul")
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    c = config
    grid = (triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n),)
    _matmul[grid](x, weight, bias, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
                  HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                  BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                  num_warps=c.num_warps, num_stages=c.num_stages)
    return y
