"""What every route needs: the scorer, the limits and the shared batcher, with the checks and the
run step common to the scoring endpoints. ``create_app`` builds one ``Served`` and hands it to each
route module (``routes_openai``, ``routes_native``, ``routes_rl``), so none imports ``app``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ..errors import LogprobeError
from ..scorer import Job, Scorer
from .batcher import Batcher
from .config import ServerConfig
from .weights import ServedWeights


class ModelNotFound(LogprobeError):
    pass


class RequestTooLarge(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


INLINE_TOKENS = 16384  # tokens of work from which a job is built or finished in the thread pool


async def off_loop(tokens: int, fn, *args):
    """``fn(*args)`` for work over ``tokens`` tokens: on the event loop when small (a hop to the
    thread pool costs more than building a job from token ids or the reply of a few hundred
    tokens: a context switch and a handoff of the interpreter lock, which the engine thread
    launching kernels waits for too), in the thread pool from ``INLINE_TOKENS`` on (tokenizing,
    large replies), so the loop keeps answering meanwhile."""
    if tokens < INLINE_TOKENS:
        return fn(*args)
    return await run_in_threadpool(fn, *args)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read by then: receive() waits for disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def capture_floats(requests, hidden: int) -> int:
    """How many numbers the captures of these requests return (rows: n*H, sum: H, project: n)."""
    return sum(len(c.positions) * hidden if c.kind == "rows" else hidden if c.kind == "sum" else len(c.positions)
               for r in requests for c in r.capture)


@dataclass(eq=False)
class Served:
    scorer: Scorer
    config: ServerConfig
    name: str  # the model name clients send and replies show
    batcher: Batcher
    weights: ServedWeights

    @property
    def hidden(self) -> int:
        """Hidden size for the capture limit (0: a model without hook points)."""
        return self.scorer.context.hook_width

    def versions(self, version: int) -> dict:
        """A reply's version fields: ``weights_version`` (logprobe's count) and ``weight_version``
        (SGLang's name, a string) of the weights that computed it."""
        return {"weights_version": version, "weight_version": self.weights.name(version)}

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in {self.name, self.scorer.info.name, self.scorer.info.path}:
            raise ModelNotFound("model", f"{model!r} is not served here", f"use {self.name!r} (see GET /v1/models)")

    def check_top_k(self, k: int, field: str = "top_k") -> None:  # /v1/completions: completion_job checks logprobs
        """Before the job is queued: the head checks it too, but there it would fail the whole batch."""
        vocab = self.scorer.info.vocab_size
        if k > vocab:
            raise LogprobeError(field, f"{k} is more than the model's {vocab} tokens", f"ask for at most {vocab}")

    def check_items(self, n: int, field: str) -> None:
        if n > self.config.max_request_items:
            raise RequestTooLarge(field, f"{field}: {n} items exceed this server's limit of "
                                  f"{self.config.max_request_items} per request; split the request")

    async def run(self, job: Job, request: Request | None = None, timeout: float | None = None):
        """(the job's answer, the weights_version it was computed under), or a 499 Response when
        the client went away before the answer."""
        config = self.config
        if job.num_tokens > config.max_request_tokens:
            raise RequestTooLarge("body", f"body: {job.num_tokens} input tokens exceed this server's limit of "
                                  f"{config.max_request_tokens} per request; split the request")
        floats = capture_floats(job.requests, self.hidden)
        if floats > config.max_capture_floats:
            raise RequestTooLarge("capture", f"capture: {floats} captured numbers exceed this server's limit of "
                                  f"{config.max_capture_floats} per request; capture fewer points or positions, "
                                  "or reduce them (mean, sum, last, project)")
        task = asyncio.ensure_future(self.batcher.submit_tagged(job.requests, timeout))
        if request is not None:  # a client that goes away takes its queued work with it
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not task.done():
                    task.cancel()
            if not task.done() or task.cancelled():
                await asyncio.wait({task})  # its cancellation runs: the job leaves the queue
                return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        results, version = await task
        scored = sum(len(r.logprobs) for r in results if r is not None)
        return await off_loop(scored, job.finish, results), version
