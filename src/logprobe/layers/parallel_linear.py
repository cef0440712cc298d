"""Tensor-parallel linear layers: each does its own communication in ``forward``.

* ``ColumnParallelLinear``: rank r holds rows ``W[r]`` of the weight (its heads, its share of the
  intermediate size) and computes ``y_r = x W[r]^T (+ b[r])``; the output stays sharded (the
  next op is per head, or SiLU(gate) * up), so it communicates nothing.
* ``GatheredRowLinear`` (o_proj, down_proj): its input arrives sharded by columns (rank r's heads,
  its intermediate share). Rank r holds the rows of the weight for its share of the outputs,
  whole along the inner dimension: it gathers the ranks' input columns, computes its outputs
  over the whole inner dimension, and the ranks' outputs are gathered side by side. Gathers only
  copy, so every output element is one dot product over the whole inner dimension, in the same
  order at every TP size (Megatron's split sums per-rank partial products instead, whose order
  changes with the TP size).

Deterministic mode computes every product in fixed row tiles and fixed column blocks (each layer
derives them from its whole width and ``ParallelContext.blocks`` = S: width / S, or one head where
S does not divide the heads), so a column's product has one shape at every TP size; on CUDA the Triton fixed-tile matmul gives that by construction. Worked example, hidden
size 64, intermediate 128, S = 4 (blocks of 16 output columns for down_proj):

    TP = 1 : x [T, 128] @ W[0:64]^T   in blocks 0:16, 16:32, 32:48, 48:64
    TP = 2 : rank 0 gathers x (its 0:64 and rank 1's 64:128) -> [T, 128]; W[0:32]: blocks 0:16, 16:32
             rank 1 the same with W[32:64]: blocks 32:48, 48:64; the two [T, 32] outputs gathered

Every output column is the same product of the same operands in both: identical bits. Traffic per
layer at TP = 2 is half the input and half the output ([T, K/2] + [T, H/2] received), the same
as a ring all-reduce of [T, H] for o_proj and 2.25x it for Llama's down_proj.

With one rank both compute as plain ``Linear`` layers.

Each layer states its own split: ``tp_rows`` = the rows [start, end) of the checkpoint's whole
tensor that this rank holds, for every parameter of the layer (``RowShard``). The loaders cut
checkpoints by it and weight updates slice by it (``loading.sharding``), so the split is written
once, here, where the layer is built.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.context import ParallelContext
from ..parallel.shard import shard_range
from .linear import Linear


class RowShard:
    """A layer holding rows ``tp_rows`` = [start, end) of each of its parameters' whole tensors
    (weight [rows, ...] and bias [rows]); None: every rank holds them whole."""

    tp_rows: tuple[int, int] | None = None


def held_rows(model: nn.Module, name: str) -> tuple[int, int] | None:
    """The rows of parameter ``name``'s whole tensor that ``model`` (one rank's) holds, as the layer
    owning it states them; None: held whole.

    >>> from logprobe.parallel.context import ParallelContext
    >>> m = nn.Module(); m.up = ColumnParallelLinear(8, 12, False, ParallelContext(1, 2))
    >>> held_rows(m, "up.weight"), held_rows(m, "up.bias")
    ((6, 12), (6, 12))
    """
    parent = name.rpartition(".")[0]
    try:
        owner = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None
    if getattr(owner, "tp_ranges", None) is not None or name.rpartition(".")[2] in getattr(owner, "tp_param_ranges", {}):
        raise ValueError(f"{name}: held in several row ranges (read them with held_ranges)")
    return owner.tp_rows if isinstance(owner, RowShard) else None


def held_ranges(model: nn.Module, name: str) -> tuple[tuple[int, int], ...] | None:
    """The row ranges [start, end) of parameter ``name``'s whole tensor that ``model`` (one rank's)
    holds, in the order its rows are stacked; None: held whole. A ``SegmentedColumnLinear`` states
    several (``tp_ranges``); a module with parameters of its own split by rows states them per
    parameter (``tp_param_ranges``: the Gated DeltaNet's conv weight, A_log, dt_bias); other
    layers one range (``held_rows``)."""
    parent, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None
    own = getattr(owner, "tp_param_ranges", None) or {}
    if leaf in own:
        return own[leaf]
    if getattr(owner, "tp_ranges", None) is not None:
        return owner.tp_ranges
    rows = owner.tp_rows if isinstance(owner, RowShard) else None
    return None if rows is None else (rows,)


def head_ranges(segments: list[tuple[int, int]], ctx: ParallelContext) -> tuple[tuple[int, int], ...]:
    """Rank ``ctx.rank``'s rows of a whole tensor made of ``segments`` side by side, each
    ``(heads, rows per head)`` and split by heads on its own (balanced, contiguous).

    >>> head_ranges([(2, 16), (2, 16), (4, 16)], ParallelContext(1, 2))  # Gated DeltaNet [q | k | v]
    ((16, 32), (48, 64), (96, 128))
    """
    out, offset = [], 0
    for heads, rows in segments:
        h0, h1 = shard_range(heads, ctx.rank, ctx.size)
        out.append((offset + h0 * rows, offset + h1 * rows))
        offset += heads * rows
    return tuple(out)


class ColumnParallelLinear(RowShard, Linear):
    """Rows ``rows`` = [start, end) of a whole ``[total, in_features]`` weight (default: this rank's
    balanced share, ``shard_range``). ``head_dim``: the output columns come in heads of that width
    (q/k/v), so a rank's rows and its column blocks are whole heads.

    Deterministic mode's column blocks, from the whole width and S = ``ctx.blocks``: total / S
    columns when that is a whole number of heads, else one head (k/v with fewer kv heads than
    S); a rank holding a single block computes it as one product. Worked example, 4 query heads
    of 16, 2 kv heads, intermediate 128, S = 4, TP = 2: q_proj rank 1 holds rows 32:64 in blocks
    of 16; k_proj rank 1 rows 16:32, one head (a block of 16, one product); gate_proj rank 1 rows
    64:128 in blocks of 32."""

    def __init__(self, in_features: int, total: int, bias: bool, ctx: ParallelContext, *,
                 rows: tuple[int, int] | None = None, head_dim: int = 1) -> None:
        r0, r1 = rows if rows is not None else shard_range(total, ctx.rank, ctx.size)
        super().__init__(in_features, r1 - r0, bias=bias)
        self.ctx = ctx
        self.tp_rows = (r0, r1)
        block = column_block(total, ctx.blocks, head_dim)
        if block and block <= self.out_features and self.out_features % block == 0 and block < total:
            # a rank holding one block keeps it too: fused with its neighbours (gate | up) the
            # products stay block-wide (a fused [gate 8 | up 8] as one 16-wide product rounds
            # otherwise than the 8-wide ones of TP = 1 on CPU)
            self.col_blocks = [block] * (self.out_features // block)


def column_block(total: int, blocks: int, head_dim: int = 1) -> int | None:
    """Deterministic mode's column block width of a layer ``total`` columns wide (heads of
    ``head_dim``) in a model of ``blocks`` blocks; None: no blocks.

    >>> column_block(64, 4, 16), column_block(32, 4, 16), column_block(128, 4)
    (16, 16, 32)
    """
    if total % blocks == 0 and (total // blocks) % head_dim == 0:
        return total // blocks
    return head_dim if head_dim > 1 else None


class SegmentedColumnLinear(RowShard, Linear):
    """A column-parallel layer whose whole weight is several segments side by side, each split by
    heads on its own (the Gated DeltaNet's ``in_proj_qkv``: rows ``[q | k | v]``, q and k in key
    heads, v in value heads): ``segments`` = [(heads, head_dim), ...]; a rank holds its heads of
    every segment, its rows those ranges stacked (``tp_ranges``, ``head_ranges``). Its output
    keeps the segments' order, so ``[q_r | k_r | v_r]`` splits as the whole one does.

    Deterministic mode's column blocks per segment, as ``ColumnParallelLinear``'s (the segment's
    width / S where that is whole heads, else one head), so a column's product has one shape at
    every TP size. Worked example, segments (2, 16), (2, 16), (4, 16), S = 2, TP = 2: rank 1 holds
    rows 16:32, 48:64 and 96:128, in blocks of 16, 16 and 32 (TP = 1: 16, 16 | 16, 16 | 32, 32)."""

    tp_rows = None  # several ranges: tp_ranges

    def __init__(self, in_features: int, segments: list[tuple[int, int]], bias: bool, ctx: ParallelContext) -> None:
        ranges = head_ranges(segments, ctx)
        widths = [b - a for a, b in ranges]
        super().__init__(in_features, sum(widths), bias=bias)
        self.ctx, self.tp_ranges = ctx, ranges
        blocks = []
        for (heads, head_dim), width in zip(segments, widths):
            block = column_block(heads * head_dim, ctx.blocks, head_dim) or width
            blocks += [block] * (width // block) if width % block == 0 else [width]
        if len(blocks) > 1:
            self.col_blocks = blocks


class GatheredRowLinear(ColumnParallelLinear):
    """A row layer by tensor parallelism's names (o_proj, down_proj: its input arrives sharded by
    columns) that never reduces: it gathers its input, computes rows ``tp_rows`` of the whole
    ``[out_features, in_features]`` weight (its share of the outputs) over the whole inner
    dimension, and gathers the ranks' outputs side by side. ``in_features``: the whole input
    width (the ranks' shares together); ``out_features``: the whole output."""

    fusable = False  # its input is gathered first: never fused with other layers
    gathered = True  # a packed layer replacing it gathers as it does (``quant_linear._PackedLinearMixin.adopt``)

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / size] -> [T, out] on every rank."""
        y = super().forward(self.ctx.gather_columns(x))  # [T, out / size]
        return self.ctx.gather_columns(y)


class ParallelLMHead(RowShard, Linear):
    """The LM head's weight, rows ``rows`` (this rank's vocabulary ids) of the whole [vocab,
    hidden]; the log-prob head reads it (``HeadParams``), never this layer's forward."""

    def __init__(self, hidden: int, rows: tuple[int, int], ctx: ParallelContext) -> None:
        super().__init__(hidden, rows[1] - rows[0])
        self.ctx = ctx
        self.tp_rows = rows
