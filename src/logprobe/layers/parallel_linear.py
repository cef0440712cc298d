"""Tensor-parallel linear layers: each does its own communication in ``forward``.

* ``ColumnParallelLinear``: rank r holds rows ``W[r]`` of the weight (its heads, its share of the
  intermediate size) and computes ``y_r = x W[r]^T (+ b[r])``; the output stays sharded (the
  next op is per head, or SiLU(gate) * up), so it communicates nothing.
* ``RowParallelLinear`` (o_proj, down_proj): its input arrives sharded by columns (rank r's heads,
  its intermediate share). Rank r holds the rows of the weight for its share of the outputs,
  whole along the inner dimension: it gathers the ranks' input columns, computes its outputs
  over the whole inner dimension, and the ranks' outputs are gathered side by side. Gathers only
  copy, so every output element is one dot product over the whole inner dimension, in the same
  order at every TP size (Megatron's split sums per-rank partial products instead, whose order
  changes with the TP size).

Deterministic mode computes every product in fixed row tiles and fixed column blocks (``block``:
a head, or width / S, ``ParallelContext.blocks``), so a column's product has one shape at every
TP size; on CUDA the Triton fixed-tile matmul gives that by construction. Worked example, hidden
size 64, intermediate 128, S = 4 (blocks of 16 output columns for down_proj):

    TP = 1 : x [T, 128] @ W[0:64]^T   in blocks 0:16, 16:32, 32:48, 48:64
    TP = 2 : rank 0 gathers x (its 0:64 and rank 1's 64:128) -> [T, 128]; W[0:32]: blocks 0:16, 16:32
             rank 1 the same with W[32:64]: blocks 32:48, 48:64; the two [T, 32] outputs gathered

Every output column is the same product of the same operands in both: identical bits. Traffic per
layer at TP = 2 is half the input and half the output ([T, K/2] + [T, H/2] received), the same
as a ring all-reduce of [T, H] for o_proj and 2.25x it for Llama's down_proj.

With one rank both are plain ``Linear`` layers.
"""

from __future__ import annotations

import torch

from ..parallel.context import ParallelContext
from .linear import Linear


class ColumnParallelLinear(Linear):
    """``block``: deterministic mode's column block width (a head, or out / S); it divides the
    rank's ``out_features``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext,
                 block: int | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ctx = ctx
        if block and block < out_features:
            self.col_blocks = [block] * (out_features // block)


class RowParallelLinear(ColumnParallelLinear):
    """``in_features``: this rank's share of the inputs (what it receives); ``out_features``: the
    whole output. The weight is this rank's ``out_features / size`` output rows over all
    ``in_features * size`` inputs; ``block`` as for ``ColumnParallelLinear``."""

    fusable = False  # its input is gathered first: never fused with other layers

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext,
                 block: int | None = None) -> None:
        super().__init__(in_features * ctx.size, out_features // ctx.size, bias, ctx, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / size] -> [T, out] on every rank."""
        y = super().forward(self.ctx.gather_columns(x))  # [T, out / size]
        return self.ctx.gather_columns(y)

