"""gpt-oss's mixture of experts: a biased router choosing by logits, experts with biases and a
clamped SwiGLU, expert matrices dense or MXFP4 packed.

For a token x [H] (router W_r [E, H], b_r [E]; expert e: gate/up W_e [2I, H] (gate rows, then up
rows), b_e [2I]; down D_e [H, I], d_e [H]):

    z    = W_r x + b_r                           [E]  logits, in the model dtype
    ids  = top-k of z (largest first)            [k]
    w    = softmax(z[ids]), rounded to the model dtype, as transformers' ``GptOssTopKRouter``
    g, u = W_e x + b_e split into gate (first I) and up (last I)
    y_j  = D_e((clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')) + d_e,  g' = min(g, limit),  e = ids[j]
    out  = w_0 y_0 + ... + w_{k-1} y_{k-1}       float32, slot order (``layers.moe.combine``), then x's dtype

The router point (``blocks.l.router``, capture only) offers w scattered into [T, E] (zero for the
experts not chosen): gpt-oss's probabilities exist only over the chosen k. Replayed routing
(``Hooks.routing``) gets the softmax of the given experts' logits.

The checkpoint's gate/up rows alternate (gate 0, up 0, gate 1, ...); the loader moves them into
the two halves (``loading.gpt_oss``). Expert matrices are ``nn.Parameter``s [E, out, in] or
``Mxfp4Experts`` (the hub's blocks and scales kept as they are, 4.25 bits a weight). On CPU (and
on CUDA with ``numerics.triton`` off) experts run one at a time on their rows, a packed expert
dequantized to float32 exactly first (``kernels.mxfp4.dequantize_mxfp4``); on CUDA the Triton
kernel ``kernels.mxfp4.gpt_oss_experts`` reads either form (packed: decoded tile by tile).

Deterministic mode adds the k weighted slots as the other families do (``layers.moe.combine_tree``:
a sum per leaf of experts, the leaves as a fixed tree), so that ranks holding whole leaves add
subtrees; default mode adds them in slot order (``combine_to``).

Expert parallelism (``ctx.experts`` = M > 1, one rank per group: M = the TP size): rank r holds
whole experts r * E / M .. (r + 1) * E / M - 1 and the router is whole on every rank. Under
data-parallel attention (``ctx.attention`` "data", the default at M = TP) each rank routes its own
rows and ``GptOssExperts`` runs the other families' exchange (``layers.moe.ExpertsOverSplitRows``:
every rank's rows gathered, its experts' slots of all of them computed, float32 sums
reduce-scattered back; deterministic mode by subtrees of leaves), in two micro-batches. With
attention split by heads (and for batches that run whole on every rank: hooks, cached keys) every
rank computes the slots routed to its experts into a [T*k, H] buffer of -0.0 (``slot_buffer``: each
entry non-zero on one rank, -0.0 the exact identity of the sum, so one process's bits); in
deterministic mode the buffers are reduce-scattered to the ranks owning the tokens, which combine
them (``GptOssExperts.owned_combined``), in default mode each rank combines its own slots and the
ranks sum one float32 [T, H] (``GptOssExperts.combined``: k times less traffic, not one process's
bits). M = 1: every rank holds every expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LogprobeError
from ..kernels.moe import tree_leaves
from ..kernels.mxfp4 import dequantize_mxfp4, expand_mxfp4, gpt_oss_act, gpt_oss_experts
from ..parallel.context import ParallelContext
from ..parallel.rows import RowSplit
from ..parallel.shard import expert_range
from .activation import row_invariant
from .linear import Linear, tiled_linear
from .moe import (
    Experts,
    ExpertsAcrossRanks,
    ExpertsOverSplitRows,
    by_expert,
    combine_to,
    expert_runs,
    kernel_runs,
)
from .numerics import NumericsUser
from .steps import drive


@dataclass(frozen=True, slots=True)
class GptOssMoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    alpha: float = 1.702
    limit: float = 7.0


class Mxfp4Experts(nn.Module):
    """E expert matrices [E, out, in] as MXFP4: ``blocks`` [E, out, in/32, 16] uint8, ``scales``
    [E, out, in/32] uint8 (the hub's ``*_blocks`` / ``*_scales``, rows in the native order).
    ``expert(e)``: expert e's weight [out, in], float32 exactly, then ``compute_dtype``."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.num_experts, self.out_features, groups, _ = blocks.shape
        self.in_features = groups * 32
        self.compute_dtype = torch.float32
        self.register_buffer("blocks", blocks)
        self.register_buffer("scales", scales)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_experts, self.out_features, self.in_features))

    def expert(self, e: int) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks[e], self.scales[e]).to(self.compute_dtype)

    def stacked(self, dtype: torch.dtype, first: int, last: int) -> torch.Tensor:
        """Experts ``first`` .. ``last - 1`` dense [n, out, in] in ``dtype`` (``expand_mxfp4``)."""
        return expand_mxfp4(self.blocks[first:last], self.scales[first:last], dtype)

    def extra_repr(self) -> str:
        return f"mxfp4, experts={self.num_experts}, in={self.in_features}, out={self.out_features}"


class GptOssExperts(ExpertsOverSplitRows, ExpertsAcrossRanks, nn.Module):
    """``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I] (parameters or ``Mxfp4Experts``) and
    their biases [E, 2I], [E, H]. ``forward(x [T, H], ids [T, k])`` -> y [T, k, H] unweighted.
    ``ctx`` with ``experts`` M > 1: this rank holds experts ``first_expert`` .. ``first_expert +
    num_experts - 1`` of ``total_experts`` (E / M of them, whole). Across ranks it is an
    ``Experts`` of whole experts without replicas: the same slot bookkeeping (``my_slots``,
    ``leaf_of``, ``combine_whole``, ``slot_buffer``), exchanges (``parallel_forward``,
    ``combined``, ``split_steps``), through its own kernel (``fused``, ``local``);
    ``owned_combined`` is its own."""

    placement = None  # no replicas of hot experts (refused below)

    def __init__(self, spec: GptOssMoeSpec, hidden: int, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.ctx = ctx = ctx or ParallelContext()
        if ctx.placement is not None:  # its experts and loading keep one contiguous range per rank
            raise LogprobeError("redundant_experts", "gpt-oss holds no replicas of experts", "use 0")
        self.total_experts = spec.num_experts
        self.first_expert, last = expert_range(spec.num_experts, ctx.expert_group, ctx.experts)
        E, inter = last - self.first_expert, spec.intermediate_size
        self.num_experts, self.hidden, self.intermediate = E, hidden, inter
        self.own_experts = E
        self.leaves = tree_leaves(spec.num_experts)  # deterministic mode's combine tree (``combine_tree``)
        self.alpha, self.limit = spec.alpha, spec.limit
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, hidden), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * inter), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, hidden, inter), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(E, hidden), requires_grad=False)

    @property
    def tp_param_ranges(self) -> dict[str, tuple[tuple[int, int], ...]]:
        """The experts of each whole [E, ...] tensor this rank holds (``parallel_linear.held_ranges``:
        its first dimension is the experts'); empty when it holds all of them."""
        if self.num_experts == self.total_experts:
            return {}
        held = ((self.first_expert, self.first_expert + self.num_experts),)
        return {name: held for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}

    def set_packed(self, name: str, packed: Mxfp4Experts) -> None:
        """Replace ``gate_up_proj`` or ``down_proj`` by MXFP4 blocks (at load; shapes checked there)."""
        del self._parameters[name]
        setattr(self, name, packed)

    def weight(self, name: str, e: int) -> torch.Tensor:
        w = getattr(self, name)
        return w.expert(e) if isinstance(w, Mxfp4Experts) else w[e]

    def operand(self, name: str):
        """A weight as ``kernels.mxfp4.gpt_oss_experts`` takes it: dense, or (blocks, scales)."""
        w = getattr(self, name)
        return (w.blocks, w.scales) if isinstance(w, Mxfp4Experts) else w

    def expert_mlp(self, e: int, x: torch.Tensor, row_tile: int | None) -> torch.Tensor:
        """Expert e on rows x [n, H] -> [n, H]; ``row_tile``: fixed row tiles (deterministic mode)."""
        def lin(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return F.linear(a, w, b) if row_tile is None else tiled_linear(a, w, b, row_tile)

        gu = lin(x, self.weight("gate_up_proj", e), self.gate_up_proj_bias[e])  # [n, 2I]
        gate, up = gu.split(self.intermediate, dim=-1)  # [n, I] each
        # each row's bits independent of the row count on CPU (layers.activation.row_invariant)
        act = row_invariant(lambda g, u: gpt_oss_act(g, u, self.alpha, self.limit), gate.contiguous(),
                            up.contiguous())
        return lin(act, self.weight("down_proj", e), self.down_proj_bias[e])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, row_tile: int | None = None,
                triton: bool = True) -> torch.Tensor:
        if self.ctx.parallel and self.ctx.experts > 1:
            return self.parallel_forward(x, ids, row_tile, triton)
        return self.local(x, ids, row_tile, triton)

    def owned_combined(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, row_tile: int | None,
                       triton: bool) -> torch.Tensor:
        """Deterministic mode with M > 1: the ranks' ``slot_buffer``s reduce-scattered by
        blocks of tokens instead of summed whole, so each rank receives every slot of its own
        tokens whole, combines them as one process does (``combine_whole``: deterministic mode's
        tree, row by row), and the ranks all-gather the combined rows -> [T, H] in x's dtype, one process's
        bits. Traffic per rank: (N-1)/N of T·k·H plus (N-1)/N of T·H, against 2 (N-1)/N of T·k·H
        for summing the buffers whole. Worked example, N = 2, T = 3 (padded to 4), k = 2: rank 0
        receives the four slots of tokens 0, 1 and combines them; rank 1 tokens 2 and the pad 3,
        combining token 2 only; the gathered rows are cut back to 3."""
        T, k = ids.shape
        size, H = self.ctx.size, self.hidden
        per = -(-T // size)  # tokens a rank combines (the last block padded)
        y = self.slot_buffer(x, ids, per * size, row_tile, triton)  # [T_pad*k, H]
        mine = self.ctx.reduce_scatter_sum(y).view(per, k, H)  # this rank's tokens, every slot whole
        lo = self.ctx.rank * per
        n = max(0, min(per, T - lo))
        out = x.new_zeros(per, H)
        if n:
            out[:n] = self.combine_whole(mine[:n], ids[lo:lo + n], weights[lo:lo + n], x.dtype)
        return self.ctx.all_gather(out).view(per * size, H)[:T]  # [T, H]

    def local(self, x: torch.Tensor, ids: torch.Tensor, row_tile: int | None, triton: bool) -> torch.Tensor:
        """The experts held here, ``ids`` [T, k] numbered 0 .. num_experts - 1 -> [T, k, H]."""
        T, k = ids.shape
        if self.fused_runs(x, triton):
            return self.fused(x, ids).view(T, k, self.hidden)  # [T*k, H] -> [T, k, H]
        return by_expert(x, ids, self.num_experts, self.hidden, lambda e, rows: self.expert_mlp(e, rows, row_tile))

    def fused_runs(self, x: torch.Tensor, triton: bool, interpreted: bool = False) -> bool:
        """Whether ``fused`` runs on activations like ``x`` (``layers.moe.kernel_runs``)."""
        return kernel_runs(x, triton, interpreted)

    STACK_BYTES = Experts.STACK_BYTES  # packed experts expanded this much at a time (``expand_runs``)
    # slots per held expert from which expanding the packed experts before the products pays: one
    # expert of gpt-oss-120b expands in ~21 us (50 MB written), and a slot runs ~90 ns faster on
    # the dense form (the kernel decodes every weight tile again for each row tile): ~230 slots
    EXPAND_SLOTS = 256

    def fused(self, x: torch.Tensor, ids: torch.Tensor, foreign: bool = False) -> torch.Tensor:
        """``gpt_oss_experts`` over the experts held here -> y [T*k, H] (ids outside 0 ..
        num_experts - 1: no tile, their rows unwritten; ``foreign``: most slots are other ranks',
        about 1 / M of them here). MXFP4 experts are read
        packed on a small pass; on a pass of at least ``EXPAND_SLOTS`` slots an expert they are
        first expanded to x's dtype, ``expand_runs`` at a time, each run computing its slots into
        one buffer. The kernel decodes the same values either way and keeps its tiles, so a slot's
        bits do not depend on which form ran (``kernels.mxfp4.expand_mxfp4``)."""
        b13, b2 = self.gate_up_proj_bias.to(x.dtype), self.down_proj_bias.to(x.dtype)
        runs = self.expand_runs(x.dtype, ids.numel() // (self.ctx.experts if foreign else 1))
        if runs is None:
            return gpt_oss_experts(x, ids, self.operand("gate_up_proj"), b13, self.operand("down_proj"), b2,
                                   self.alpha, self.limit)
        y = x.new_empty(ids.numel(), self.hidden)  # [T*k, H]: every slot written by its expert's run
        for first, last in runs:
            gpt_oss_experts(x, ids - first, self.dense("gate_up_proj", x.dtype, first, last), b13[first:last],
                            self.dense("down_proj", x.dtype, first, last), b2[first:last], self.alpha, self.limit,
                            out=y)
        return y

    def expand_runs(self, dtype: torch.dtype, slots: int) -> list[tuple[int, int]] | None:
        """The held experts in runs that expand to at most ``STACK_BYTES`` each, or None: dense
        experts, or fewer than ``EXPAND_SLOTS`` slots an expert (read packed).

        >>> e = GptOssExperts(GptOssMoeSpec(8, 2, 32), 64)
        >>> e.set_packed("down_proj", Mxfp4Experts(torch.zeros(8, 64, 1, 16, dtype=torch.uint8),
        ...                                        torch.zeros(8, 64, 1, dtype=torch.uint8)))
        >>> e.STACK_BYTES = 3 * 64 * 32 * 2; e.expand_runs(torch.bfloat16, 8 * 256), e.expand_runs(torch.bfloat16, 100)
        ([(0, 3), (3, 6), (6, 8)], None)
        """
        packed = [w for w in (self.gate_up_proj, self.down_proj) if isinstance(w, Mxfp4Experts)]
        if not packed or slots < self.EXPAND_SLOTS * self.num_experts:
            return None
        per_expert = sum(w.out_features * w.in_features for w in packed) * dtype.itemsize
        return expert_runs(self.num_experts, per_expert, self.STACK_BYTES)

    def dense(self, name: str, dtype: torch.dtype, first: int, last: int) -> torch.Tensor:
        """Experts ``first`` .. ``last - 1`` of a weight, dense [n, out, in] (packed ones expanded)."""
        w = getattr(self, name)
        return w.stacked(dtype, first, last) if isinstance(w, Mxfp4Experts) else w[first:last]


class GptOssMoe(NumericsUser, nn.Module):
    """Router + experts in place of a dense MLP: ``forward(x [T, H], hooks)`` -> [T, H], or
    ``forward(x, None, rows)`` on this rank's rows of a batch split by sequences (data-parallel
    attention: ``steps``)."""

    def __init__(self, spec: GptOssMoeSpec, hidden: int, router_point: str, ctx: ParallelContext | None = None
                 ) -> None:
        super().__init__()
        self.spec, self.top_k, self.router_point = spec, spec.top_k, router_point
        self.router = Linear(hidden, spec.num_experts, bias=True)  # [E, H] + [E]: whole on every rank
        self.experts = GptOssExperts(spec, hidden, ctx)

    def fuse(self) -> None:
        pass

    @staticmethod
    def weigh(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Softmax of the chosen experts' logits [T, k], rounded to the logits' dtype (as transformers
        takes it in that dtype), as float32."""
        return torch.softmax(logits.gather(1, ids).float(), dim=-1).to(logits.dtype).float()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> the router's logits [T, E], expert ids [T, k] (largest first) and weights [T, k]."""
        logits = self.router(x)  # [T, E]
        ids = torch.topk(logits, self.top_k, dim=-1).indices  # [T, k], largest first
        return logits, ids, self.weigh(logits, ids)

    def forward(self, x: torch.Tensor, hooks=None, rows: RowSplit | None = None) -> torch.Tensor:
        if rows is not None and self.experts.ctx.parallel:  # own rows routed; every rank's gathered
            return drive(self.steps(x, rows, self.experts.MAX_PARTS))
        logits, ids, weights = self.route(x)  # [T, E], [T, k], [T, k] float32
        if hooks is not None:
            hooks(self.router_point, torch.zeros_like(logits, dtype=torch.float32).scatter_(1, ids, weights))
            forced = hooks.routing(self.router_point, ids, lambda forced_ids: self.weigh(logits, forced_ids))
            if forced is not None:  # replayed experts (``layers.hooks.RouteTable``)
                weights, ids = forced
        ctx, n = self.experts.ctx, self.numerics
        if ctx.parallel and ctx.experts > 1:
            if n.deterministic:  # every slot whole at its token's rank, combined there as one process
                return self.experts.owned_combined(x, ids, weights, n.row_tile, n.triton)
            return self.experts.combined(x, ids, weights, n.row_tile, n.triton)  # one [T, H] sum over ranks
        y = self.experts(x, ids, n.row_tile, n.triton)  # [T, k, H]
        if n.deterministic:  # the fixed tree, as subtrees over ranks add up to
            return self.experts.combine_whole(y, ids, weights, x.dtype)  # [T, H]
        return combine_to(y, weights, x.dtype)  # [T, H]

    def steps(self, x: torch.Tensor, rows: RowSplit, max_parts: int = 1):
        """``forward`` on this rank's rows x [n, H] of a batch split by sequences (``rows``), as a
        generator that yields where the experts' transfers run (``ExpertsOverSplitRows.split_steps``,
        ``layers.steps``) -> [n, H]."""
        _, ids, weights = self.route(x)  # [n, k] each
        n = self.numerics
        return (yield from self.experts.split_steps(x, ids, weights, rows, n.deterministic, n.row_tile, n.triton,
                                                    max_parts))
