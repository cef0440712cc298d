"""The engine loop: schedule -> pack -> forward -> score -> collect."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import EngineConfig
from ..layers.linear import Linear
from ..scoring.head import logprob_head
from .request import RequestResult, ScoreRequest
from .scheduler import plan_batches

# Jobs with at least this many input tokens show a progress bar (when stderr is a terminal).
PROGRESS_MIN_TOKENS = 32768


@dataclass(slots=True)
class PackedBatch:
    """Sequences concatenated without padding; rows of sequence i are cu_seqlens[i]:cu_seqlens[i+1]."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T], restarting at 0 in each sequence
    cu_seqlens: list[int]  # [B + 1]
    score_rows: torch.Tensor  # [N] rows of the hidden states whose next token is scored
    targets: torch.Tensor  # [N] the token each of those rows predicts
    temperature: torch.Tensor  # [N] per scored row (from its request)


def pack(requests: list[ScoreRequest], device: torch.device) -> PackedBatch:
    ids: list[int] = []
    positions: list[int] = []
    cu = [0]
    rows: list[int] = []
    targets: list[int] = []
    temps: list[float] = []
    for r in requests:
        start, n = cu[-1], r.num_inputs
        ids.extend(r.tokens[:-1])
        positions.extend(range(n))
        # row start + j - 1 predicts token j, for j in [score_begin, len(tokens))
        rows.extend(range(start + r.score_begin - 1, start + n))
        targets.extend(r.tokens[r.score_begin:])
        temps.extend([r.temperature] * r.num_scored)
        cu.append(start + n)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return PackedBatch(as_long(ids), as_long(positions), cu, as_long(rows), as_long(targets),
                       torch.tensor(temps, dtype=torch.float32, device=device))


class Engine:
    """Runs ScoreRequests on a model (``forward(ids, positions, cu_seqlens) -> hidden``, ``head_params()``)."""

    def __init__(self, model: nn.Module, config: EngineConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self._linears = [m for m in model.modules() if isinstance(m, Linear)]

    @torch.no_grad()
    def run(
        self,
        requests: list[ScoreRequest],
        on_result: Callable[[int, RequestResult], None] | None = None,
        progress: bool | None = None,
    ) -> list[RequestResult]:
        """Results in input order; ``on_result(i, result)`` is called as each batch completes."""
        batches = plan_batches([r.num_inputs for r in requests], self.config.max_batch_tokens)
        results: list[RequestResult | None] = [None] * len(requests)
        total = sum(r.num_inputs for r in requests)
        bar = self._progress_bar(total, progress)
        for batch_ids in batches:
            batch = [requests[i] for i in batch_ids]
            packed = pack(batch, self.device)
            self._set_tiling()
            hidden = self.model(packed.input_ids, packed.positions, packed.cu_seqlens)  # [T, H]
            for i, result in zip(batch_ids, self.score(batch, packed, hidden)):
                results[i] = result
                if on_result is not None:
                    on_result(i, result)
            if bar is not None:
                bar.update(packed.cu_seqlens[-1])
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]

    def score(self, batch: list[ScoreRequest], packed: PackedBatch, hidden: torch.Tensor) -> list[RequestResult]:
        top_k = max(r.top_k for r in batch)
        entropy = any(r.entropy for r in batch)
        out = logprob_head(hidden[packed.score_rows], self.model.head_params(), packed.targets,
                           packed.temperature, top_k=top_k, entropy=entropy,
                           token_chunk=self.config.invariant_tile if self.config.batch_invariant
                           else self.config.head_token_chunk,
                           vocab_chunk=self.config.head_vocab_chunk, pad_chunks=self.config.batch_invariant)
        results = []
        offset = 0
        for r in batch:
            sl = slice(offset, offset + r.num_scored)
            offset += r.num_scored
            results.append(RequestResult(
                logprobs=out.logprobs[sl].cpu(),
                ranks=out.ranks[sl].cpu(),
                entropy=out.entropy[sl].cpu() if r.entropy else None,
                topk_ids=out.topk_ids[sl, : r.top_k].cpu() if r.top_k else None,
                topk_logprobs=out.topk_logprobs[sl, : r.top_k].cpu() if r.top_k else None,
            ))
        return results

    def _set_tiling(self) -> None:
        # set before every forward: engines with different configs may share one model
        tile = self.config.invariant_tile if self.config.batch_invariant else None
        for m in self._linears:
            m.row_tile = tile

    def _progress_bar(self, total: int, progress: bool | None):
        show = self.config.progress if progress is None else progress
        if show is None:
            show = total >= PROGRESS_MIN_TOKENS and sys.stderr.isatty()
        if not show:
            return None
        from tqdm import tqdm

        return tqdm(total=total, unit="tok", desc="scoring", file=sys.stderr)
