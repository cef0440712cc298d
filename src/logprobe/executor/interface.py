"""``Executor``: what a Scorer, the row runner (``jobs``) and the server ask of an engine. The
in-process ``engine.runner.Engine`` and the worker processes' ``executor.engine.ParallelEngine``
both implement it, so no caller tells them apart by type:

    executor.run(requests, on_result=..., on_error=..., stop=..., cancelled=...)  -> results in input order
    executor.config                (read; set: later runs use it, max_batch_tokens None keeps the budget)
    executor.per_request_errors    True:  on_error(i, e) per request that fails alone, the rest go on
                                   False: on_error(i, e) for each request of a failed replica
    stop() and cancelled(i)        asked before each pass (in process) or every few milliseconds
                                   while the workers run (they leave a cancelled request out of
                                   every pass after the one under way): cancelled(i) True drops
                                   request i (slot None), stop() True ends the run (RunStopped)
    executor.in_process            True:  the model runs here (loading.update copies into it);
                                   False: worker processes hold the weights (stage_weights, end_weights)
    executor.close()               stop the workers (a no-op in process)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from ..config import EngineConfig
from ..engine.request import RequestResult, ScoreRequest


@runtime_checkable
class Executor(Protocol):
    per_request_errors: bool
    in_process: bool

    @property
    def config(self) -> EngineConfig: ...

    @config.setter
    def config(self, config: EngineConfig) -> None: ...

    def run(self, requests: list[ScoreRequest], on_result: Callable[[int, RequestResult], None] | None = None,
            progress: bool | None = None, *, on_error: Callable[[int, Exception], None] | None = None,
            stop: Callable[[], bool] | None = None,
            cancelled: Callable[[int], bool] | None = None) -> list[RequestResult]: ...

    def close(self) -> None: ...
