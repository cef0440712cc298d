"""Redundant copies of hot experts under expert parallelism (EPLB-style placement): which experts
each rank holds and which rank computes each routed slot. Pure functions of the loads, pinned by
a gold table in ``tests/test_redundant_experts.py``.

Under whole experts per rank (``expert_parallel_size`` = ``tensor_parallel_size`` = P) rank r owns
experts [r E/P, (r + 1) E/P). A trained router is skewed: a few experts take most tokens, and the
rank owning them computes most slots while the others wait. With R redundant slots per rank, a
rank also holds up to R replicas of other ranks' hot experts (the same checkpoint weights, bit for
bit) and a hot expert's tokens are split among its holders by row: row t's slot of expert e goes
to ``replicas[e][t % len(replicas[e])]``. The rule reads the row's index only, never what else
shares the batch, and deterministic mode's expert products are batch-invariant (fixed row tiles,
``layers.numerics``): each slot's output has the same bits whichever holder computes it.

Worked example, E = 8 experts, P = 2 ranks, R = 1, loads [100, 10, 10, 10, 10, 10, 10, 10]:

    owned             : rank 0: 0 1 2 3 (load 130)        rank 1: 4 5 6 7 (load 40)
    1st replica       : expert 0 (100 per holder) on the lighter rank without it, rank 1
                        -> per holder 50: rank 0 80, rank 1 90
    2nd replica       : expert 0 sits on both ranks; the next hottest, experts 1 .. 3 (10), are on
                        rank 0, and rank 1's slot is taken; expert 4 (10) goes to rank 0
                        -> rank 0 85, rank 1 85
    held              : rank 0: (0, 1, 2, 3, 4)           rank 1: (4, 5, 6, 7, 0)
    replicas          : expert 0: (0, 1), expert 4: (1, 0), the others their owner alone
    dispatch          : row 6's slot of expert 0 -> replicas[0][6 % 2] = rank 0; row 7's -> rank 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import LogprobeError


@dataclass(frozen=True, slots=True)
class Placement:
    """``held[r]``: the experts rank r holds, its own E / P in order, then its replicas in the
    order they were placed; ``replicas[e]``: the ranks holding expert e, its owner first."""

    held: tuple[tuple[int, ...], ...]
    replicas: tuple[tuple[int, ...], ...]

    @property
    def ranks(self) -> int:
        return len(self.held)

    @property
    def experts(self) -> int:
        return len(self.replicas)

    def local_index(self, rank: int) -> list[int]:
        """For each expert, its index among rank ``rank``'s held experts, -1 where not held.

        >>> place_experts([100, 10, 10, 10, 10, 10, 10, 10], 2, 1).local_index(1)
        [4, -1, -1, -1, 0, 1, 2, 3]
        """
        where = [-1] * self.experts
        for i, e in enumerate(self.held[rank]):
            where[e] = i
        return where

    def tables(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(table [E, n] int64: row e its holders, repeated to the widest count; count [E] int64)."""
        width = max(len(r) for r in self.replicas)
        table = [list(r) + [r[0]] * (width - len(r)) for r in self.replicas]
        count = [len(r) for r in self.replicas]
        return torch.tensor(table, device=device), torch.tensor(count, device=device)


def slot_ranks(ids: torch.Tensor, table: torch.Tensor, count: torch.Tensor, first_row: int = 0) -> torch.Tensor:
    """The rank computing each slot of ``ids`` [T, k] (-1: a pad slot, id < 0), row t of the batch
    being row ``first_row + t`` of the rows every rank sees: ``table[e, row % count[e]]``.

    >>> t, c = place_experts([100, 10, 10, 10, 10, 10, 10, 10], 2, 1).tables()
    >>> slot_ranks(torch.tensor([[0, 5], [0, 1], [-1, -1]]), t, c, first_row=6).tolist()
    [[0, 1], [1, 0], [-1, -1]]
    """
    e = ids.clamp(min=0)
    rows = torch.arange(first_row, first_row + ids.shape[0], device=ids.device)[:, None]  # [T, 1]
    return torch.where(ids >= 0, table[e, rows % count[e]], -1)


def _rank_loads(holders: list[list[int]], loads: list[float], ranks: int) -> list[float]:
    """Each rank's expected load: every expert's load split evenly over its holders."""
    out = [0.0] * ranks
    for e, hs in enumerate(holders):
        for r in hs:
            out[r] += loads[e] / len(hs)
    return out


def place_experts(loads, ranks: int, redundant: int) -> Placement:
    """The placement of ``len(loads)`` = E experts over ``ranks`` = P ranks (P divides E), each
    rank with ``redundant`` = R slots for replicas, from each expert's load (tokens routed to it:
    measured, or expected). Greedy, one replica at a time (at most R P): the expert with the
    highest load per holder (ties: the lower id) that some rank with a free slot does not hold
    gets a replica on the least loaded such rank (ties: the lower rank), loads being each expert's
    load split evenly over its holders. Experts with no load are never copied, so a slot may stay
    empty. See the module's worked example."""
    _check(loads, ranks, redundant)
    loads = [float(v) for v in loads]
    E, per = len(loads), len(loads) // ranks
    holders = [[e // per] for e in range(E)]
    held = [list(range(r * per, (r + 1) * per)) for r in range(ranks)]
    free = [redundant] * ranks
    while any(free):
        rank_load = _rank_loads(holders, loads, ranks)
        pick = None
        for e in sorted(range(E), key=lambda e: (-loads[e] / len(holders[e]), e)):
            if loads[e] <= 0:
                break
            open_ = [r for r in range(ranks) if free[r] and r not in holders[e]]
            if open_:
                pick = e, min(open_, key=lambda r: (rank_load[r], r))
                break
        if pick is None:
            break
        e, r = pick
        holders[e].append(r)
        held[r].append(e)
        free[r] -= 1
    return Placement(tuple(map(tuple, held)), tuple(map(tuple, holders)))


def _check(loads, ranks: int, redundant: int) -> None:
    if isinstance(redundant, bool) or not isinstance(redundant, int) or redundant < 0:
        raise LogprobeError("redundant_experts", f"must be a non-negative integer, got {redundant!r}")
    try:
        values = [float(v) for v in loads]
    except (TypeError, ValueError):
        raise LogprobeError("expert_loads", "must be a list of numbers, one per expert (tokens routed to it)") from None
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise LogprobeError("expert_loads", "every load must be a finite number >= 0 (tokens routed to the expert)")
    if ranks < 1 or len(values) % ranks:
        raise LogprobeError("expert_loads", f"{len(values)} loads do not split over {ranks} ranks",
                            "give one load per expert of the model")


def rank_tokens(ids: torch.Tensor, experts: int, ranks: int, placement: Placement | None = None) -> list[int]:
    """How many slots of ``ids`` [T, k] (one batch: every rank's rows, in order) each of ``ranks``
    ranks computes: each expert's owner, or under ``placement`` its dispatch rule (``slot_ranks``).

    >>> ids = torch.tensor([[0, 5], [0, 1], [0, 4], [0, 2]])
    >>> rank_tokens(ids, 8, 2), rank_tokens(ids, 8, 2, place_experts([100, 10, 10, 10, 10, 10, 10, 10], 2, 1))
    ([6, 2], [4, 4])
    """
    if placement is None:
        who = torch.where(ids >= 0, ids // (experts // ranks), -1)
    else:
        who = slot_ranks(ids, *placement.tables(ids.device))
    return torch.bincount(who[who >= 0].reshape(-1), minlength=ranks).tolist()


def count_loads(routes, experts: int) -> list[int]:
    """Each expert's load from routed expert ids (``Scorer.logprobs(..., return_routed_experts=True)``
    results' ``routed_experts``, each [tokens, moe_layers, k]; every layer's counted together):
    what ``expert_loads`` takes after a warm-up pass.

    >>> count_loads([torch.tensor([[[0, 1]], [[0, 3]]])], 4)
    [2, 1, 0, 1]
    """
    ids = torch.cat([torch.as_tensor(r).reshape(-1).long() for r in routes])
    return torch.bincount(ids[ids >= 0], minlength=experts).tolist()
