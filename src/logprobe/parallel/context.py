"""A rank's view of its tensor-parallel group: who it is, and the collectives the parallel layers
call in their ``forward``. With ``size == 1`` every collective is the identity, so a model built
for one rank runs exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .shard import tree_order


@dataclass(slots=True)
class ParallelContext:
    """rank/size within the tensor-parallel group; ``group`` is a torch.distributed process group
    (None with one rank). ``slices``: deterministic mode's inner-dimension slice count (``S``)."""

    rank: int = 0
    size: int = 1
    group: object | None = None
    slices: int = 1

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """In place across ranks (default mode's row-parallel reduction; order left to the backend)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Exact in any order (a max never rounds)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [*] on every rank -> [size, *] in rank order."""
        if self.size == 1:
            return x.unsqueeze(0)
        import torch.distributed as dist

        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # ranks concatenated along dim 0
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x, group=self.group)
        return out.view(self.size, *x.shape)

    def tree_sum(self, partials: list[torch.Tensor]) -> torch.Tensor:
        """Deterministic sum of this rank's ``S / size`` consecutive leaf partials (float32), then
        of the ranks' subtotals, by one fixed pairwise tree over all ``S`` leaves (``tree_order``):
        the same additions in the same order at every TP size, hence the same bits.

        S = 4, TP = 2:  rank 0: a = p0 + p1, rank 1: b = p2 + p3; gather; a + b
        S = 4, TP = 1:  (p0 + p1) + (p2 + p3)          -- identical operations
        """
        local = list(partials)
        for i, j in tree_order(len(local)):
            local[i] = local[i] + local[j]
        if self.size == 1:
            return local[0]
        ranks = list(self.all_gather(local[0]).unbind(0))
        for i, j in tree_order(self.size):
            ranks[i] = ranks[i] + ranks[j]
        return ranks[0]
