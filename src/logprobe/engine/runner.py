"""The engine loop: plan (trees, chunks, budget) -> pack -> forward -> score -> collect."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import EngineConfig
from ..errors import LogprobeError
from ..layers.attention import AttentionMeta, KVCache, Segment
from ..layers.linear import Linear
from ..scoring.head import HeadOutput, logprob_head
from .request import RequestResult, ScoreRequest
from .scheduler import Chunk, Tree, plan_work

# Jobs with at least this many input tokens show a progress bar (when stderr is a terminal).
PROGRESS_MIN_TOKENS = 32768


@dataclass(slots=True)
class PackedBatch:
    """One forward pass: rows of token ids with positions and their ``AttentionMeta``.

    ``score_rows[i]`` is the row whose next-token distribution scores ``targets[i]``; rows are
    listed request by request (``owners``: request index and how many scored rows it has here).
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T], each sequence's own positions (continuing after a prefix or cache)
    meta: AttentionMeta
    score_rows: torch.Tensor  # [N] rows of the hidden states whose next token is scored
    targets: torch.Tensor  # [N] the token each of those rows predicts
    temperature: torch.Tensor  # [N] per scored row (from its request)
    owners: list[tuple[int, int]]  # (request index, scored rows) in score_rows order


def pack(batch: list[Tree | Chunk], requests: list[ScoreRequest], device: torch.device,
         kv_block: int | None = None) -> PackedBatch:
    """Lay out a planned batch. Token j of a request is predicted by the row of its input j - 1,
    wherever that row is: in the shared prefix (one row can score a different target for each
    branch), in the request's own branch, or in its chunk."""
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    rows: list[int] = []
    targets: list[int] = []
    temps: list[float] = []
    owners: list[tuple[int, int]] = []
    past = 0

    def add_rows(tokens: list[int], first_pos: int, context: tuple[tuple[int, int], ...]) -> int:
        start = len(ids)
        ids.extend(tokens)
        positions.extend(range(first_pos, first_pos + len(tokens)))
        if tokens:
            segments.append(Segment(start, len(ids), context))
        return start

    def add_scores(i: int, js: range, input_rows: list[int]) -> None:
        """Score tokens js of request i; input_rows[k] is the batch row of the request's input k."""
        r = requests[i]
        rows.extend(input_rows[j - 1] for j in js)
        targets.extend(r.tokens[j] for j in js)
        temps.extend([r.temperature] * len(js))
        owners.append((i, len(js)))

    for item in batch:
        if isinstance(item, Chunk):
            r = requests[item.request]
            past = item.begin  # rows 0..begin-1 are in the cache, before ours in the key source
            start = add_rows(r.tokens[item.begin:item.end], item.begin, ((0, item.begin),) if item.begin else ())
            js = range(max(r.score_begin, item.begin + 1), item.end + 1)
            add_scores(item.request, js, [-1] * item.begin + list(range(start, start + item.end - item.begin)))
            continue
        P = item.shared
        prefix = add_rows(requests[item.members[0]].tokens[:P], 0, ())
        for i in item.members:
            r = requests[i]
            branch = add_rows(r.tokens[P:-1], P, ((prefix, prefix + P),) if P else ())
            own = list(range(branch, branch + r.num_inputs - P))
            add_scores(i, range(r.score_begin, len(r.tokens)), list(range(prefix, prefix + P)) + own)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    meta = AttentionMeta(segments, kv_block=kv_block, past=past)
    return PackedBatch(as_long(ids), as_long(positions), meta, as_long(rows), as_long(targets),
                       torch.tensor(temps, dtype=torch.float32, device=device), owners)


class Engine:
    """Runs ScoreRequests on a model (``forward(ids, positions, meta) -> hidden``, ``head_params()``).

    Shared prefixes and chunking need a model with ``supports_context``; for others each request
    runs as an independent sequence (a request over the budget runs whole, alone)."""

    def __init__(self, model: nn.Module, config: EngineConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self._linears = [m for m in model.modules() if isinstance(m, Linear)]
        self._context = bool(getattr(model, "supports_context", False))

    @torch.no_grad()
    def run(
        self,
        requests: list[ScoreRequest],
        on_result: Callable[[int, RequestResult], None] | None = None,
        progress: bool | None = None,
    ) -> list[RequestResult]:
        """Results in input order; ``on_result(i, result)`` is called as each request completes."""
        cfg = self.config
        if cfg.deterministic and not self._context:
            raise LogprobeError("deterministic", f"{type(self.model).__name__} has no deterministic kernels",
                                "use a native model (GGUF or a Llama-family directory), or turn it off")
        plan = plan_work([r.tokens[:-1] for r in requests], cfg.max_batch_tokens,
                         share=cfg.share_prefixes and self._context, min_shared=cfg.min_shared_prefix,
                         chunk=self._context)
        results: list[RequestResult | None] = [None] * len(requests)
        parts: dict[int, list[RequestResult]] = {}
        bar = self._progress_bar(sum(r.num_inputs for r in requests), progress)
        cache: KVCache | None = None
        kv_block = cfg.attention_block if cfg.deterministic else None
        for batch in plan:
            packed = pack(batch, requests, self.device, kv_block)
            item = batch[0]
            if isinstance(item, Chunk):
                if item.begin == 0:
                    cache = KVCache.empty(len(self.model.layers))
                packed.meta.cache = cache
            self._set_tiling()
            hidden = self.model(packed.input_ids, packed.positions, packed.meta)  # [T, H]
            for i, part in self.score(requests, packed, hidden):
                parts.setdefault(i, []).append(part)
                if sum(len(p.logprobs) for p in parts[i]) == requests[i].num_scored:
                    results[i] = _concat(parts.pop(i))
                    if on_result is not None:
                        on_result(i, results[i])
            if isinstance(item, Chunk) and item.end == requests[item.request].num_inputs:
                cache = None
            if bar is not None:
                bar.update(packed.meta.num_rows)
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]

    def score(self, requests: list[ScoreRequest], packed: PackedBatch,
              hidden: torch.Tensor) -> list[tuple[int, RequestResult]]:
        """Head options are per request: the head computes the largest top-k and entropy asked
        for in the batch (neither changes any other number of a row), each request gets its own."""
        batch = [requests[i] for i, _ in packed.owners]
        top_k = max(r.top_k for r in batch)
        entropy = any(r.entropy for r in batch)
        det = self.config.deterministic
        out = logprob_head(hidden[packed.score_rows], self.model.head_params(), packed.targets,
                           packed.temperature, top_k=top_k, entropy=entropy,
                           token_chunk=self.config.invariant_tile if det else self.config.head_token_chunk,
                           vocab_chunk=self.config.head_vocab_chunk, pad_chunks=det)
        results = []
        offset = 0
        for (i, n), r in zip(packed.owners, batch):
            results.append((i, _slice(out, slice(offset, offset + n), r)))
            offset += n
        return results

    def _set_tiling(self) -> None:
        # set before every forward: engines with different configs may share one model
        tile = self.config.invariant_tile if self.config.deterministic else None
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


def _slice(out: HeadOutput, sl: slice, r: ScoreRequest) -> RequestResult:
    return RequestResult(
        logprobs=out.logprobs[sl].cpu(),
        ranks=out.ranks[sl].cpu(),
        entropy=out.entropy[sl].cpu() if r.entropy else None,
        topk_ids=out.topk_ids[sl, : r.top_k].cpu() if r.top_k else None,
        topk_logprobs=out.topk_logprobs[sl, : r.top_k].cpu() if r.top_k else None,
    )


def _concat(parts: list[RequestResult]) -> RequestResult:
    """One request's results from its chunks, in order."""
    if len(parts) == 1:
        return parts[0]
    cat = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    return RequestResult(cat("logprobs"), cat("ranks"), cat("entropy"), cat("topk_ids"), cat("topk_logprobs"))
