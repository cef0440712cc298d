"""Mixture-of-experts MLP: a router picks ``k`` of ``E`` SiLU-gated expert MLPs per token and
adds their outputs, weighted by the router's probabilities.

For a token x [H] (router weight G [E, H]; expert e has gate_e, up_e [I, H] and down_e [H, I]):

    p    = softmax(float32(G x))                 [E]  the router probabilities (hook point blocks.l.router)
    ids  = top-k of p (torch.topk order: largest first)   [k]
    w    = p[ids], divided by sum(p[ids]) when norm_topk_prob   [k] float32
    y_j  = down_e(SiLU(gate_e x) * up_e x),  e = ids[j]
    out  = w_0 y_0 + w_1 y_1 + ... + w_{k-1} y_{k-1}   (float32, in slot order j, then x's dtype)
         + sigmoid(g . x) * shared(x)                  (Qwen2-MoE's shared expert, when present)

This is the routing of transformers' Qwen2-MoE / Qwen3-MoE / OLMoE routers (softmax in float32,
top-k, optional renormalisation) and of Mixtral's (always renormalised: softmax over all experts,
top-k, divide by their sum, which equals a softmax over the k selected logits).

DeepSeek-V3's router (``MoeSpec.router == "sigmoid_grouped"``, ``route_grouped``; also Kimi K2 and
Moonlight): sigmoid scores in float32 from a float32 router, a score-correction bias b that only
chooses experts, experts in G groups of which the best ``topk_group`` survive (a group's score is
the sum of its two best biased scores), an unweighted shared expert:

    s    = sigmoid(float32(G) float32(x))           [E]  (hook point blocks.l.router: these scores)
    c    = s + b;  group g scores sum(top-2 of c in g);  c outside the topk_group best groups = -inf
    ids  = top-k of c;   w = s[ids] / (sum(s[ids]) + 1e-20) if norm_topk_prob else s[ids];  w *= routed_scaling_factor
    out  = sum_j w_j y_j  (as above)  + shared(x)

Worked example, T = 3 tokens, E = 4 experts, k = 2, ids = [[2, 0], [0, 3], [2, 1]]:

    slots (t, j) -> flat index t*k + j:   0:(0,e2) 1:(0,e0) 2:(1,e0) 3:(1,e3) 4:(2,e2) 5:(2,e1)
    sorted by expert (stable):            e0: slots 1, 2 | e1: slot 5 | e2: slots 0, 4 | e3: slot 3
    each expert multiplies its contiguous segment of rows; results go back to their slots
    out[0] = w[0,0] * y[slot 0] + w[0,1] * y[slot 1]     (the order of j, never the order of experts)

A token's numbers therefore never depend on which other tokens share its experts: each row of a
segment is its own product (in deterministic mode every segment runs in fixed row tiles, as the
dense layers do; the Triton kernel ``kernels.moe`` has fixed tiles by construction) and the
weighted sum runs in slot order. Expert weights are 3-D ``[E, out, in]`` tensors, or
``PackedExperts`` (GGUF blocks, expanded one expert at a time inside the forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LogprobeError
from ..kernels import interpreting, triton_available
from ..kernels.gguf_quants import block_values, dequantize_blocks
from ..kernels.moe import (
    align_by_expert,
    combine_leaves,
    combine_owned,
    combine_rows,
    combine_slots,
    default_config,
    fused_moe,
    moe_down,
    moe_gate_up,
    tree_leaves,
)
from ..kernels.topk import runs_here as topk_runs_here
from ..kernels.topk import topk_rows
from ..parallel.context import ParallelContext, tree_positions
from ..parallel.placement import Placement, slot_ranks
from ..parallel.rows import RowSplit
from ..parallel.shard import expert_range, shard_range
from .activation import row_invariant, silu_mul
from .linear import Linear, tiled_linear
from .numerics import NumericsUser
from .parallel_linear import column_block
from .quant_linear import PackedWeight
from .steps import drive

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The MoE part of a model's config.

    ``dense_layers``: blocks that keep a dense MLP of ``intermediate_size`` (Qwen-MoE's
    ``mlp_only_layers`` / ``decoder_sparse_step``). ``shared_intermediate_size`` > 0: a shared
    expert of that width with a sigmoid gate (Qwen2-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    # "softmax" (Qwen-MoE, Mixtral, OLMoE: ``route``) or "sigmoid_grouped" (DeepSeek-V3: ``route_grouped``,
    # with a score-correction bias, n_group / topk_group, routed_scaling_factor and an ungated shared expert)
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise LogprobeError("config.num_experts_per_tok", f"{self.top_k} experts per token out of "
                                f"{self.num_experts}", "use 1 <= num_experts_per_tok <= num_experts")
        if self.intermediate_size < 1:
            raise LogprobeError("config.moe_intermediate_size", f"must be positive, got {self.intermediate_size}")
        if self.router not in ("softmax", "sigmoid_grouped"):
            raise LogprobeError("config.scoring_func", f"router {self.router!r} is not run natively")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise LogprobeError("config.n_group", f"{self.n_group} does not divide n_routed_experts {self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise LogprobeError("config.topk_group", f"{self.topk_group} groups out of n_group {self.n_group}",
                                "use 1 <= topk_group <= n_group")
        if self.router == "sigmoid_grouped":
            if self.num_experts // self.n_group < 2:
                raise LogprobeError("config.n_group", f"{self.n_group} groups of {self.num_experts} experts: a "
                                    "group's score is the sum of its two best, so a group needs 2 or more")
            if self.top_k > self.topk_group * (self.num_experts // self.n_group):
                raise LogprobeError("config.num_experts_per_tok", f"{self.top_k} experts from {self.topk_group} "
                                    f"groups of {self.num_experts // self.n_group}")


def largest(x: torch.Tensor, k: int, triton: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [..., E] and their columns, largest first, as
    ``torch.topk``: on CUDA by ``kernels.topk.topk_rows`` (equal values by column; 1.9% of
    Qwen3-30B-A3B's W1 was ``torch.topk``), elsewhere, or with ``triton`` False, ``torch.topk``.

    >>> v, i = largest(torch.tensor([[0.1, 0.7, 0.2]]), 2)
    >>> i.tolist(), [round(a, 2) for a in v[0].tolist()]
    ([[1, 2]], [0.7, 0.2])
    """
    if triton and x.is_cuda and topk_runs_here(x, k):
        return topk_rows(x, k)
    return torch.topk(x, k, dim=-1)


def expert_runs(num_experts: int, per_expert: int, budget: int) -> list[tuple[int, int]]:
    """Experts 0 .. num_experts - 1 in consecutive runs of at most ``budget`` bytes, ``per_expert``
    bytes each (at least one expert a run; 0 bytes: one run), as packed experts are expanded.

    >>> expert_runs(8, 40, 100), expert_runs(3, 500, 100), expert_runs(4, 0, 100)
    ([(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 1), (1, 2), (2, 3)], [(0, 4)])
    """
    step = max(1, budget // per_expert) if per_expert else num_experts
    return [(e, min(e + step, num_experts)) for e in range(0, num_experts, step)]


def route(logits: torch.Tensor, top_k: int, renormalize: bool, triton: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> probabilities [T, E] float32, weights [T, k] float32, expert ids [T, k].

    >>> p, w, ids = route(torch.tensor([[0.0, 2.0, 1.0]]), 2, True)
    >>> ids.tolist(), [round(v, 4) for v in w[0].tolist()]
    ([[1, 2]], [0.7311, 0.2689])
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = largest(probs, top_k, triton)  # [T, k] each, largest first
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, ids


def route_grouped(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  renormalize: bool, scale: float, triton: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (transformers' ``DeepseekV3TopkRouter``): float32 logits [T, E] and the
    score-correction bias [E] -> sigmoid scores [T, E], weights [T, k] float32, expert ids [T, k].
    The bias only chooses; the weights are the unbiased scores.

    >>> s, w, ids = route_grouped(torch.tensor([[0.0, 1.0, 3.0, 2.0]]), torch.tensor([0.0, 0.0, -5.0, 0.0]),
    ...                           2, 2, 1, True, 2.0)
    >>> ids.tolist(), [round(v, 4) for v in w[0].tolist()]
    ([[1, 0]], [1.1877, 0.8123])
    """
    scores = row_invariant(torch.sigmoid, logits.float())  # [T, E], each row's bits independent of T
    choice = scores + bias.float()  # [T, E]
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)  # [T, G, E/G]
    group_scores = largest(grouped, 2, triton)[0].sum(dim=-1)  # [T, G]
    keep = largest(group_scores, topk_group, triton)[1]  # [T, topk_group]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)  # [T, G]
    choice = choice.masked_fill(~mask[:, :, None].expand_as(grouped).reshape(T, E), float("-inf"))
    ids = largest(choice, top_k, triton)[1]  # [T, k], largest first
    weights = scores.gather(1, ids)  # [T, k]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return scores, weights * scale, ids


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Expert ids [T, k] -> ``order`` [T*k] (the flat slots t*k + j grouped by expert, stable) and
    each expert's segment length (``counts[e]`` rows, segments in expert order).

    >>> order, counts = sort_by_expert(torch.tensor([[2, 0], [0, 3], [2, 1]]), 4)
    >>> order.tolist(), counts
    ([1, 2, 5, 0, 4, 3], [2, 1, 2, 1])
    """
    flat = ids.reshape(-1)  # [T*k]
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def by_expert(x: torch.Tensor, ids: torch.Tensor, num_experts: int, width: int, mlp) -> torch.Tensor:
    """A mixture's PyTorch path: x [T, H] routed to ``ids`` [T, k] (0 .. num_experts - 1) ->
    [T, k, width], the rows sorted by expert and one ``mlp(e, rows [n, H]) -> [n, width]`` per
    expert segment (in fixed tiles where ``mlp`` uses them), then put back in slot order."""
    T, k = ids.shape
    order, counts = sort_by_expert(ids, num_experts)
    xs = x[order // k]  # [T*k, H]: slot s reads token s // k
    ys = x.new_empty(T * k, width)  # [T*k, width] in expert order
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start:start + n] = mlp(e, xs[start:start + n])
        start += n
    y = torch.empty_like(ys)
    y[order] = ys  # back to slot order
    return y.view(T, k, width)


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Expert outputs y [T, k, H] and weights [T, k] -> float32 [T, H], added in slot order."""
    out = y[:, 0].float() * weights[:, :1]
    for j in range(1, y.shape[1]):
        out = out + y[:, j].float() * weights[:, j:j + 1]
    return out


def combine_to(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``combine(y, weights).to(dtype)``; on CUDA one Triton pass (``kernels.moe.combine_slots``,
    the same bits) instead of 3k float32 temporaries of [T, H]."""
    if y.is_cuda:
        if triton_available():
            return combine_slots(y.reshape(-1, y.shape[-1]), weights, dtype)  # [T, k, H] -> [T*k, H]
    return combine(y, weights).to(dtype)


def combine_tree(y: torch.Tensor, weights: torch.Tensor, leaf: torch.Tensor, leaves: int) -> torch.Tensor:
    """Deterministic mode's combine: expert outputs y [T, k, H], weights [T, k] float32 and each
    slot's leaf [T, k] (-1 or >= ``leaves``: a slot not summed here) -> float32 [T, H]. The experts
    are cut into ``leaves`` consecutive leaves (``kernels.moe.tree_leaves``: a property of the
    model); each leaf sums its slots in slot order from +0.0, then the leaves are added as a fixed
    tree, neighbours first. A rank holding leaves 4 .. 7 of 8 computes the subtree ``(s4 + s5) +
    (s6 + s7)`` and ``ParallelContext.tree_reduce_scatter_start`` adds the subtrees over the ranks
    in the same tree, so every size has one process's bits. Worked example, k = 2, two leaves:

        >>> y = torch.tensor([[[1.0], [2.0]], [[4.0], [8.0]]])         # T = 2 tokens, k = 2 slots
        >>> w = torch.tensor([[0.5, 0.25], [1.0, 1.0]])
        >>> combine_tree(y, w, torch.tensor([[1, 0], [1, 1]]), 2).tolist()   # t0: s0 = 0.5, s1 = 0.5
        [[1.0], [12.0]]
    """
    T, k, H = y.shape
    sums = [y.new_zeros(T, H, dtype=torch.float32) for _ in range(leaves)]
    for j in range(k):
        v = y[:, j].float() * weights[:, j:j + 1]  # [T, H]
        for g in range(leaves):
            sums[g] = sums[g] + torch.where((leaf[:, j] == g)[:, None], v, 0.0)
    while len(sums) > 1:
        sums = [sums[i] + sums[i + 1] for i in range(0, len(sums), 2)]
    return sums[0]


def combine_tree_to(y: torch.Tensor, weights: torch.Tensor, leaf: torch.Tensor, leaves: int, dtype: torch.dtype,
                    positions: list[int] | None = None) -> torch.Tensor:
    """``combine_tree`` of y [T*k, H] (by slot) rounded to ``dtype``; on CUDA one Triton pass
    (``kernels.moe.combine_leaves``, the same bits). ``positions``: row block b (T / len blocks
    each) written at block ``positions[b]`` (a bit-reversal: its own inverse)."""
    T, k = weights.shape
    if y.is_cuda and triton_available():
        pos = None if positions is None else torch.tensor(positions, dtype=torch.int32)
        return combine_leaves(y.reshape(T * k, -1), weights, leaf, leaves, dtype, pos)
    out = combine_tree(y.reshape(T, k, -1), weights, leaf, leaves).to(dtype)
    if positions is None:
        return out
    placed = torch.empty_like(out).view(len(positions), -1, out.shape[-1])
    placed[torch.tensor(positions)] = out.view(len(positions), -1, out.shape[-1])
    return placed.view_as(out)


def combine_local(y: torch.Tensor, row_weights: torch.Tensor, slots: torch.Tensor, top_k: int, tokens: int
                  ) -> torch.Tensor:
    """The part of ``combine`` one rank holds (expert parallelism, default mode): rows y [n, H'] of
    slots ``slots`` [n] (ascending ``t * top_k + j``) and their weights [n] float32 -> float32
    [tokens, H'], ``out[t] = 0 + w y + ...`` over token t's rows in slot order, zero where it has
    none. Each slot index j adds its rows at once (its tokens are distinct: the same sum on CUDA).

    >>> y = torch.tensor([[1.0], [2.0], [4.0]])   # slots 1 (t0, j1), 2 (t1, j0), 3 (t1, j1)
    >>> combine_local(y, torch.tensor([0.5, 0.25, 1.0]), torch.tensor([1, 2, 3]), 2, 3).tolist()
    [[0.5], [4.5], [0.0]]
    """
    out = y.new_zeros(tokens, y.shape[1], dtype=torch.float32)  # [tokens, H']
    j_of = slots % top_k
    for j in range(top_k):
        sel = (j_of == j).nonzero().squeeze(1)  # [m]: the rows of slot index j
        if sel.numel():
            out.index_add_(0, slots[sel] // top_k, y[sel].float() * row_weights[sel, None])
    return out


def combine_partial(y: torch.Tensor, row_weights: torch.Tensor, slots: torch.Tensor, top_k: int, tokens: int,
                    triton: bool = True) -> torch.Tensor:
    """``combine_local``; on CUDA one Triton pass (``kernels.moe.combine_rows``, the same bits)."""
    if triton and y.is_cuda and triton_available():
        return combine_rows(y, row_weights, slots, top_k, tokens)
    return combine_local(y, row_weights, slots, top_k, tokens)


def kernel_runs(x: torch.Tensor, triton: bool, interpreted: bool = False) -> bool:
    """Whether a fused expert kernel runs on activations like ``x``: CUDA (``interpreted``: also
    CPU under Triton's interpreter, for the tests), 16- or 32-bit floats, Triton on."""
    runs = x.is_cuda or (interpreted and interpreting() and x.device.type == "cpu")
    return bool(triton and runs and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and triton_available())


def local_slots(ids: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of ``ids`` [T, k] routed to experts ``first .. first + count - 1``: their flat
    indices [n] (ascending) and their experts numbered from 0 [n].

    >>> local_slots(torch.tensor([[2, 0], [0, 3]]), 2, 2)
    (tensor([0, 3]), tensor([0, 1]))
    """
    local = ids.reshape(-1) - first  # [T*k] this rank's numbering
    slots = ((local >= 0) & (local < count)).nonzero().squeeze(1)  # [n] ascending
    return slots, local[slots]


class ExpertMatrices(PackedWeight):
    """Packed expert matrices ``[E, out, in]``: ``expert(e)`` is expert e's weight [out, in] in the
    model dtype, expanded by the function the dense loader uses (packed and dense: the same bits)."""

    num_experts: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_experts, self.out_features, self.in_features))

    def expert(self, e: int) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class ExpertStack(ExpertMatrices):
    """E experts each kept as its own packed layer (compressed-tensors integer weights, ``CTLinear``:
    what llm-compressor writes for ``experts.{e}.gate_proj`` and the others)."""

    def __init__(self, layers: list[PackedWeight]) -> None:
        nn.Module.__init__(self)
        self.layers = nn.ModuleList(layers)
        self.num_experts = len(layers)
        self.out_features, self.in_features = layers[0].out_features, layers[0].in_features
        self.compute_dtype = torch.float32
        if any((m.out_features, m.in_features) != (self.out_features, self.in_features) for m in layers):
            raise LogprobeError("model", "the experts of one matrix have different shapes")

    def expert(self, e: int) -> torch.Tensor:
        return self.layers[e].rows(slice(None)).to(self.compute_dtype)

    def rows(self, idx=slice(None)) -> torch.Tensor:
        return torch.cat([m.rows(slice(None)) for m in self.layers])[idx]  # [E*out, in] rows

    def extra_repr(self) -> str:
        return f"{type(self.layers[0]).__name__} x {self.num_experts}, in={self.in_features}, out={self.out_features}"


class PackedExperts(ExpertMatrices):
    """GGUF-quantized expert matrices ``[E, out, in]`` kept as blocks: buffers ``d`` [E, out, nb],
    ``qs`` [E, out, nb, bytes], ``m`` (Q4_1's minimum, Q4_K's dmin) or None. ``expert(e)`` expands
    one expert with the function the dense loader uses (``kernels.gguf_quants``), so packed and
    dense experts give the same bits. ``rows(idx)`` reads the experts' rows flattened [E*out, in]."""

    def __init__(self, qtype: str, d: torch.Tensor, qs: torch.Tensor, m: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)
        self.qtype = qtype
        self.num_experts, self.out_features, nb = d.shape
        self.in_features = nb * block_values(qtype)
        self.compute_dtype = torch.float32
        self.register_buffer("d", d)
        self.register_buffer("qs", qs)
        self.register_buffer("m", m)

    def expert(self, e: int) -> torch.Tensor:
        """Expert e's weight, float32 [out, in] expanded, then the model dtype."""
        w = dequantize_blocks(self.qtype, self.d[e], self.qs[e], None if self.m is None else self.m[e])
        return w.to(self.compute_dtype)

    def rows(self, idx=slice(None)) -> torch.Tensor:
        def flat(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, *t.shape[2:])  # [E, out, ...] -> [E*out, ...]
        return dequantize_blocks(self.qtype, flat(self.d)[idx], flat(self.qs)[idx],
                                 None if self.m is None else flat(self.m)[idx])

    def extra_repr(self) -> str:
        return f"{self.qtype}, experts={self.num_experts}, in={self.in_features}, out={self.out_features}"


class ExpertsAcrossRanks:
    """The half of ``Experts`` that spans ranks: which slots this rank computes (its experts, or a
    placement's dispatch) and what crosses the ranks, in each mode: every slot whole
    (``parallel_forward``), one summed [T, H] (``combined``), or, under data-parallel attention,
    each rank's own rows gathered and summed back (``split_steps``). It reads what
    ``Experts.__init__`` sets (``ctx``, ``placement``, ``first_expert``, ``num_experts``,
    ``hidden_rows``, ``leaves``, ...) and computes through ``Experts.local`` and
    ``Experts.fused``; one process never calls it. Under data-parallel attention:
    ``ExpertsOverSplitRows``."""

    def placed_local(self, ids: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Under a placement: each slot's expert of ``ids`` [T, k] numbered among this rank's held
        experts where the dispatch rule gives the slot to this rank (``placement.slot_ranks``, row
        t being row ``first_row + t`` of the rows every rank sees), else -1 (pad slots too)."""
        table, count, where = self.tables(ids.device)
        mine = slot_ranks(ids, table, count, first_row) == self.ctx.rank  # [T, k]
        return torch.where(mine, where[ids.clamp(min=0)], -1)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The placement's holders [E, n] and counts [E] (``Placement.tables``) and each expert's
        index among this rank's held experts [E] (-1: not held), made on ``device`` once."""
        if device not in self.dispatch:
            where = torch.tensor(self.placement.local_index(self.ctx.rank), device=device)
            self.dispatch[device] = (*self.placement.tables(device), where)
        return self.dispatch[device]

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Each slot's expert of ``ids`` [T, k] in this rank's numbering, outside 0 ..
        num_experts - 1 where another rank computes it (``fused_moe`` gives those no tile)."""
        return ids - self.first_expert if self.placement is None else self.placed_local(ids)

    def my_slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots of ``ids`` [T, k] this rank computes: flat indices [n] (ascending) and their
        experts in this rank's numbering [n] (``local_slots``; under a placement its dispatch)."""
        if self.placement is None:
            return local_slots(ids, self.first_expert, self.num_experts)
        local = self.placed_local(ids).reshape(-1)  # [T*k]
        slots = (local >= 0).nonzero().squeeze(1)  # [n] ascending
        return slots, local[slots]

    def leaf_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Each slot's leaf of the combine tree [T, k], numbered from this rank's first leaf; -1 for
        an expert not held here (another rank's, a pad row's -1).

        >>> Experts(8, 4, 4, ParallelContext(1, 2, experts=2)).leaf_of(torch.tensor([[5, 1], [-1, 4]])).tolist()
        [[1, -1], [-1, 0]]
        """
        local = ids - self.first_expert
        own = (local >= 0) & (local < self.own_experts)
        return torch.where(own, local // (self.total_experts // self.leaves), -1)

    @property
    def tree_split(self) -> bool:
        """Whether each rank holds whole leaves of the combine tree (whole experts, the group's
        size dividing the leaves): then deterministic mode sums subtrees over the ranks, each
        slot computed by its expert's owner. Replicas (``placement``) then serve default mode
        only: a slot a replica computed belongs to another rank's leaf, and sending such slots
        whole instead (``return_slots``) cost 28% at two GPUs (docs/perf.md)."""
        return self.ctx.expert_share[1] == 1 and self.leaves % self.ctx.size == 0

    def combine_whole(self, y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
                      ) -> torch.Tensor:
        """Deterministic mode's combine of every slot y [T, k, H] (all experts' ids [T, k]) -> [T, H]."""
        leaf = ids // (self.total_experts // self.leaves)
        return combine_tree_to(y, weights, leaf, self.leaves, dtype)

    def parallel_forward(self, x: torch.Tensor, ids: torch.Tensor, row_tile: int | None, triton: bool
                         ) -> torch.Tensor:
        """Every rank: x [T, H] and the same ids [T, k] -> y [T, k, H], each slot's output whole.

        A rank computes the slots routed to its experts (its columns of them: ``hidden_rows``)
        into a [T*k, H] buffer of -0.0 and the buffers are summed over the ranks. Each entry is
        non-zero on one rank only, and -0.0 is addition's exact identity (x + -0.0 = x for every
        x, +0.0 and -0.0 included; +0.0 would turn a -0.0 output into +0.0), so the sum is that
        rank's bits whatever the reduction order. Worked example, E = 4, k = 2, EP = 2 (rank 0:
        experts 0, 1; rank 1: experts 2, 3), ids = [[2, 0], [0, 3]]:

            rank 0 computes slots 1 (t0, e0), 2 (t1, e0);  rank 1 slots 0 (t0, e2), 3 (t1, e3)
            buffer rank 0: [-0, y1, y2, -0];  rank 1: [y0, -0, -0, y3];  sum: [y0, y1, y2, y3]

        Each slot's row is the product one process computes (the same rows of the same expert, in
        fixed row tiles and column blocks in deterministic mode), and every rank then combines the
        k slots in slot order (``combine``), so the output has one process's bits."""
        T, k = ids.shape
        _, P = self.ctx.expert_share
        if P > 1 and x.is_cuda and self.numerics.column_blocks:
            raise LogprobeError("expert_parallel_size", f"deterministic mode on CUDA keeps its bits across sizes "
                                f"with whole experts per rank; {P} ranks share each expert here",
                                "use expert_parallel_size = tensor_parallel_size")
        if P == 1:
            y = self.slot_buffer(x, ids, T, row_tile, triton)  # [T*k, H]
        else:
            slots, lid = self.my_slots(ids)  # [n], [n]
            h0, h1 = self.hidden_rows
            y = x.new_full((T * k, self.hidden), -0.0)  # [T*k, H]: -0.0, the exact identity of the sum
            y[slots, h0:h1] = self.shared_rows(x, slots // k, lid, T * k, slots, row_tile, triton)
        return self.ctx.all_reduce_sum(y).view(T, k, self.hidden)  # [T, k, H]

    def slot_buffer(self, x: torch.Tensor, ids: torch.Tensor, rows: int, row_tile: int | None,
                    triton: bool) -> torch.Tensor:
        """Whole experts per rank: [rows * k, H] (rows >= T) of -0.0, the exact identity of a sum
        over ranks, holding the outputs of the slots this rank computes (``my_slots``) at their
        slot rows t*k + j."""
        k = ids.shape[1]
        slots, lid = self.my_slots(ids)  # [n], [n]
        y = x.new_full((rows * k, self.hidden), -0.0)
        if slots.numel():
            y[slots] = self.local(x[slots // k], lid[:, None], row_tile, triton).view(-1, self.hidden)
        return y

    def combined(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, row_tile: int | None = None,
                 triton: bool = True) -> torch.Tensor:
        """Default mode over ranks: x [T, H], the same ids [T, k] and weights [T, k] float32 on
        every rank -> the routed output [T, H] in x's dtype on every rank (what ``combine_to``
        gives one process, summed in another order). A rank computes its slots (as
        ``parallel_forward``: its whole experts, or its ``hidden_rows`` columns of them with P > 1),
        combines them at once into a float32 [T, H] partial (zero where it computed nothing) and
        the partials are summed over the ranks (``ParallelContext.sum_rows``: float32, rounded
        once). Worked example, E = 4, k = 2, EP = 2, ids = [[2, 0], [0, 3]]:

            rank 0 (e0, e1): partial [w01 y1, w10 y2];  rank 1 (e2, e3): [w00 y0, w11 y3]
            sum over ranks: [w01 y1 + w00 y0, w10 y2 + w11 y3]   (one process: w00 y0 + w01 y1, ...)

        The traffic is one [T, H] sum instead of ``parallel_forward``'s [T*k, H] (k times less
        rows); the bits are not those of one process (the order of the sum moves with the ranks):
        deterministic mode keeps ``parallel_forward``."""
        T, k = ids.shape
        slots, lid = self.my_slots(ids)  # [n], [n]
        w = weights.float().reshape(-1)[slots]  # [n]: each computed slot's router weight
        rows = -(-T // self.ctx.size) * self.ctx.size  # T padded to whole row blocks (zero rows)
        _, P = self.ctx.expert_share
        if P == 1:
            ys = x.new_empty(0, self.hidden)  # [n, H]
            if slots.numel():
                ys = self.local(x[slots // k], lid[:, None], row_tile, triton).view(-1, self.hidden)
            partial = combine_partial(ys, w, slots, k, rows, triton)  # [rows, H] float32
        else:
            h0, h1 = self.hidden_rows
            ys = self.shared_rows(x, slots // k, lid, T * k, slots, row_tile, triton)  # [n, H/P]
            partial = x.new_zeros(rows, self.hidden, dtype=torch.float32)  # [rows, H]: its columns only
            partial[:, h0:h1] = combine_partial(ys, w, slots, k, rows, triton)
        return self.ctx.sum_rows(partial, x.dtype)[:T]  # [T, H]

    def computing_rank(self, ids: torch.Tensor, first_row: int) -> torch.Tensor:
        """The rank computing each slot of ``ids`` [T, k] (rows ``first_row`` .. of the gathered
        batch; whole experts per rank): its expert's owner, or the placement's pick; -1 for pads."""
        if self.placement is None:
            return torch.where(ids >= 0, ids // (self.total_experts // self.ctx.size), -1)
        table, count, _ = self.tables(ids.device)
        return slot_ranks(ids, table, count, first_row)

    def shared_rows(self, x: torch.Tensor, tokens: torch.Tensor, lid: torch.Tensor, n_slots: int,
                    slots: torch.Tensor, row_tile: int | None, triton: bool = True) -> torch.Tensor:
        """Experts split P ways within a group: this rank's intermediate columns of its slots, the
        group's columns gathered (copies: the whole intermediate row, in order), then its
        ``hidden_rows`` outputs over the whole intermediate -> [n, H / P]. Without row tiles (default
        mode) on CUDA: the fused kernel's two halves (``fused_shared_rows``); else one product per
        expert segment."""
        if row_tile is None and triton and (x.is_cuda or interpreting()) and triton_available() \
                and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
            mats = self.dense_stacks(x.dtype)
            if mats is not None:
                return self.fused_shared_rows(x, slots, lid, n_slots, *mats)
        order, counts = sort_by_expert(lid[:, None], self.num_experts)
        xs = x[tokens[order]]  # [n, H] sorted by expert
        i0, i1 = self.inter_rows
        act = x.new_zeros(n_slots, i1 - i0)  # [T*k, I/P]: rows of other slots stay zero (never read)
        start, segments = 0, []
        for e, m in enumerate(counts):
            if m:
                seg = xs[start:start + m]
                act[slots[order[start:start + m]]] = silu_mul(self.lin(seg, "gate_proj", e, row_tile),
                                                               self.lin(seg, "up_proj", e, row_tile))
                segments.append((e, start, m))
            start += m
        whole = self.group_columns(act, slots[order])  # [n, I] sorted by expert
        out = x.new_empty(len(order), self.hidden_rows[1] - self.hidden_rows[0])  # [n, H/P]
        for e, start, m in segments:
            out[start:start + m] = self.lin(whole[start:start + m], "down_proj", e, row_tile)
        result = torch.empty_like(out)
        result[order] = out  # back to the order of ``slots``
        return result

    def group_columns(self, act: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """act [T*k, I/P] (this rank's intermediate columns, by slot) -> [len(rows), I]: the whole
        intermediate rows of slots ``rows``, the group's P shares side by side (a copy)."""
        _, P = self.ctx.expert_share
        g = self.ctx.expert_group
        every = self.ctx.all_gather(act)[g * P:(g + 1) * P]  # [P, T*k, I/P]: the group's shares
        return every[:, rows].permute(1, 0, 2).reshape(len(rows), -1)  # [n, I]

    def fused_shared_rows(self, x: torch.Tensor, slots: torch.Tensor, lid: torch.Tensor, n_slots: int,
                          gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """``shared_rows`` through the fused kernel's halves: ``moe_gate_up`` on this rank's
        intermediate columns (rows read straight from x, written by slot into [T*k, I/P]), the
        group's columns gathered, ``moe_down`` on its output rows over the whole intermediate,
        compact in the order of ``slots`` -> [n, H/P]. The tiles of both halves are this rank's
        slots by expert (``align_by_expert`` of their experts: positions 0 .. n - 1, n the pad)."""
        c = default_config(x.dtype)
        k = n_slots // max(x.shape[0], 1)  # n_slots = T * k
        pos, tile_expert = align_by_expert(lid[:, None], self.num_experts, c.block_m)  # [Pd], [Pd / block_m]
        by_slot = torch.cat([slots, slots.new_full((1,), n_slots)]).to(torch.int32)[pos.long()]  # [Pd]: pad n_slots
        act = moe_gate_up(x, by_slot, tile_expert, n_slots, k, gate, up, c)  # [T*k, I/P]: other slots unwritten
        return moe_down(self.group_columns(act, slots), pos, tile_expert, down, c)  # [n, I] -> [n, H/P]


class ExpertsOverSplitRows:
    """The data-parallel-attention half of ``Experts`` (whole experts per rank; ``layers.steps``):
    each rank holds its own rows of the batch (``parallel.rows.RowSplit``), gathers every rank's,
    computes its experts' slots of all of them and sends each row's sum (default mode) or its
    subtree's (deterministic mode) back to the rank that owns the row. It computes through
    ``ExpertsAcrossRanks`` (``my_slots``, ``local_ids``, ``leaf_of``, ``combine_whole``) and the
    experts' own ``local``, ``fused`` and ``fused_runs``: ``Experts``'s, or gpt-oss's
    (``layers.moe_gpt_oss.GptOssExperts``, its biased experts in its own kernel)."""

    def split_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, rows: RowSplit,
                      deterministic: bool, row_tile: int | None, triton: bool = True) -> torch.Tensor:
        """``split_steps`` run to its end, the layer's rows in parts where they are many."""
        return drive(self.split_steps(x, ids, weights, rows, deterministic, row_tile, triton, self.MAX_PARTS))

    def split_steps(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, rows: RowSplit,
                    deterministic: bool, row_tile: int | None, triton: bool = True, max_parts: int = 1):
        """Data-parallel attention (whole experts per rank): x [T, H], ids [T, k] and weights [T, k]
        of this rank's own rows (``rows.own``) -> the routed output [T, H] of those rows in x's dtype.

        Every rank's x, ids and weights are gathered (each padded to ``rows.max_rows`` = m; padded
        ids are -1, no expert's), the rank computes its experts' slots of all P * m rows, then

        * default mode: combines them at once into a float32 [P * m, H] partial and the partials
          are reduce-scattered: rank r receives the sum over ranks of its own rows, rounded once;
        * deterministic mode: sends each computed slot whole to the rank owning its row
          (``return_slots``: an all-to-all of copies), which combines its rows' k slots in slot
          order (``combine_to``): one process's bits at every size.

        Worked example, P = 2, E = 4 (rank 0: experts 0, 1; rank 1: 2, 3), k = 1, rank 0 owns token
        a routed to e3, rank 1 tokens b, c routed to e0, e2 (m = 2; rank 0's pad row p):

            gathered rows [a, p | b, c]:  rank 0 computes slot of b (e0), rank 1 those of a, c
            default: partials reduce-scattered, rank 0 receives row a's sum, rank 1 rows b, c
            deterministic: rank 0 sends y_b to rank 1; rank 1 sends y_a to rank 0, keeps y_c

        Traffic per layer and rank: the gather of (P - 1) m rows of x (and m x 2k float32 of
        routing), then a reduce-scatter of (P - 1) m rows of H float32 (default) or the slots it
        computed for other ranks' rows, about (P - 1) / P of m k rows of H (deterministic;
        ``tree_split`` models send subtrees' float32 sums instead, as default mode does).

        A generator (``layers.steps``): it yields after starting the gathers and after starting
        the sums, so that another micro-batch's work is launched beside them; it returns the
        output. ``max_parts``: the rows in up to this many parts (``owned_steps``)."""
        T, k = ids.shape
        _, P = self.ctx.expert_share
        if P != 1:
            raise LogprobeError("attention_parallel", "data-parallel attention needs whole experts per rank, "
                                f"each expert is split {P} ways here", "use expert_parallel_size = tensor_parallel_size")
        m, size = rows.max_rows, self.ctx.size
        routing = rows.pad(torch.cat([ids.float(), weights.float()], 1), -1.0)  # [m, 2k]: ids exact in float32
        tree = deterministic and self.tree_split  # subtrees summed over the ranks: one process's bits
        if tree or not deterministic and self.fused_runs(x, triton, interpreted=True):
            out = yield from self.owned_steps(rows.pad(x), routing, triton, row_tile, tree, max_parts)
            return out[:T].to(x.dtype)  # [T, H]
        xs = self.ctx.all_gather(rows.pad(x)).view(size * m, self.hidden)  # [P*m, H]: every rank's rows
        routing = self.ctx.all_gather(routing).view(size * m, 2 * k)  # [P*m, 2k]
        every_ids = routing[:, :k].long()  # [P*m, k]; -1 on pad rows
        slots, lid = self.my_slots(every_ids)  # [n], [n]
        ys = x.new_empty(0, self.hidden)  # [n, H]
        if slots.numel():
            ys = self.local(xs[slots // k], lid[:, None], row_tile, triton).view(-1, self.hidden)
        if not deterministic:
            w = routing[:, k:].reshape(-1)[slots]  # [n]: each computed slot's router weight
            partial = combine_partial(ys, w, slots, k, size * m, triton)  # [P*m, H] float32
            return self.ctx.reduce_scatter_sum(partial)[:T].to(x.dtype)  # [T, H]: own rows, rounded once
        own = self.return_slots(ys, slots, every_ids, m).view(m, k, self.hidden)[:T]  # [T, k, H], whole
        return self.combine_whole(own, ids, weights, x.dtype)

    OVERLAP_ROWS = 2048  # own rows (padded) a part needs at least: the layer's transfers run beside compute
    MAX_PARTS = 2  # four measured no faster on two H100s (1.48x vs 1.49x; their transfers slowed beside compute)

    def owned_in_parts(self, x: torch.Tensor, routing: torch.Tensor, triton: bool, row_tile: int | None = None,
                       tree: bool = False) -> torch.Tensor:
        """``owned_steps`` run to its end, in up to ``MAX_PARTS`` parts."""
        return drive(self.owned_steps(x, routing, triton, row_tile, tree, self.MAX_PARTS))

    def owned_steps(self, x: torch.Tensor, routing: torch.Tensor, triton: bool, row_tile: int | None = None,
                    tree: bool = False, max_parts: int = 1):
        """``split_forward`` through partials summed over the ranks: this rank's padded rows x
        [m, H] and their routing [m, 2k] (ids as float32, then weights) -> float32 [m, H], each
        row the sum over ranks of its experts' slots, rounded once by the caller. Default mode:
        ``owned_partial`` (slot order) and the backend's reduce-scatter; ``tree`` (deterministic
        mode): ``leaf_partial`` (this rank's subtree) and ``tree_reduce_scatter_start``, the
        one-process tree of ``combine_tree``. A generator: it yields once every gather has
        started and once every sum has (``layers.steps``).

        The rows go in parts of at least ``OVERLAP_ROWS`` (at most ``max_parts``), so that the
        transfers run beside the experts: every gather is started first, then part i's experts
        run while the rows of part i + 1 arrive and the sums of part i - 1 are reduce-scattered;
        only the first part's gather and the last part's reduce-scatter wait alone (unless
        another micro-batch's work runs beside them). A row's numbers are those of its part (its
        slots, its float32 sum over ranks): the parts change which rows travel together, not what
        is added. Worked example, P = 2, m = 4, two parts: part 0 = own rows 0-1 of both ranks (4
        gathered rows), part 1 = rows 2-3; rank 0 receives the sums of its rows 0-1, then of 2-3."""
        m, k = x.shape[0], routing.shape[1] // 2
        n = max(1, min(max_parts, m // self.OVERLAP_ROWS))
        cuts = [i * m // n for i in range(n + 1)]
        started = [(self.ctx.all_gather_start(x[a:b]), self.ctx.all_gather_start(routing[a:b]))
                   for a, b in zip(cuts, cuts[1:])]
        yield
        out = x.new_empty(m, self.hidden, dtype=torch.float32)  # [m, H]: own rows, part after part
        sums = []
        for (gx, gr), a, b in zip(started, cuts, cuts[1:]):
            xs, r = gx.wait(), gr.wait()  # [P, n, H], [P, n, 2k]
            xs, r = xs.reshape(-1, self.hidden), r.reshape(-1, 2 * k)  # [P*n, H], [P*n, 2k]
            if tree:
                partial = self.leaf_partial(xs, r[:, :k].long(), r[:, k:], row_tile, triton)  # [P*n, H] float32
                sums.append(self.ctx.tree_reduce_scatter_start(partial, out[a:b]))
            else:
                partial = self.owned_partial(xs, r[:, :k].long(), r[:, k:], triton)  # [P*n, H] float32
                sums.append(self.ctx.reduce_scatter_start(partial, out[a:b]))
        yield
        for s in sums:
            s.wait()
        return out

    def leaf_partial(self, xs: torch.Tensor, every_ids: torch.Tensor, weights: torch.Tensor, row_tile: int | None,
                     triton: bool) -> torch.Tensor:
        """Deterministic mode's float32 partial [P*m, H] of this rank's subtree (``combine_tree``
        over its leaves) from the gathered rows xs [P*m, H] (rank blocks in rank order), their
        expert ids [P*m, k] and float32 weights [P*m, k], each rank block written at its
        ``tree_positions`` place. The slots of the experts held here are computed as one process
        computes them: the fused kernel (fixed tiles) where it runs, else ``local`` (fixed row
        tiles), the other slots never read."""
        R, k = every_ids.shape
        leaf = self.leaf_of(every_ids)  # [P*m, k]
        # this rank's own experts in its numbering (replicas, stacked after them, get no slot)
        local = torch.where(leaf >= 0, every_ids - self.first_expert, -1)  # [P*m, k]
        if self.fused_runs(xs, triton):  # CUDA (one process uses it there too)
            y = self.fused(xs, local, foreign=True)  # [P*m*k, H]: the slots of the experts held here
        else:  # the PyTorch path (CPU): its compaction waits for the values, as every CPU op does
            y = xs.new_zeros(R * k, self.hidden)
            slots = (leaf.reshape(-1) >= 0).nonzero().squeeze(1)  # [n]
            if slots.numel():
                y[slots] = self.local(xs[slots // k], local.reshape(-1)[slots][:, None], row_tile,
                                      triton).view(-1, self.hidden)
        positions = tree_positions(self.ctx.size) if self.ctx.size > 2 else None
        return combine_tree_to(y, weights.float(), leaf, self.leaves // self.ctx.size, torch.float32, positions)

    def owned_partial(self, xs: torch.Tensor, every_ids: torch.Tensor, weights: torch.Tensor, triton: bool
                      ) -> torch.Tensor | None:
        """Default mode's float32 partial [P*m, H] of this rank's experts from the gathered rows xs
        [P*m, H], their expert ids [P*m, k] and float32 weights [P*m, k], through the fused kernels
        on CUDA: ``fused_moe`` computes the slots of the experts held here straight from xs (ids of
        other ranks' experts and of pad rows fall outside and get no tile) and ``combine_owned``
        adds them in slot order. The bits of ``local_slots`` -> ``local`` -> ``combine_partial``
        (the same tiles, the same sums), without the gathered copy of each slot's row nor the
        compaction, which would stall the host until the GPU knows how many slots are here.
        None where the fused path does not apply (CPU, packed experts it cannot expand)."""
        if not self.fused_runs(xs, triton, interpreted=True):
            return None
        local = self.local_ids(every_ids)  # [P*m, k]: this rank's numbering, others outside it
        y = self.fused(xs, local, foreign=True)  # [P*m*k, H]: the slots of the experts held here
        return combine_owned(y, weights.float(), (local >= 0) & (local < self.num_experts))

    def return_slots(self, ys: torch.Tensor, slots: torch.Tensor, every_ids: torch.Tensor, m: int) -> torch.Tensor:
        """Whole experts per rank: the outputs ys [n, H] of this rank's slots ``slots`` [n] (flat
        indices, ascending, into every rank's m rows of k slots) each sent to the rank owning its
        row -> this rank's [m * k, H] slots (rows of pad slots unwritten). Every rank knows from the
        gathered ids [P*m, k] which rank computes each slot (its expert's), so what each rank sends
        and receives is known without asking. Worked example, P = 2, E = 4, k = 2, m = 1, rank 1's
        token routed to (e2, e0): rank 0 computes its slot 1 (e0) and sends it; rank 1 keeps slot 0
        (e2), receives slot 1 from rank 0, and writes them to its slots [0 | 1] (copies: exact)."""
        size, rank, k = self.ctx.size, self.ctx.rank, every_ids.shape[1]
        send = torch.bincount(slots // (m * k), minlength=size).tolist()  # ascending: grouped by owner
        src = self.computing_rank(every_ids[rank * m:(rank + 1) * m], rank * m).reshape(-1)  # [m*k]
        src = torch.where(src >= 0, src, size)  # the rank computing each of this rank's slots, size for pads
        recv = torch.bincount(src, minlength=size + 1)[:size].tolist()
        at = torch.sort(src, stable=True).indices[:sum(recv)]  # own slots by computing rank, then ascending
        y = ys.new_empty(m * k, self.hidden)  # [m*k, H]
        y[at] = self.ctx.all_to_all(ys, send, recv)
        return y


class Experts(ExpertsOverSplitRows, ExpertsAcrossRanks, NumericsUser, nn.Module):
    """E expert MLPs: ``gate_proj``, ``up_proj`` [E, I, H] and ``down_proj`` [E, H, I], each a
    parameter or a ``PackedExperts``. ``forward(x [T, H], ids [T, k])`` -> y [T, k, H].

    ``ctx`` with several ranks (see ``ParallelContext.experts``): this rank holds experts
    ``first_expert .. first_expert + num_experts - 1`` of ``total_experts`` and, of each, rows
    ``inter_rows`` of gate/up and ``hidden_rows`` of down (whole experts where the ranks of a group
    are one, ``expert_share`` P = 1); ``forward`` returns every slot's output on every rank
    (``parallel_forward``). ``ctx.placement`` (``parallel.placement``; whole experts per rank): the
    rank holds ``expert_ids``, its own experts then replicas of other ranks' hot ones (stacked in
    that order), and computes the slots the placement's dispatch rule gives it (``my_slots``)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.ctx = ctx = ctx or ParallelContext()
        self.total_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.first_expert, last = expert_range(num_experts, ctx.expert_group, ctx.experts)
        self.own_experts = last - self.first_expert
        self.placement = _check_placement(ctx, num_experts)
        self.expert_ids = (tuple(range(self.first_expert, last)) if self.placement is None
                           else self.placement.held[ctx.rank])  # own experts, then replicas
        self.num_experts = len(self.expert_ids)  # experts stacked here
        self.dispatch: dict = {}  # device -> the placement's tables (``placed_local``)
        p, P = ctx.expert_share
        self.inter_rows, self.hidden_rows = shard_range(intermediate, p, P), shard_range(hidden, p, P)
        n_i, n_h = self.inter_rows[1] - self.inter_rows[0], self.hidden_rows[1] - self.hidden_rows[0]
        for name, shape in zip(EXPERT_PROJS, [(n_i, hidden)] * 2 + [(n_h, intermediate)]):
            setattr(self, name, nn.Parameter(torch.empty(self.num_experts, *shape), requires_grad=False))
        # deterministic mode's column blocks (as the dense layers': the whole width / S), so a
        # column's product has one shape whether its rank holds the whole expert or a share
        self.leaves = tree_leaves(num_experts)  # deterministic mode's combine tree (``combine_tree``)
        self.col_blocks = {"gate_proj": _expert_blocks(intermediate, ctx.blocks, n_i),
                           "up_proj": _expert_blocks(intermediate, ctx.blocks, n_i),
                           "down_proj": _expert_blocks(hidden, ctx.blocks, n_h)}

    def held(self, name: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """(experts [start, end), rows [start, end) of each expert's ``name`` matrix) this rank holds.

        >>> Experts(4, 8, 6, ParallelContext(3, 4, blocks=2, experts=2)).held("down_proj")
        ((2, 4), (4, 8))
        """
        rows = self.hidden_rows if name == "down_proj" else self.inter_rows
        return (self.first_expert, self.first_expert + self.own_experts), rows

    def set_packed(self, name: str, packed: ExpertMatrices) -> None:
        """Replace one of the three parameters by packed blocks (at load)."""
        want = getattr(self, name).shape
        if tuple(packed.shape) != tuple(want):
            raise LogprobeError("model", f"expert tensor {name} has shape {tuple(packed.shape)}, the config "
                                f"implies {tuple(want)}")
        del self._parameters[name]
        setattr(self, name, packed)

    def weight(self, name: str, e: int) -> torch.Tensor:
        w = getattr(self, name)
        return w.expert(e) if isinstance(w, ExpertMatrices) else w[e]

    @property
    def packed(self) -> bool:
        return any(isinstance(getattr(self, n), ExpertMatrices) for n in EXPERT_PROJS)

    def lin(self, a: torch.Tensor, name: str, e: int, row_tile: int | None) -> torch.Tensor:
        """a [n, in] times expert e's ``name`` matrix (held rows) -> [n, out]: one product, or
        deterministic mode's fixed row tiles (and column blocks)."""
        w = self.weight(name, e)
        if row_tile is None:
            return F.linear(a, w)
        return tiled_linear(a, w, None, row_tile, self.col_blocks[name] if self.numerics.column_blocks else None)

    def expert_mlp(self, e: int, x: torch.Tensor, row_tile: int | None) -> torch.Tensor:
        """Expert e on rows x [n, H] -> [n, H]; ``row_tile``: fixed row tiles (deterministic mode)."""
        act = silu_mul(self.lin(x, "gate_proj", e, row_tile), self.lin(x, "up_proj", e, row_tile))  # [n, I]
        return self.lin(act, "down_proj", e, row_tile)  # silu_mul is row-invariant on CPU too

    def forward(self, x: torch.Tensor, ids: torch.Tensor, row_tile: int | None = None,
                triton: bool = True) -> torch.Tensor:
        if self.ctx.parallel:
            return self.parallel_forward(x, ids, row_tile, triton)
        return self.local(x, ids, row_tile, triton)

    def local(self, x: torch.Tensor, ids: torch.Tensor, row_tile: int | None, triton: bool) -> torch.Tensor:
        """Whole experts held here, ``ids`` [T, k] numbered 0 .. num_experts - 1 -> [T, k, H]."""
        T, k = ids.shape
        if self.fused_runs(x, triton):
            return self.fused(x, ids).view(T, k, self.hidden)  # [T*k, H] -> [T, k, H]
        return self.reference(x, ids, row_tile)

    def fused_runs(self, x: torch.Tensor, triton: bool, interpreted: bool = False) -> bool:
        """Whether ``fused`` runs on activations like ``x`` (``kernel_runs``), with experts that
        are parameters or packed ones that expand (``stacked``)."""
        return kernel_runs(x, triton, interpreted) and self.expands

    STACK_BYTES = 4 << 30  # packed experts expanded for the fused kernel this much at a time

    def fused(self, x: torch.Tensor, ids: torch.Tensor, foreign: bool = False) -> torch.Tensor:
        """``fused_moe`` over the experts held here: x [T, H], ids [T, k] in this rank's numbering
        (outside 0 .. num_experts - 1: no tile) -> y [T*k, H]. Packed experts (FP8 blocks) are
        expanded ``stack_chunks`` at a time, each part of the experts computing its slots into one
        buffer: a slot's row is its expert's product in the kernel's fixed tiles whatever else
        runs, so the parts change no bit (the same as one expansion, and as a rank holding fewer
        experts). DeepSeek-V3's 256 FP8 experts expand to 22.5 GB a layer in bf16: six parts of
        43 experts, where the layer had fallen back to one product per expert."""
        chunks = self.stack_chunks(x.dtype)
        if len(chunks) == 1:
            return fused_moe(x, ids, *self.stacks(x.dtype), foreign=foreign)
        y = x.new_empty(ids.numel(), self.hidden)  # [T*k, H]: every held expert's slots written below
        for first, last in chunks:
            fused_moe(x, ids - first, *self.stacks(x.dtype, first, last), foreign=True, out=y)
        return y

    def packed_mats(self) -> list:
        return [m for m in (getattr(self, n) for n in EXPERT_PROJS) if isinstance(m, ExpertMatrices)]

    @property
    def expands(self) -> bool:
        """Whether every matrix is a parameter or packed blocks that expand (``stacked``)."""
        return all(hasattr(m, "stacked") for m in self.packed_mats())

    def stack_chunks(self, dtype: torch.dtype) -> list[tuple[int, int]]:
        """The held experts in runs whose packed matrices expand to at most ``STACK_BYTES`` (at
        least one expert a run); one run for experts held as parameters.

        >>> e = Experts(8, 4, 4); e.STACK_BYTES = 100; e.stack_chunks(torch.float32)
        [(0, 8)]
        """
        per_expert = sum(m.out_features * m.in_features for m in self.packed_mats()) * dtype.itemsize
        return expert_runs(self.num_experts, per_expert, self.STACK_BYTES)

    def stacks(self, dtype: torch.dtype, first: int = 0, last: int | None = None) -> list[torch.Tensor]:
        """The three [n, out, in] matrices of experts ``first`` .. ``last - 1`` for ``fused_moe``:
        views of the parameters, or packed ones expanded in ``dtype`` (each expert bitwise its
        ``expert(e)``)."""
        return [m.stacked(dtype, first, last) if isinstance(m, ExpertMatrices) else m[first:last]
                for m in (getattr(self, n) for n in EXPERT_PROJS)]

    def dense_stacks(self, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """``stacks`` of every held expert where they expand within ``STACK_BYTES`` at once (experts
        split across ranks, ``fused_shared_rows``), else None: the per-expert reference path."""
        if len(self.stack_chunks(dtype)) > 1 or not self.expands:
            return None
        return self.stacks(dtype)

    def reference(self, x: torch.Tensor, ids: torch.Tensor, row_tile: int | None = None) -> torch.Tensor:
        """The PyTorch path (``by_expert``) -> [T, k, H]."""
        return by_expert(x, ids, self.num_experts, self.hidden, lambda e, rows: self.expert_mlp(e, rows, row_tile))


def _check_placement(ctx: ParallelContext, num_experts: int) -> Placement | None:
    """``ctx.placement`` where it applies: whole experts per rank, one expert count, one rank count."""
    placement = ctx.placement
    if placement is None:
        return None
    if ctx.experts != ctx.size or ctx.size < 2:
        raise LogprobeError("redundant_experts", f"replicas of experts need whole experts per rank; "
                            f"expert_parallel_size {ctx.experts} of {ctx.size} ranks",
                            "use expert_parallel_size = tensor_parallel_size > 1, or redundant_experts 0")
    if placement.experts != num_experts or placement.ranks != ctx.size:
        raise LogprobeError("expert_loads", f"a placement of {placement.experts} experts over {placement.ranks} "
                            f"ranks for a layer of {num_experts} over {ctx.size}", "give one load per expert")
    return placement


def _expert_blocks(total: int, blocks: int, held: int) -> list[int] | None:
    """Column blocks of an expert matrix ``total`` rows wide in the checkpoint, ``held`` of them
    here: total / S each where that divides (``parallel_linear.column_block``), else one block."""
    width = column_block(total, blocks)
    return [width] * (held // width) if width and width < held and held % width == 0 else None


class MoeBlock(NumericsUser, nn.Module):
    """Router + experts (+ an optional gated shared expert), in place of a dense MLP.

    ``forward(x [T, H], hooks)`` -> [T, H] (the block's ``mlp_out``); the router probabilities
    [T, E] are offered to ``hooks`` at ``router_point`` (capture only). The experts run under the
    block's ``numerics``: fixed row tiles in deterministic mode, the fused Triton kernel on CUDA
    unless ``numerics.triton`` is off. Over several ranks, deterministic mode gathers every slot
    whole on every rank (``Experts.parallel_forward``, one process's bits); default mode sums
    the ranks' combined slots once (``Experts.combined``, a [T, H] float32 sum). Under
    data-parallel attention (``rows``: x holds this rank's rows only) the ranks' rows are gathered
    and each rank gets its own rows' outputs back (``Experts.split_forward``). In every path the
    routed sum is rounded to x's dtype before the shared expert is added, as in one process."""

    def __init__(self, spec: MoeSpec, hidden: int, router_point: str, shared: nn.Module | None = None,
                 ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = spec.top_k, spec.norm_topk_prob
        self.spec = spec
        self.router_point = router_point
        self.gate = Linear(hidden, spec.num_experts)  # the router, [E, H] (float32 for "sigmoid_grouped")
        self.experts = Experts(spec.num_experts, hidden, spec.intermediate_size, ctx)  # router and gates: whole
        self.shared_expert = shared
        self.grouped = spec.router == "sigmoid_grouped"
        # DeepSeek-V3: the score-correction bias [E] (float32, chooses experts only); its shared expert is ungated
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(spec.num_experts), requires_grad=False)
                                        if self.grouped else None)
        self.shared_expert_gate = Linear(hidden, 1) if shared is not None and not self.grouped else None

    def fuse(self) -> None:
        if self.shared_expert is not None:
            self.shared_expert.fuse()

    def reweigh(self, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weights [T, k] of experts ``ids`` [T, k] given by the caller (a replayed routing),
        from the router's own probabilities [T, E] (grouped: the sigmoid scores), normalised as
        the router normalises its own choice: for ids the router chose, bitwise its weights."""
        weights = probs.gather(1, ids)  # [T, k]: what topk returns for the router's own ids
        if getattr(self, "grouped", False):
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return weights * self.spec.routed_scaling_factor
        return weights / weights.sum(dim=-1, keepdim=True) if self.norm_topk_prob else weights

    def forward(self, x: torch.Tensor, hooks=None, rows: RowSplit | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. ``rows``: x is this rank's share of a batch split by sequences over
        the ranks (data-parallel attention, ``Experts.split_forward``); no hooks then."""
        if rows is not None and self.experts.ctx.parallel:  # own rows routed; every rank's gathered
            return drive(self.steps(x, rows, self.experts.MAX_PARTS))
        probs, weights, ids = self.route_tokens(x)  # [T, E], [T, k], [T, k]
        if hooks is not None:
            hooks(self.router_point, probs)
            forced = hooks.routing(self.router_point, ids, lambda forced_ids: self.reweigh(probs, forced_ids))
            if forced is not None:  # replayed experts (``layers.hooks.RouteTable``)
                weights, ids = forced
        shared = self.shared_out(x)
        if self.experts.ctx.parallel and not self.numerics.deterministic:
            # default mode over ranks: each rank's slots combined there, one [T, H] sum over ranks
            out = self.experts.combined(x, ids, weights, self.numerics.row_tile, self.numerics.triton)  # [T, H]
        else:  # every slot whole on every rank (deterministic: one process's bits at every size)
            y = self.experts(x, ids, self.numerics.row_tile, self.numerics.triton)  # [T, k, H]
            if self.numerics.deterministic:  # the fixed tree of ``combine_tree``, as over ranks
                out = self.experts.combine_whole(y, ids, weights, x.dtype)  # [T, H]
            else:
                out = combine_to(y, weights, x.dtype)  # [T, H]
        # the shared expert after the routed sum is rounded to x's dtype, in every path as in one process
        return out if shared is None else out + shared

    def steps(self, x: torch.Tensor, rows: RowSplit, max_parts: int = 1):
        """``forward`` on this rank's rows x [n, H] of a batch split by sequences (``rows``), as a
        generator that yields where the experts' transfers run (``Experts.split_steps``,
        ``layers.steps``) -> [n, H]. The shared expert runs first, beside the gathers."""
        _, weights, ids = self.route_tokens(x)  # [n, k] each
        shared = self.shared_out(x)
        n = self.numerics
        out = yield from self.experts.split_steps(x, ids, weights, rows, n.deterministic, n.row_tile, n.triton,
                                                  max_parts)  # [n, H]
        return out if shared is None else out + shared

    def route_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> the router's probabilities [T, E] (grouped: sigmoid scores), weights [T, k]
        float32 and expert ids [T, k]."""
        if self.grouped:  # float32 router weight and input, as transformers keeps it
            s = self.spec
            return route_grouped(self.gate(x.to(self.gate.weight.dtype)), self.e_score_correction_bias,
                                 self.top_k, s.n_group, s.topk_group, self.norm_topk_prob, s.routed_scaling_factor,
                                 self.numerics.triton)
        return route(self.gate(x), self.top_k, self.norm_topk_prob, self.numerics.triton)

    def shared_out(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output [T, H] (gated: sigmoid(g . x) * shared(x)), or None."""
        if self.shared_expert is None:
            return None
        if self.shared_expert_gate is None:
            return self.shared_expert(x)
        return row_sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def row_sigmoid(g: torch.Tensor) -> torch.Tensor:
    """sigmoid of a column g [T, 1], each row's bits independent of T (``activation.row_invariant``:
    in a [T, 1] column whether a row lands in PyTorch's scalar CPU tail depends on T)."""
    return row_invariant(torch.sigmoid, g)
