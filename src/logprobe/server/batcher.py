"""Continuous batching across HTTP requests: one engine thread, shared packed batches.

Every HTTP request becomes a list of ``ScoreRequest``s (a job). The engine thread repeatedly
takes requests from the queued jobs, round-robin so a long perplexity job cannot starve a short
multiple-choice request, up to one batch's token budget, runs them in **one** engine call and
hands each result back to the job it came from. A job's future resolves when its last request
is scored. With ``pipeline`` (off by default: ``ServerConfig.pipeline_steps``) a step takes
about half of the work that waits, so the answers of one step travel while the next computes
(``steps.plan_step``). The queue is bounded in jobs and in tokens; beyond either ``submit``
raises ``QueueFull`` (the server answers 429 with ``Retry-After``).

Nothing is computed for nobody: a job whose caller has gone (its ``submit`` cancelled: the HTTP
client disconnected) or whose ``timeout`` passed (``JobTimeout``) leaves the queue at once,
counted once by ``on_drop(reason)``; if it is running, the engine leaves its requests out of
the passes that follow (``run_batch(requests, cancelled)``: asked between passes and chunks), so
only the pass under way is finished, and its tokens are not counted as scored. A result that is an exception (``Engine.run``'s per-request failures: a request that
does not fit in memory even alone) fails its own job only. ``drain(timeout)`` stops taking jobs,
lets the queue run empty within ``timeout`` seconds and fails what is left (``ServerClosed``).

``exclusive(fn)`` runs ``fn`` (a weight swap) between engine steps with no job half-done: it
stops starting jobs, lets the started ones finish (their later requests still run), waits for the
engine step under way, calls ``fn`` and resumes; so one job never sees two sets of weights.
Each job carries the batcher's ``tag`` of the moment it started (``submit_tagged``): ``fn``'s
return value, when not None, becomes the new tag (the weights' version).

    queue: A [a0 a1] started, B [b0] not     exclusive(swap) called
    step : a1 (B waits)  -> A resolves (tag 1)
    swap : fn() -> 2     -> B starts, resolves (tag 2)

    queue:  job A [a0 a1 a2 a3]   job B [b0]   job C [c0 c1]
    step 1: a0 b0 c0 a1 (budget full)   -> B resolves
    step 2: c1 a2 a3                    -> A, C resolve
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.request import RequestResult, ScoreRequest
from ..executor.interface import Executor
from .steps import plan_step


class QueueFull(Exception):
    def __init__(self, retry_after: int, reason: str) -> None:
        super().__init__(reason)
        self.retry_after = retry_after
        self.reason = reason


class ServerClosed(Exception):
    pass


class JobFailed(Exception):
    """Request ``index`` of a job failed alone in the engine (``error``, e.g. RequestOutOfMemory).
    ``field``: the body's item it came from, when the route knows it better than the index."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(str(error))
        self.index = index
        self.error = error
        self.field: str | None = None


class JobTimeout(Exception):
    def __init__(self, timeout: float, started: bool = False) -> None:
        what = ("did not finish within {:g} s; its work was stopped and nothing is returned" if started else
                "was not started within {:g} s; nothing was computed").format(timeout)
        super().__init__(f"timeout: the request {what}; retry later or with a longer timeout")
        self.timeout = timeout


@dataclass(slots=True, eq=False)
class _Job:
    requests: list[ScoreRequest]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    tokens: int
    results: list[RequestResult | None] = field(default_factory=list)
    next: int = 0  # first request not yet handed to the engine
    done: int = 0  # requests scored
    deadline: float | None = None  # time.monotonic() by which it must be answered
    timeout: float | None = None
    removed: bool = False  # out of the queue (finished, failed, dropped)
    tag: object = None  # the batcher's tag when its first request was taken


@dataclass(slots=True)
class StepStats:
    requests: int  # ScoreRequests in the engine call
    jobs: int  # HTTP requests they came from
    tokens: int  # input tokens
    scored: int  # token log-probs computed
    seconds: float


RunBatch = Callable[[list[ScoreRequest], Callable[[int], bool] | None], list[RequestResult | Exception | None]]


def engine_call(executor: Executor) -> RunBatch:
    """``run_batch`` for the Batcher: ``executor.run``, where a request that does not fit in memory
    even alone is an exception in its slot (its job alone fails, 413). An executor without
    per-request errors (worker processes) raises instead: the step's jobs fail together.
    ``cancelled(i)``: asked between passes; a cancelled request's slot is None."""

    def run_batch(requests: list[ScoreRequest], cancelled: Callable[[int], bool] | None = None):
        if not executor.per_request_errors:
            return executor.run(requests, cancelled=cancelled)
        errors: list[tuple[int, Exception]] = []
        results: list = executor.run(requests, on_error=lambda i, e: errors.append((i, e)), cancelled=cancelled)
        for i, e in errors:
            results[i] = e
        return results

    return run_batch


class JobQueue:
    """The jobs waiting or running, in arrival order, and their unscored input tokens: what the
    ``Batcher`` takes its steps from and hands results back to. Not thread-safe: every method is
    called with the batcher's lock held."""

    def __init__(self, on_drop: Callable[[str], None] | None = None) -> None:
        self.jobs: list[_Job] = []  # arrival order
        self.tokens = 0  # input tokens of requests not yet scored
        self.on_drop = on_drop
        self._turn = 0  # round-robin position

    def add(self, job: _Job) -> None:
        self.jobs.append(job)
        self.tokens += job.tokens

    def remove(self, job: _Job, dropped: str | None = None) -> None:
        """Take a job out with its unscored tokens; ``dropped``: the reason it leaves unfinished,
        counted by ``on_drop``."""
        if job.removed:
            return
        job.removed = True
        self.jobs.remove(job)
        self.tokens -= sum(r.num_inputs for r in job.requests[job.done:])
        if dropped is not None and self.on_drop is not None:
            self.on_drop(dropped)

    def sweep(self, now: float) -> None:
        """Drop the jobs whose client went away, and those past their deadline (answered JobTimeout)."""
        for job in list(self.jobs):
            if job.future.cancelled():
                self.remove(job, "disconnected")
            elif job.deadline is not None and now > job.deadline:
                self.remove(job, "timeout")
                job.loop.call_soon_threadsafe(_fail, job.future, JobTimeout(job.timeout or 0.0, job.next > 0))

    def take(self, budget: int, paused: bool, batching: bool, pipeline: bool, cached, tag) -> list[tuple[_Job, int]]:
        """The next step's ``(job, request index)``: ``plan_step`` over the jobs with requests left
        (while ``paused``, only those already started; without ``batching``, the first alone), in
        a turn order that moves on by one each step; a job started here gets ``tag``."""
        pending = [j for j in self.jobs if j.next < len(j.requests) and (j.next > 0 or not paused)]
        if not pending:
            return []
        if not batching:
            pending = pending[:1]
        start = self._turn % len(pending)
        order = pending[start:] + pending[:start]
        picks = plan_step([(job.requests, job.next) for job in order], budget, pipeline, cached)
        step = [(order[j], order[j].next + k) for j, k in picks]
        for job, i in step:  # a job's requests come in order
            if job.next == 0:
                job.tag = tag  # the weights' version this job starts under
            job.next = i + 1
        self._turn += 1
        return step

    def record(self, step: list[tuple[_Job, int]], results: list) -> tuple[list[_Job], list[tuple[_Job, Exception]], int]:
        """Each result into its job: (jobs now finished, jobs failed with their error, token
        log-probs delivered); a job dropped meanwhile is skipped (its tokens left the count then)."""
        finished: list[_Job] = []
        failed: list[tuple[_Job, Exception]] = []
        scored = 0
        for (job, i), res in zip(step, results):
            if job.removed:
                continue
            if res is None:
                res = RuntimeError("the engine returned no result")
            if isinstance(res, Exception):
                self.remove(job)
                failed.append((job, JobFailed(i, res)))
                continue
            job.results[i] = res
            job.done += 1
            scored += job.requests[i].num_scored
            self.tokens -= job.requests[i].num_inputs
            if job.done == len(job.requests):
                self.remove(job)
                finished.append(job)
        return finished, failed, scored


class Batcher:
    """``await batcher.submit(requests)`` -> results in order, scored in batches shared with other callers.

    ``run_batch(requests, cancelled) -> results`` is the engine call (``engine_call(executor)``; a
    result may be an exception: that request's job fails with it; ``cancelled(i)`` is True once
    request i's job is gone, and its slot may then be None); ``on_step`` sees each step's size and time, and
    ``on_drop(reason)`` each job dropped unscored ("disconnected", "timeout", "shutdown") (metrics).
    A step takes requests up to ``max_batch_tokens`` of what the engine will compute
    (``StepCost``: shared and cached contexts counted once); the engine splits it into passes.
    ``pipeline``: while two or more jobs wait, a step takes half of the queue's work
    (``step_budget``: at least a quarter of the budget), plus the requests sharing a context with
    it (``companions``), so that the answers of one step travel while the next computes.
    """

    def __init__(self, run_batch: RunBatch,
                 max_batch_tokens: int, max_queue_requests: int, max_queue_tokens: int, batching: bool = True,
                 on_step: Callable[[StepStats], None] | None = None,
                 on_drop: Callable[[str], None] | None = None,
                 cached: Callable[[list[int], int], int] | None = None, pipeline: bool = False) -> None:
        self.run_batch = run_batch
        self.pipeline = pipeline  # while several jobs wait, a step takes step_budget of the queue
        self.cached = cached  # tokens of a prefix the engine's prefix cache holds (``StepCost``)
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_requests = max_queue_requests
        self.max_queue_tokens = max_queue_tokens
        self.batching = batching
        self.on_step = on_step
        self._accepting = True
        self._queue = JobQueue(on_drop)
        self._cond = threading.Condition()
        self._closed = False
        self._rate = 0.0  # tokens/s, moving average over engine steps (for Retry-After)
        self.tag: object = None  # stamped on each job as it starts (the weights' version)
        self._paused = False  # exclusive(): start no new job
        self._busy = False  # an engine step is running
        self._exclusive = threading.Lock()  # one exclusive section at a time
        self._thread = threading.Thread(target=self._loop, name="logprobe-engine", daemon=True)

    # -- event-loop side -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the engine thread; queued jobs fail with ServerClosed."""
        with self._cond:
            self._closed = True
            self._accepting = False
            jobs = list(self._queue.jobs)
            for job in jobs:
                self._queue.remove(job, "shutdown")
            self._cond.notify_all()
        for job in jobs:
            job.loop.call_soon_threadsafe(_fail, job.future, ServerClosed("the server is shutting down"))
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def drain(self, timeout: float) -> int:
        """Take no new jobs; wait up to ``timeout`` seconds for the queued and running ones to
        finish, then fail the rest with ServerClosed. Returns how many were failed. Blocking
        (call it from a worker thread)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._accepting = False
            while self._queue.jobs and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            jobs = list(self._queue.jobs)
            for job in jobs:
                self._queue.remove(job, "shutdown")
            self._cond.notify_all()
        for job in jobs:
            job.loop.call_soon_threadsafe(_fail, job.future, ServerClosed(
                f"the server is shutting down and did not reach this request within {timeout:g} s"))
        return len(jobs)

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def busy(self) -> bool:
        """An engine step is running."""
        return self._busy

    @property
    def queue_depth(self) -> tuple[int, int]:
        """(jobs, input tokens) waiting or running."""
        with self._cond:
            return len(self._queue.jobs), self._queue.tokens

    def exclusive(self, fn: Callable[[], object], timeout: float | None = None) -> object:
        """Run ``fn()`` with no engine step running and no job half-done; returns its value, which
        (when not None) becomes ``tag``. Jobs queued meanwhile wait and then run as usual.
        Blocking (call it from a worker thread); ``ServerClosed`` if the batcher closes first,
        ``TimeoutError`` (nothing done) when the started jobs take more than ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._exclusive:
            with self._cond:
                self._paused = True
                try:
                    while not self._closed and (self._busy or any(j.next > 0 for j in self._queue.jobs)):
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise TimeoutError(f"the requests under way did not finish within {timeout:g} s")
                        self._cond.wait(left)
                    if self._closed:
                        raise ServerClosed("the server is shutting down")
                except BaseException:
                    self._paused = False
                    self._cond.notify_all()
                    raise
            try:
                value = fn()
                if value is not None:
                    self.tag = value
                return value
            finally:
                with self._cond:
                    self._paused = False
                    self._cond.notify_all()

    async def submit(self, requests: list[ScoreRequest], timeout: float | None = None) -> list[RequestResult]:
        """Results in order. ``timeout``: seconds until the job must be answered, else JobTimeout
        (its work stopped between passes). Cancelling the call (the client went away) drops the
        job: what has not run is not computed."""
        return (await self.submit_tagged(requests, timeout))[0]

    async def submit_tagged(self, requests: list[ScoreRequest],
                            timeout: float | None = None) -> tuple[list[RequestResult], object]:
        """``submit``, and the ``tag`` the job ran under (every request of it under the same one)."""
        if not requests:
            return [], self.tag
        loop = asyncio.get_running_loop()
        tokens = sum(r.num_inputs for r in requests)
        job = _Job(requests, loop.create_future(), loop, tokens, [None] * len(requests),
                   deadline=None if timeout is None else time.monotonic() + timeout, timeout=timeout)
        with self._cond:
            if not self._accepting:
                raise ServerClosed("the server is shutting down")
            if self._queue.jobs:  # an empty queue takes any job, however large
                if len(self._queue.jobs) >= self.max_queue_requests:
                    raise QueueFull(self._retry_after(), f"{len(self._queue.jobs)} requests are queued "
                                    f"(limit {self.max_queue_requests})")
                if self._queue.tokens + tokens > self.max_queue_tokens:
                    raise QueueFull(self._retry_after(), f"{self._queue.tokens} tokens are queued; "
                                    f"{tokens} more would pass the limit of {self.max_queue_tokens}")
            self._queue.add(job)
            self._cond.notify()
        try:
            if timeout is None:
                return await asyncio.shield(job.future), job.tag
            try:
                return await asyncio.wait_for(asyncio.shield(job.future), timeout), job.tag
            except asyncio.TimeoutError:
                with self._cond:
                    if not job.removed:  # the engine leaves it out of its next pass
                        self._queue.remove(job, "timeout")
                        self._cond.notify_all()
                        raise JobTimeout(timeout, job.next > 0) from None
                return await asyncio.shield(job.future), job.tag  # answered or failed meanwhile
        except asyncio.CancelledError:
            with self._cond:
                if not job.removed:  # what has not reached the engine is not computed
                    self._queue.remove(job, "disconnected")
                    self._cond.notify_all()
            job.future.cancel()
            raise

    def _retry_after(self) -> int:
        if self._rate <= 0:
            return 1
        return max(1, min(60, math.ceil(self._queue.tokens / self._rate)))

    # -- engine thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._ready():
                    self._cond.wait()
                if self._closed:
                    return
                step = self._take()
                self._busy = bool(step)
            if not step:
                continue
            requests = [job.requests[i] for job, i in step]
            tokens = sum(r.num_inputs for r in requests)
            t0 = time.perf_counter()
            try:
                results = self.run_batch(requests, lambda k, step=step: self._gone(step[k][0]))
            except Exception as e:  # noqa: BLE001 - fail the jobs in this step, keep serving the others
                self._idle()
                self._fail_jobs({job for job, _ in step}, e)
                continue
            self._idle()
            seconds = time.perf_counter() - t0
            scored = self._deliver(step, results)
            self._rate = tokens / seconds if self._rate == 0 else 0.8 * self._rate + 0.2 * tokens / seconds
            if self.on_step is not None:
                self.on_step(StepStats(len(requests), len({id(j) for j, _ in step}), tokens, scored, seconds))

    def _gone(self, job: _Job) -> bool:
        """Asked by the engine between passes: True once ``job`` left the queue (its client went
        away, or its deadline passed: then it is taken out here and answered JobTimeout)."""
        if job.removed:
            return True
        late = job.deadline is not None and time.monotonic() > job.deadline
        if not late and not job.future.cancelled():
            return False
        with self._cond:
            if job.removed:
                return True
            self._queue.remove(job, "timeout" if late and not job.future.cancelled() else "disconnected")
            self._cond.notify_all()
        if late:
            job.loop.call_soon_threadsafe(_fail, job.future, JobTimeout(job.timeout or 0.0, job.next > 0))
        return True

    def _ready(self) -> bool:
        """Something to take (lock held): a job, and while paused a started job with requests left."""
        jobs = self._queue.jobs
        return bool(jobs) and (not self._paused or any(0 < j.next < len(j.requests) for j in jobs))

    def _idle(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def _take(self) -> list[tuple[_Job, int]]:
        """The next engine step (lock held): ``JobQueue.take`` after dropping the jobs gone."""
        self._queue.sweep(time.monotonic())
        return self._queue.take(self.max_batch_tokens, self._paused, self.batching, self.pipeline, self.cached,
                                self.tag)

    def _deliver(self, step: list[tuple[_Job, int]], results: list[RequestResult | Exception | None]) -> int:
        """Hand each result to its job; returns the token log-probs delivered (a dropped job's are
        not counted)."""
        with self._cond:
            finished, failed, scored = self._queue.record(step, results)
            self._cond.notify_all()
        for job in finished:
            job.loop.call_soon_threadsafe(_succeed, job.future, job.results)
        for job, error in failed:
            job.loop.call_soon_threadsafe(_fail, job.future, error)
        return scored

    def _fail_jobs(self, jobs: set[_Job], error: Exception) -> None:
        with self._cond:
            jobs = {job for job in jobs if not job.removed}
            for job in jobs:
                self._queue.remove(job)
            self._cond.notify_all()
        for job in jobs:
            job.loop.call_soon_threadsafe(_fail, job.future, error)


def _succeed(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
