"""One ``Engine.run`` call's delivery: results in input order as requests complete, requests that
failed (out of memory even alone), the batch whose results are still on their way from the GPU,
and the progress bar. A request's result is handed on once, whole: a request run in chunks is
joined first (``concat_parts``).

With the host overlap (``EngineConfig.overlap_host``) a batch's results are read one batch late:

    launch b0 | hold(b0) | launch b1 | settle() -> b0 delivered | hold(b1) | ... | close() -> b_last
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import LogprobeError
from .request import RequestResult, ScoreRequest


class RunStopped(Exception):
    """``Engine.run(stop=...)`` was told to stop; the requests completed before it were delivered."""


class RequestOutOfMemory(LogprobeError):
    """Request ``index`` (``tokens`` inputs) ran out of memory even alone, in a pass of ``rows``
    rows seeing ``context`` tokens; ``fits``: the most tokens one pass has held on this engine."""

    def __init__(self, index: int, tokens: int, rows: int, context: int, fits: int, cause: str = "") -> None:
        self.index, self.tokens, self.rows, self.context, self.fits = index, tokens, rows, context, fits
        self.cause = cause
        have = f"at most about {fits} tokens have fit in one pass" if fits else "no pass has fit yet"
        super().__init__(f"requests[{index}]", f"{tokens} input tokens do not fit in memory even alone "
                         f"(out of memory at {context} tokens; {have}){'; ' + cause if cause else ''}",
                         "send fewer tokens per request, or use a smaller --dtype, a smaller model or more memory")

    def __reduce__(self):  # picklable (its arguments are not its message)
        return type(self), (self.index, self.tokens, self.rows, self.context, self.fits, self.cause)


class Delivery:
    """The bookkeeping of one run over ``requests``: ``on_result(i, result)`` as each completes,
    ``on_error(i, RequestOutOfMemory)`` for each that failed; without ``on_error`` the first such
    error is raised by ``close`` once every other request has run."""

    def __init__(self, requests: list[ScoreRequest], on_result: Callable[[int, RequestResult], None] | None,
                 on_error: Callable[[int, Exception], None] | None, bar,
                 on_batch: Callable[[], None] | None = None) -> None:
        self.requests = requests
        self.on_batch = on_batch  # after each settled batch's results (``Engine.run``)
        self.lengths = [r.num_inputs for r in requests]  # input tokens, by request index
        self.on_result, self.on_error, self.bar = on_result, on_error, bar
        self.results: list[RequestResult | None] = [None] * len(requests)
        self.errors: list[RequestOutOfMemory] = []
        self.in_flight: list = []  # the batch launched last (``Launched``), its results not read yet

    def finish(self, i: int, res: RequestResult) -> None:
        self.results[i] = res
        if self.requests[i].images is not None:  # its tower outputs: held only while it has rows to run
            self.requests[i].images.embeds = None
        if self.on_result is not None:
            self.on_result(i, res)

    def batch_done(self) -> None:
        """A pass's results (or a chunked request's) have all gone to ``on_result``."""
        if self.on_batch is not None:
            self.on_batch()

    def fail(self, i: int, rows: int, context: int, fits: int, cause: str) -> None:
        # the error keeps no traceback: its frames would hold the failed batch's tensors
        err = RequestOutOfMemory(i, self.lengths[i], rows, context, fits, cause)
        self.errors.append(err)
        if self.on_error is not None:
            self.on_error(i, err)

    def progress(self, rows: int) -> None:
        if self.bar is not None:
            self.bar.update(rows)

    def hold(self, launched) -> None:
        """``launched``'s results are read at the next ``settle`` (after the next launch)."""
        self.in_flight.append(launched)

    def settle(self) -> None:
        """Read and deliver the batch in flight, if any."""
        while self.in_flight:
            launched = self.in_flight.pop()
            for i, part in launched.results():
                self.finish(i, concat_parts([part], self.requests[i]))
            self.batch_done()
            self.progress(launched.packed.meta.num_rows)

    def close(self) -> list[RequestResult]:
        """Everything delivered: the results in input order (None where a request failed)."""
        self.settle()
        if self.bar is not None:
            self.bar.close()
        if self.errors and self.on_error is None:
            raise self.errors[0]
        return self.results  # type: ignore[return-value]


def concat_parts(parts: list[RequestResult], r: ScoreRequest) -> RequestResult:
    """One request's results from its chunks, in order; capture pieces joined (rows) or added (sum)."""
    cat = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    out = parts[0] if len(parts) == 1 else RequestResult(cat("logprobs"), cat("ranks"), cat("entropy"),
                                                         cat("topk_ids"), cat("topk_logprobs"))
    if r.route and len(parts) > 1:  # the chunks' expert ids, in token order
        out.routed_experts = torch.cat([p.routed_experts for p in parts if p.routed_experts is not None])
    if r.capture:
        pieces: list[list[torch.Tensor]] = [[] for _ in r.capture]
        for p in parts:
            for c, piece in p.captures or ():
                pieces[c].append(piece)
        out.captures = [join_pieces(ps, c.kind) for ps, c in zip(pieces, r.capture)]
    return out


def join_pieces(pieces: list[torch.Tensor], kind: str) -> torch.Tensor:
    """One capture's pieces from several passes: rows joined in order, or "sum" captures added."""
    if len(pieces) == 1:
        return pieces[0]
    if kind == "sum":
        total = pieces[0].clone()
        for p in pieces[1:]:
            total += p
        return total
    return torch.cat(pieces)
