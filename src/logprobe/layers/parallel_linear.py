"""Tensor-parallel linear layers (Megatron's split): each does its own communication in ``forward``.

* ``ColumnParallelLinear``: rank r holds rows ``W[r]`` of the weight (its heads, its share of the
  intermediate size) and computes ``y_r = x W[r]^T (+ b[r])``; the output stays sharded (the
  next op is per head, or SiLU(gate) * up), so it communicates nothing. Deterministic mode
  computes it in fixed column blocks (``col_blocks``), so a column's product has the same shape
  at every TP size.
* ``RowParallelLinear``: rank r holds columns ``W[:, r]`` (the inputs its heads / its
  intermediate share produce) and the layer returns ``sum_r x_r W[:, r]^T (+ b)`` on every rank.
  Default mode: one local product and an all-reduce. Deterministic mode: the inner dimension is
  cut into ``S`` fixed slices (``ParallelContext.slices``); each slice's product is kept in
  float32 and the S partials are summed by one fixed pairwise tree (``ParallelContext.tree_sum``),
  the same additions in the same order for TP = 1, 2, 4 or 8. Worked example, S = 4, K = 64:

      slices      : x[:, 0:16] W[:, 0:16]^T = p0,  p1 (16:32),  p2 (32:48),  p3 (48:64)
      TP = 1      : (p0 + p1) + (p2 + p3)              one rank, all four products
      TP = 2      : rank 0: a = p0 + p1; rank 1: b = p2 + p3; all-gather; a + b
      TP = 4      : rank r: p_r; all-gather; (p0 + p1) + (p2 + p3)

  With ``EngineConfig(invariant_matmul="triton")`` on CUDA one Triton kernel
  (``kernels.sliced_matmul``) runs the S slices' K loops and adds them in the tree order in
  registers (tested under Triton's interpreter; not yet measured on a GPU); otherwise S
  fixed-shape products and the tree in PyTorch. Across ranks: a
  float32 all-gather of [TP, T, H] instead of an all-reduce (docs/perf.md).

With one rank both are plain ``Linear`` layers in default mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import triton_available
from ..parallel.context import ParallelContext
from .linear import Linear, tiled_linear


class ColumnParallelLinear(Linear):
    """``block``: deterministic mode's column block width (a head, or out / S); it divides the
    rank's ``out_features``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext,
                 block: int | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ctx = ctx
        if block and block < out_features:
            self.col_blocks = [block] * (out_features // block)


class RowParallelLinear(Linear):
    """``in_features`` is this rank's share of the inputs; the bias (if any) is added once, after
    the sum."""

    fusable = False  # its output is a cross-rank sum: never fused with other layers

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_product(x, self.weight, self.bias, self.row_tile, self.ctx, self.tp_invariant,
                                    self.invariant_kernel)


def row_parallel_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_tile: int | None,
                         ctx: ParallelContext, tp_invariant: bool = True, kernel: str = "cublas") -> torch.Tensor:
    """``sum over ranks of x_r W_r^T (+ bias)`` as ``RowParallelLinear`` defines it (packed layers
    that replace a row-parallel one call this with their expanded weight). Deterministic mode
    without ``tp_invariant``: one product per rank, the rank totals still gathered and summed in
    a fixed order (an all-reduce's order depends on where a row sits in the buffer)."""
    if row_tile is None:
        if not ctx.parallel:
            return F.linear(x, weight, bias)
        y = ctx.all_reduce_sum(F.linear(x, weight))  # [T, out]
        return y if bias is None else y + bias
    if not tp_invariant:
        if not ctx.parallel:
            return tiled_linear(x, weight, bias, row_tile)
        y = ctx.tree_sum([tiled_linear(x, weight, None, row_tile, out_dtype=torch.float32)]).to(x.dtype)
        return y if bias is None else y + bias
    n = max(1, ctx.slices // ctx.size)  # this rank's slices
    if kernel == "triton" and x.is_cuda and x.dim() == 2 and triton_available():  # slices and tree in one kernel
        from ..kernels.sliced_matmul import sliced_linear

        y = ctx.tree_sum([sliced_linear(x, weight, n)]).to(x.dtype)
        return y if bias is None else y + bias
    width = weight.shape[1] // n
    wide = torch.float32 if x.dtype != torch.float32 else None
    partials = [tiled_linear(x[:, i * width:(i + 1) * width], weight[:, i * width:(i + 1) * width], None,
                             row_tile, out_dtype=wide) for i in range(n)]  # n x [T, out] float32
    y = ctx.tree_sum(partials).to(x.dtype)
    return y if bias is None else y + bias


def float32_product(layer, xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """xq [T, in] @ w [out, in]^T (+ the layer's bias), all float32, the way ``layer`` is set up: a
    row-parallel reduction under tensor parallelism, fixed row tiles in deterministic mode, one
    product otherwise. The fake-quantized layers (FP8/INT8/FP4 activations) end with it."""
    bias = None if layer.bias is None else layer.bias.float()
    if layer.reduce_ctx is not None:
        return row_parallel_product(xq, w, bias, layer.row_tile, layer.reduce_ctx, layer.tp_invariant)
    if layer.row_tile is None:
        return F.linear(xq, w, bias)
    return tiled_linear(xq, w, bias, layer.row_tile, layer.col_blocks if layer.tp_invariant else None)
