"""Data-parallel attention: a packed batch's rows split by sequences over the ranks of a group.

Every rank of the group receives the same packed batch. Under data-parallel attention (mixtures of
experts with whole experts per rank, ``layers.moe``) rank r runs attention, norms and dense MLPs
on rows ``bounds[r] .. bounds[r + 1]`` only: contiguous runs cut at allowed row boundaries
(between sequences, never inside a shared prefix and the branches that read it), balanced by
token count. The engine lays out each batch's units (prefix trees, lone requests) in the order
``balanced_order`` picks, so that a cut falls near each rank's share. Pure functions of integers,
pinned by gold tables in ``tests/test_data_attention.py``.

Worked example: segments of 5, 3, 6 and 2 rows (cuts 0, 5, 8, 14, 16) over 2 ranks; the ideal cut
is at row 8 (16 / 2), which is a boundary, so rank 0 owns rows 0:8 (two sequences) and rank 1 rows
8:16. Over 4 ranks the ideal cuts are 4, 8, 12: the nearest boundaries are 5, 8 and 14:

    >>> assign_rows([0, 5, 8, 14, 16], 4)
    (0, 5, 8, 14, 16)

One sequence of 10 rows over 2 ranks: no boundary but 0 and 10, both 5 rows from the ideal cut;
the tie goes to the smaller, so rank 0 owns no rows (it still joins every collective of the
experts) and rank 1 owns them all:

    >>> RowSplit(assign_rows([0, 10], 2), rank=0).counts, RowSplit(assign_rows([0, 10], 2), rank=0).own
    ((0, 10), (0, 0))

**By cost, not count.** A rank's rows cost their dense work (each row the same) plus attention's,
which grows with the (query, key) pairs a row reads: a 2,000-token sequence's rows read 1,000
keys each on average, a 200-token one's 100. Cut by rows alone, the rank holding the long
sequences does more attention (on W1 over two GPUs: 50.7% of the rows, 52.4% of the pairs). So
the cuts and the order of units balance a cost: ``COST_SCALE`` per row plus ``pair_weight`` per
pair (``row_cost``; the model's ``pair_weight``: one pair's attention FLOPs against one row's
dense FLOPs, in ``COST_SCALE`` units, ``models.base.attention_pair_weight``). A pair weight of 0
is the row count. Sequences of 1, 1, 1 and 2 rows (1, 1, 1 and 3 pairs) over 2 ranks: by rows the
cut nearest 2.5 is 2 (a tie, the smaller), rank 1 then holding 3 rows and 5 pairs; at a pair
weight of half a row the costs up to each cut are 0, 1.5, 3, 4.5, 8, and the cut nearest 4 is 3:

    >>> cuts, w = [0, 1, 2, 3, 5], COST_SCALE // 2
    >>> costs = [row_cost(c, p, w) for c, p in zip(cuts, [0, 1, 2, 3, 6])]
    >>> assign_rows(cuts, 2), assign_rows(cuts, 2, costs)
    ((0, 2, 5), (0, 3, 5))
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

from ..errors import LogprobeError
from .context import ParallelContext

COST_SCALE = 1 << 16  # a row's cost (``row_cost``): integers, so every rank cuts alike


def pair_count(rows: int, context: int) -> int:
    """(query, key) pairs of ``rows`` causal rows that all read ``context`` keys before them.

    >>> pair_count(4, 0), pair_count(2, 4), pair_count(1, 0)
    (10, 11, 1)
    """
    return rows * context + rows * (rows + 1) // 2


def row_cost(rows: int, pairs: int, pair_weight: int) -> int:
    """The cost of ``rows`` rows reading ``pairs`` pairs: ``COST_SCALE`` a row, ``pair_weight`` a pair.

    >>> row_cost(3, 6, 0) == 3 * COST_SCALE, row_cost(3, 6, COST_SCALE // 2) == 6 * COST_SCALE
    (True, True)
    """
    return rows * COST_SCALE + pairs * pair_weight


def cut_costs(segments, cuts: list[int], pair_weight: int) -> list[int]:
    """The cost (``row_cost``) of a batch up to each of its ``cuts`` (``AttentionMeta.cuts``): every
    segment (``start``, ``end``, ``context``: the key spans before it that it reads) ending there or
    before, its rows and its pairs (``pair_count`` over its context's keys). Sliding windows are
    not counted (a window caps a long row's pairs: such rows are costed high, which only moves cuts).

    >>> from types import SimpleNamespace as Seg
    >>> segs = [Seg(start=0, end=4, context=()), Seg(start=4, end=6, context=((0, 4),)), Seg(start=6, end=9, context=())]
    >>> [c / COST_SCALE for c in cut_costs(segs, [0, 6, 9], COST_SCALE)]  # 4 + 10, 2 + 11, 3 + 6
    [0.0, 27.0, 36.0]
    """
    at, total = {0: 0}, 0
    for seg in segments:
        n = seg.end - seg.start
        total += row_cost(n, pair_count(n, sum(b - a for a, b in seg.context)), pair_weight)
        at[seg.end] = total
    return [at[c] for c in cuts]


def assign_rows(cuts: list[int], size: int, costs: list[int] | None = None) -> tuple[int, ...]:
    """Row bounds (``size + 1`` of them, from 0 to the total) of a batch whose rows may be cut only
    at ``cuts`` (ascending, first 0, last the row count): bound r (0 < r < size) is the cut whose
    cost is nearest r / size of the whole (the smaller on a tie), never before bound r - 1.
    ``costs``: the batch's cost up to each cut (ascending from 0, ``row_cost``); left out, the
    rows themselves. Rank r owns rows ``bounds[r] .. bounds[r + 1]``; equal bounds: a rank with no
    rows.

    >>> assign_rows([0, 60, 100, 160], 2), assign_rows([0, 1, 101], 2), assign_rows([0, 3], 3)
    ((0, 60, 160), (0, 1, 101), (0, 0, 3, 3))
    >>> assign_rows([0, 60, 100, 160], 2, [0, 40, 70, 130])  # the last 60 rows cost twice the first 100
    (0, 100, 160)
    """
    if size < 1 or not cuts or cuts[0] != 0 or any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise LogprobeError("rows", f"cuts must ascend from 0 and the size be >= 1, got {cuts!r} over {size}")
    at = cuts if costs is None else costs
    if len(at) != len(cuts) or at[0] != 0 or any(b < a for a, b in zip(at, at[1:])):
        raise LogprobeError("rows", f"costs must ascend from 0, one a cut, got {costs!r} for {cuts!r}")
    total = at[-1]
    bounds = [0]
    for r in range(1, size):
        i = bisect_left(at, r * total / size)  # at[i - 1] < ideal <= at[i]
        lo, hi = max(i - 1, 0), min(i, len(at) - 1)
        ideal2 = 2 * r * total  # compare 2 * size * distances: integers, no rounding
        near = lo if ideal2 - 2 * size * at[lo] <= 2 * size * at[hi] - ideal2 else hi
        bounds.append(max(cuts[near], bounds[-1]))
    bounds.append(cuts[-1])
    return tuple(bounds)


def max_share(sizes: list[int], size: int) -> int:
    """The most rows a rank owns when units of ``sizes`` rows (uncuttable, laid out in this order)
    are cut by ``assign_rows`` over ``size`` ranks.

    >>> max_share([9000, 7000, 6000, 5000], 2), max_share([9000, 5000, 6000, 7000], 2)
    (16000, 14000)
    """
    cuts = [0]
    for n in sizes:
        if n > 0:
            cuts.append(cuts[-1] + n)
    bounds = assign_rows(cuts, size)
    return max(b - a for a, b in zip(bounds, bounds[1:]))


def balanced_order(sizes: list[int], size: int) -> list[int]:
    """An order of a batch's units (``sizes`` rows each, none cut inside) for ``size`` ranks: the
    given order, unless the grouping below leaves the busiest rank fewer rows (``max_share``).
    The grouping: longest first, each unit to the rank with the fewest rows so far (ties to the
    lower rank and the earlier unit), then refined (``refine_groups``: a unit moved or two swapped
    between the busiest rank and another while that lowers the busier of the two); rank 0's units,
    rank 1's, ... The speed of a pass under data-parallel attention is bounded by its busiest rank.

    Worked example: 9000, 7000, 6000, 5000 rows over 2 ranks (27000 rows, ideal 13500 each): in
    the given order the cut nearest 13500 is 16000 (rank 0: 9000 + 7000); greedily rank 0 takes
    9000 then 5000, rank 1 7000 then 6000: 14000 | 13000. 6, 5, 4, 3, 2: greedily 6 + 3 + 2 | 5 + 4
    (11 | 9); swapping 6 and 5 gives 5 + 3 + 2 | 6 + 4 (10 | 10).

    >>> balanced_order([9000, 7000, 6000, 5000], 2), balanced_order([5, 5], 2), balanced_order([7, 1, 1], 1)
    ([0, 3, 1, 2], [0, 1], [0, 1, 2])
    >>> balanced_order([6, 5, 4, 3, 2], 2)
    [1, 3, 4, 0, 2]
    """
    given = list(range(len(sizes)))
    if size < 2 or len(sizes) < 2:
        return given
    loads, groups = [0] * size, [[] for _ in range(size)]
    for i in sorted(given, key=lambda i: (-sizes[i], i)):
        r = loads.index(min(loads))
        groups[r].append(i)
        loads[r] += sizes[i]
    refine_groups(groups, sizes)
    grouped = [i for g in groups for i in g]
    if max_share([sizes[i] for i in grouped], size) < max_share(sizes, size):
        return grouped
    return given


def refine_groups(groups: list[list[int]], sizes: list[int], max_steps: int = 256) -> None:
    """Lower the busiest group's total (in place): while some unit of the busiest group moved to
    another group, or swapped with one of its units, leaves both below the busiest's total, take
    the change that leaves the busier of the two lowest (the first found on a tie: groups in
    order of their totals, lower first, units in group order). Every step lowers the sum of squared
    totals, so this ends; ``max_steps`` bounds it. Swaps are tried between groups of at most
    64 units each (beyond that, single units are fine grained enough).

    >>> g = [[0, 3, 4], [1, 2]]; refine_groups(g, [6, 5, 4, 3, 2]); g  # 11 | 9 -> 10 | 10
    [[1, 3, 4], [0, 2]]
    >>> g = [[0], [1, 2]]; refine_groups(g, [20, 9, 8]); g  # the largest alone: nothing to gain
    [[0], [1, 2]]
    """
    loads = [sum(sizes[i] for i in g) for g in groups]
    for _ in range(max_steps):
        hi = max(range(len(groups)), key=lambda r: (loads[r], -r))
        best = None  # (the busier of the two after, lo, i, j or None)
        for lo in sorted((r for r in range(len(groups)) if r != hi), key=lambda r: (loads[r], r)):
            gap = loads[hi] - loads[lo]
            swaps = groups[lo] if len(groups[hi]) <= 64 and len(groups[lo]) <= 64 else []
            for a, i in enumerate(groups[hi]):
                for j, d in [(None, sizes[i])] + [(j, sizes[i] - sizes[j]) for j in swaps]:
                    if 0 < d < gap and (best is None or loads[hi] - d < best[0] and loads[lo] + d < best[0]):
                        best = (max(loads[hi] - d, loads[lo] + d), lo, a, j)
        if best is None:
            return
        _, lo, a, j = best
        i = groups[hi][a]
        if j is None:  # a move: to the end of its new group
            groups[lo].append(groups[hi].pop(a))
        else:  # a swap: each takes the other's place
            b = groups[lo].index(j)
            groups[hi][a], groups[lo][b] = j, i
        d = sizes[i] - (0 if j is None else sizes[j])
        loads[hi] -= d
        loads[lo] += d


@dataclass(frozen=True, slots=True)
class RowSplit:
    """A batch's rows over the ranks: rank r owns rows ``bounds[r] .. bounds[r + 1]`` (``assign_rows``);
    ``rank`` is this process's. Every rank knows every rank's count, so gathers need no exchange of
    sizes: each rank's rows travel padded to ``max_rows``.

    >>> s = RowSplit((0, 5, 8, 14, 16), rank=2)
    >>> s.own, s.counts, s.max_rows
    ((8, 14), (5, 3, 6, 2), 6)
    """

    bounds: tuple[int, ...]
    rank: int

    @property
    def own(self) -> tuple[int, int]:
        return self.bounds[self.rank], self.bounds[self.rank + 1]

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    @property
    def max_rows(self) -> int:
        return max(self.counts)

    def pad(self, x: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        """This rank's rows x [n, *] -> [max_rows, *], ``value`` below them."""
        extra = self.max_rows - x.shape[0]
        return x if extra == 0 else torch.cat([x, x.new_full((extra, *x.shape[1:]), value)])

    def gather(self, ctx: ParallelContext, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows x [n, *] -> every rank's rows in rank order [total, *] (a copy: exact)."""
        every = ctx.all_gather(self.pad(x))  # [size, max_rows, *]
        return torch.cat([every[r, :n] for r, n in enumerate(self.counts)])  # [total, *]


def micro_cuts(local_cuts: list[list[int]], min_rows: int) -> tuple[int, ...] | None:
    """Two micro-batches per rank (``models.base.ScoringModel``'s overlapped blocks): each rank's
    own rows cut once at the allowed cut (``local_cuts[r]``, ascending from 0 to its row count)
    nearest its middle (the smaller on a tie) -> each rank's cut, or None when some rank's half
    would hold fewer than ``min_rows`` rows (then the batch runs as one: the overlap would not pay
    for the smaller products). Every rank computes every rank's cut from the same batch, so the
    micro-batches' gathers need no exchange of sizes.

    >>> micro_cuts([[0, 300, 500, 1000], [0, 450, 900]], 100), micro_cuts([[0, 300, 500, 1000], [0, 900]], 100)
    ((500, 450), None)
    """
    out = []
    for cuts in local_cuts:
        n = cuts[-1]
        c = min(cuts, key=lambda c: (abs(2 * c - n), c))
        if c < min_rows or n - c < min_rows:
            return None
        out.append(c)
    return tuple(out)


def micro_splits(cut: tuple[int, ...], counts: tuple[int, ...], rank: int) -> tuple[RowSplit, RowSplit]:
    """The two micro-batches' ``RowSplit``s over the ranks: rank r's first ``cut[r]`` own rows,
    then the rest.

    >>> [s.bounds for s in micro_splits((500, 450), (1000, 900), 1)]
    [(0, 500, 950), (0, 500, 950)]
    """
    first = [0]
    for c in cut:
        first.append(first[-1] + c)
    second = [0]
    for c, n in zip(cut, counts):
        second.append(second[-1] + n - c)
    return RowSplit(tuple(first), rank), RowSplit(tuple(second), rank)
