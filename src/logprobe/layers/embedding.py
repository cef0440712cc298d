"""Vocabulary-parallel token embedding: rank r holds rows ``vocab_start .. vocab_start + rows``.

Each rank looks up the ids it owns, writes zeros for the others, and an all-reduce sums the
ranks' rows: exactly one rank contributes a non-zero row per token, so the sum is exact in any
order. A ``-0.0`` entry would come out as ``+0.0`` from that sum, so one rank adds ``+0.0`` too
and every TP size gives the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.context import ParallelContext
from .parallel_linear import RowShard


class VocabParallelEmbedding(RowShard, nn.Module):
    """Rows ``vocab_start .. vocab_end`` of the whole [num_embeddings, embedding_dim] table (``tp_rows``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ParallelContext,
                 vocab_start: int = 0, vocab_end: int | None = None) -> None:
        super().__init__()
        self.ctx = ctx
        self.num_embeddings = num_embeddings  # the whole vocabulary
        self.vocab_start = vocab_start
        self.vocab_end = num_embeddings if vocab_end is None else vocab_end
        self.tp_rows = (vocab_start, self.vocab_end)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - vocab_start, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] (global) -> [T, H]."""
        if not self.ctx.parallel:
            return F.embedding(ids, self.weight) + 0.0
        local = ids - self.vocab_start
        owned = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # [T, H]
        out = torch.where(owned[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        return self.ctx.all_reduce_sum(out)


def scaled(x: torch.Tensor, value: float) -> torch.Tensor:
    """``x * value`` with ``value`` rounded to float32, then to x's dtype, first (transformers'
    scaled embeddings: sqrt(hidden) as a float32 tensor cast to the weight dtype; bf16 sqrt(2560) =
    50.596 -> 50.5), the factor made on x's device: no host-to-device copy, which a CUDA graph
    capture refuses (``engine.graphs``).

    >>> scaled(torch.ones(2, dtype=torch.bfloat16), 2560 ** 0.5).tolist()
    [50.5, 50.5]
    """
    return x * torch.full((), value, dtype=torch.float32, device=x.device).to(x.dtype)
