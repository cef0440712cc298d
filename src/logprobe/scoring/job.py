"""``Job``: a method's engine requests and how to turn their results into its answer; and
``ScorerParts``, what building a job reads from the ``Scorer``.

The job builders (``scoring.continuations``, ``sequences``, ``perplexity``, ``states``,
``compare``) take the scorer as ``ScorerParts`` rather than importing ``scorer``, which imports
them: ``Scorer.perplexity_job(texts)`` is ``scoring.perplexity.perplexity_job(scorer, texts)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..engine.request import RequestResult, ScoreRequest

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..interp.specs import CaptureSpec, SteerSpec
    from ..tokenizer import Tokenizer


@dataclass(slots=True)
class Job:
    """Engine requests and how to turn their results into the method's answer.

    ``Scorer.score(...)`` is ``job = Scorer.score_job(...)`` then ``job.finish(engine.run(job.requests))``;
    the server runs the requests of many jobs in shared batches and finishes each job on its own.
    """

    requests: list[ScoreRequest]
    finish: Callable[[list[RequestResult]], Any]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_inputs for r in self.requests)


class ScorerParts(Protocol):
    """The parts of a ``Scorer`` the job builders use (typed loosely where the type lives above
    ``scoring`` in the pipeline)."""

    tokenizer: Tokenizer
    info: Any  # loading.ModelInfo: name, backend, vocab_size, max_length
    config: EngineConfig
    engine: Any  # engine.runner.Engine, or the parallel engine of worker processes
    loaded: Any  # loading.LoadedModel: .model for hook points and depth

    def hook_specs(self, capture, steer) -> tuple[list[CaptureSpec], list[SteerSpec]]: ...

    def check_ids(self, ids, name: str) -> list[int]: ...
