"""The messages between the driver and its worker processes (``executor.workers``): small
frozen records, pickled whole and read with ``match``. They live in their own module so that both
sides name them ``logprobe.executor.messages.X`` (a worker runs ``executor.workers`` as
``__main__``, whose classes the driver could not unpickle).

    driver -> worker : Run(requests, config, watched) | Profile(requests, config) | StageWeights(pairs)
                       | EndWeights(step) | Close(); during a watched run, Cancel(indices)
    worker -> driver : Ready(param_bytes, load_peak_bytes, budget, frozen) once, then per run
                       Results([Result(index, result), ...], passes)... (rank 0, a pass's results
                       each; a watched run: also after a pass that delivered none),
                       Profiled(profile) (every rank, after a Profile) and Done(passes, oom_count) |
                       Failed(field, problem, fix, fatal)

>>> match Failed("model", "no such file", "check the path"):
...     case Failed() as f:
...         str(f.error())
'model: no such file; check the path'
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfig
from ..errors import LogprobeError
from .profile import RankProfile

# driver -> worker


@dataclass(frozen=True, slots=True)
class Run:
    """Run ``requests`` under the driver's ``config`` of this run (e.g. deterministic on or off).
    ``watched``: the driver may cancel requests while it runs (``Cancel``): the ranks read and
    agree on the cancellations between passes, and rank 0 reports each pass (``Results``)."""

    requests: list
    config: EngineConfig
    watched: bool = False


@dataclass(frozen=True, slots=True)
class Cancel:
    """Requests ``indices`` of the watched run under way are cancelled: none of their passes
    after the one under way is computed, and their results are not sent. Sent to every rank of
    the replica; one that arrives after the run ended is ignored."""

    indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Profile:
    """As ``Run``, under ``torch.profiler``: each rank answers ``Profiled`` before its ``Done``
    (``executor.profile``; a measuring tool, never on the scoring path)."""

    requests: list
    config: EngineConfig


@dataclass(frozen=True, slots=True)
class StageWeights:
    """Stage these ``(name, slice)`` pairs of new weights (``loading.update``); no answer."""

    pairs: list


@dataclass(frozen=True, slots=True)
class EndWeights:
    """"prepare" (check every staged slice arrived and converted, and that they cover the shard),
    "prepare part" (the same for a part of an update: not the cover), "commit" (copy them in) or
    "abort" (drop them); answered ``Done`` or ``Failed``."""

    step: str


@dataclass(frozen=True, slots=True)
class Close:
    pass


# worker -> driver


@dataclass(frozen=True, slots=True)
class Ready:
    """The shard is loaded: its parameter bytes, the growth of the peak RSS while loading it, the
    group's ``max_batch_tokens`` (the same on every rank) and the objects the worker then left
    out of garbage collection (``workers.freeze_heap``)."""

    param_bytes: int
    load_peak_bytes: int
    budget: int
    frozen: int = 0


@dataclass(frozen=True, slots=True)
class Result:
    """Request ``index`` of the current run is done (rank 0 only)."""

    index: int
    result: object


@dataclass(frozen=True, slots=True)
class Results:
    """Rank 0's ``Result`` records of one pass, in the order the engine delivered them: one
    message a pass instead of one a request (``workers.Outbox``); ``passes``: the forward passes
    its engine has computed so far (``Engine.passes``, since the worker started)."""

    items: list
    passes: int = 0


@dataclass(frozen=True, slots=True)
class Profiled:
    """This rank's ``executor.profile.RankProfile`` of the run a ``Profile`` asked for."""

    profile: RankProfile


@dataclass(frozen=True, slots=True)
class Done:
    """A run, or a weight step, is over; after a run ``passes`` is as in ``Results`` and
    ``oom_count`` is the engine's ``Engine.oom_count`` (since the worker started; the same on
    every rank of a replica: its ranks agree on each out-of-memory before a pass)."""

    passes: int | None = None
    oom_count: int | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """The run or step failed on this rank. ``fatal``: this rank has left the replica's lockstep
    (out of memory inside a pass, while the others wait in its collectives): the driver stops the
    replica at once instead of waiting for the other ranks."""

    field: str
    problem: str
    fix: str
    fatal: bool = False

    def error(self) -> LogprobeError:
        return LogprobeError(self.field, self.problem, self.fix)
