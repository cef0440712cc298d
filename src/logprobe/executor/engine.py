"""The engine of a parallel Scorer: replicas of tensor-parallel worker groups behind the
``Engine.run`` interface (requests in, results in input order, ``on_result`` as they complete).

Data parallelism spreads requests over the replicas by ``assign_replicas`` (pure; requests with
a common leading run of ids stay together so their prefix is still shared), runs the replicas
at once and merges the results. In deterministic mode a request's numbers do not depend on its
companions, so they are bitwise the same whichever replica ran it and whatever the TP size.

A run given ``cancelled`` or ``stop`` (the server's) is watched: while the replicas run, the
driver asks them every ``WATCH_S`` seconds, and sends the replica of a request that became
cancelled a ``Cancel``; its ranks leave it out of every pass after the one under way
(``workers.Watch``), so a client that goes away costs at most one more pass of a long request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from multiprocessing import connection

import torch

from ..config import EngineConfig, check_tp_invariance, resolve_device
from ..engine.budget import agreed_budget, resolved_budget
from ..engine.request import RequestResult, ScoreRequest
from ..engine.runner import Engine, RunStopped
from ..errors import LogprobeError
from ..loading.dummy import check_load_format
from ..loading.loader import (
    LoadedModel,
    default_expert_parallel,
    describe_model,
    load_shard,
    parallel_context,
)
from ..loading.sharding import expert_placement
from ..parallel.context import ParallelContext
from .messages import EndWeights, Profiled, Result, StageWeights
from .profile import RankProfile
from .workers import FitsAgreement, LaunchSpec, WorkerDied, WorkerGroup, control_group, default_threads, recv

# a watched run's cancellations are looked for this often (a pass of a long request takes longer)
WATCH_S = 0.02


def assign_replicas(inputs: list[list[int]], replicas: int, key_len: int = 16) -> list[list[int]]:
    """Request indices per replica. Requests whose first ``key_len`` ids agree form one group;
    groups go, largest (tokens) first, to the replica with the fewest tokens so far (ties: the
    lower replica). Each replica's list is in input order.

        inputs tokens 10, 10, 30, 5 with keys A, A, B, C; 2 replicas:
        groups B (30) -> r0, A (20) -> r1, C (5) -> r1      =>  [[2], [0, 1, 3]]
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, ids in enumerate(inputs):
        groups.setdefault(tuple(ids[:key_len]) if len(ids) >= key_len else ("solo", i), []).append(i)
    order = sorted(groups.values(), key=lambda g: (-sum(len(inputs[i]) for i in g), g[0]))
    load = [0] * replicas
    out: list[list[int]] = [[] for _ in range(replicas)]
    for g in order:
        r = min(range(replicas), key=lambda j: (load[j], j))
        out[r].extend(g)
        load[r] += sum(len(inputs[i]) for i in g)
    return [sorted(x) for x in out]


class ParallelEngine:
    """``dp`` replicas of ``tp`` worker processes each (GPUs ``replica * tp .. + tp - 1``); an
    ``executor.interface.Executor``."""

    per_request_errors = False  # a replica's error is reported for each of its requests
    in_process = False  # the workers hold the weights: stage_weights / end_weights update them
    weights_refusal: Exception | None = None  # raised by ``run`` while set (``Scorer``: in-place updates)

    def __init__(self, model: str | None, device: str, dtype: str, config: EngineConfig, tp: int, dp: int,
                 ep: int = 1, attention: str = "tensor", launched: list[WorkerGroup] | None = None,
                 load_format="auto", placement=None) -> None:
        """``launched``: the replicas' processes already spawned (``parallel_parts`` starts them
        before it reads the model), else spawned here. ``placement``: replicas of hot experts
        (``parallel.placement``), the same in every replica. ``load_format``: ``loader.load_shard``'s."""
        self.tp, self.dp, self.ep = tp, dp, ep
        self.device_type = device  # "cuda": rank r of replica g runs on GPU g * tp + r
        self.placement = placement
        self.attention = attention  # the layout of attention and dense layers (ParallelContext.attention)
        self.groups: list[WorkerGroup] = list(launched) if launched is not None else []
        threads = default_threads(tp * dp) if device == "cpu" else 1
        try:
            if launched is None:
                self.groups = [WorkerGroup(tp, r) for r in range(dp)]
            for r, group in enumerate(self.groups):
                group.start(LaunchSpec(model, device, dtype, config, tp, r, r * tp, threads=threads, ep=ep,
                                       attention=attention, placement=placement, load_format=load_format))
        except BaseException:
            self.close()
            raise
        # every replica runs the driver's config; left unset, the budget is the smallest replica's
        self.start_budget = config.max_batch_tokens or min(g.budget for g in self.groups)
        self._config = resolved_budget(config, self.start_budget)

    @property
    def config(self) -> EngineConfig:
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        """As ``Engine.config``: ``max_batch_tokens=None`` keeps the budget the replicas agreed at start."""
        self._config = resolved_budget(config, self.start_budget)

    def run(self, requests: list[ScoreRequest], on_result: Callable[[int, RequestResult], None] | None = None,
            progress: bool | None = None, *, on_error: Callable[[int, Exception], None] | None = None,
            stop: Callable[[], bool] | None = None,
            cancelled: Callable[[int], bool] | None = None) -> list[RequestResult]:
        """As ``Engine.run``: ``stop`` and ``cancelled`` are asked before the requests go to the
        workers (a cancelled request is not sent) and then while they run (the run is watched):
        a request cancelled meanwhile gets no pass after the one under way, its slot stays None
        and neither ``on_result`` nor ``on_error`` hears of it; ``stop()`` cancels every request
        not yet done, and once the replicas have stopped (one pass) raises ``RunStopped``.
        ``on_error``: a replica's error is reported for each of its requests that got no result
        (their slots stay None) instead of being raised."""
        if self.weights_refusal is not None:
            raise self.weights_refusal
        keep = [i for i in range(len(requests)) if cancelled is None or not cancelled(i)]
        if len(keep) < len(requests):
            out: list[RequestResult | None] = [None] * len(requests)
            sub = self.run([requests[i] for i in keep],
                           None if on_result is None else lambda k, r: on_result(keep[k], r), progress,
                           on_error=None if on_error is None else lambda k, e: on_error(keep[k], e), stop=stop,
                           cancelled=None if cancelled is None else lambda k: cancelled(keep[k]))
            for k, r in zip(keep, sub):
                out[k] = r
            return out  # type: ignore[return-value]
        if not all(g.alive for g in self.groups):
            raise LogprobeError("tensor_parallel_size", "a worker of this scorer has died", "create a new Scorer")
        if stop is not None and stop():
            raise RunStopped()
        parts = assign_replicas([r.inputs for r in requests], self.dp, self.config.min_shared_prefix) \
            if self.dp > 1 else [list(range(len(requests)))]
        run = _Run(requests, on_result, stop, cancelled)
        for g, idx in zip(self.groups, parts):
            if idx:
                g.submit([requests[i] for i in idx], self.config, watched=run.watched)
                run.live[g] = (idx, g.messages())
        run.wait()
        if run.stopped and run.gone:
            raise RunStopped()
        if run.error is not None:
            if on_error is None or isinstance(run.error, WorkerDied):
                raise run.error
            for i, r in enumerate(run.results):
                if r is None and i not in run.gone:
                    on_error(i, run.error)
        return run.results  # type: ignore[return-value]

    @property
    def passes(self) -> int:
        """Forward passes the replicas have computed (rank 0 of each; live during a watched run)."""
        return sum(g.passes for g in self.groups)

    @property
    def oom_count(self) -> int:
        """Out-of-memory errors the replicas' ranks agreed on and split around (as ``Engine.oom_count``;
        rank 0 of each, counted when each run ends)."""
        return sum(g.oom_count for g in self.groups)

    def profile(self, requests: list[ScoreRequest]) -> tuple[list[RequestResult], list[RankProfile]]:
        """``run(requests)`` once with every worker under ``torch.profiler`` -> (the results, each
        rank's ``executor.profile.RankProfile`` in rank order). One replica only: the question it
        answers is where one replica's ranks spend a pass (``bench/gpu_moe_parallel.py --profile``)."""
        if self.dp != 1:
            raise LogprobeError("data_parallel_size", f"profiling runs one replica, this scorer has {self.dp}",
                                "profile a Scorer with data_parallel_size=1")
        if not all(g.alive for g in self.groups):
            raise LogprobeError("tensor_parallel_size", "a worker of this scorer has died", "create a new Scorer")
        group, results, ranks = self.groups[0], [None] * len(requests), []
        group.submit(requests, self.config, profiled=True)
        for msg in group.messages():
            match msg:
                case Result(index, result):
                    results[index] = result
                case Profiled(profile):
                    ranks.append(profile)
        return results, sorted(ranks, key=lambda p: p.rank)  # type: ignore[return-value]

    def stage_weights(self, rank: int, pairs: list) -> None:
        """Hand rank ``rank`` of every replica its slices of new weights (``loading.update``). A
        slice on a GPU is copied to the rank's GPU first (over NVLink where there is one) and
        reaches the worker by CUDA IPC (``workers.MessagePickler``): a handle, not its bytes."""
        for r, g in enumerate(self.groups):
            if self.device_type == "cuda" and any(v.is_cuda for _, v in pairs):
                gpu = torch.device("cuda", r * self.tp + rank)
                sent = [(name, v.to(gpu, copy=True) if v.is_cuda else v) for name, v in pairs]
            else:
                sent = pairs
            g.broadcast(StageWeights(sent), rank)

    def end_weights(self, commit: bool, whole: bool = True) -> None:
        """Every worker confirms its staged weights (``whole``: and that they cover its shard; else
        they are a part of an update), then all copy them in; or all drop them. A worker's error
        drops them everywhere and is raised."""
        if commit:
            try:
                self._everyone(EndWeights("prepare" if whole else "prepare part"))
            except BaseException:
                self._everyone(EndWeights("abort"))
                raise
        self._everyone(EndWeights("commit" if commit else "abort"))

    def _everyone(self, msg: EndWeights) -> None:
        for g in self.groups:
            g.broadcast(msg)
        error = None
        for g in self.groups:
            try:
                for _ in g.messages():
                    pass
            except LogprobeError as e:
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        for g in self.groups:
            g.close()
        self.groups = []

    @property
    def param_bytes(self) -> list[list[int]]:
        """Bytes of parameters held by each rank of each replica."""
        return [g.param_bytes for g in self.groups]


class _Run:
    """One ``ParallelEngine.run`` under way: the replicas still running (``live``: group -> (its
    request indices, its ``messages()``)), the results as they come, and, when watched, the
    requests cancelled meanwhile (``gone``)."""

    def __init__(self, requests: list[ScoreRequest], on_result, stop, cancelled) -> None:
        self.results: list[RequestResult | None] = [None] * len(requests)
        self.on_result, self.stop, self.cancelled = on_result, stop, cancelled
        self.watched = stop is not None or cancelled is not None
        self.live: dict[WorkerGroup, tuple[list[int], object]] = {}
        self.gone: set[int] = set()
        self.stopped = False
        self.error: LogprobeError | None = None

    def wait(self) -> None:
        """Until every replica is done: take each message as it comes; when watched, look for
        cancellations at least every ``WATCH_S`` seconds."""
        while self.live:
            ready = connection.wait([c for g in self.live for c in g.conns] +
                                    [p.sentinel for g in self.live for p in g.procs],
                                    timeout=WATCH_S if self.watched else None)
            if self.watched:
                self.watch()
            for g in [g for g in list(self.live) if any(c in ready for c in g.conns + [p.sentinel for p in g.procs])]:
                self.take(g)

    def take(self, g: WorkerGroup) -> None:
        """The next message of replica ``g``: a result (not delivered when its request is gone)."""
        idx, it = self.live[g]
        try:
            msg = next(it)
        except StopIteration:
            del self.live[g]
            return
        except LogprobeError as e:  # this replica is done (or dead); let the others finish
            self.error = self.error or e
            del self.live[g]
            return
        if msg is None or idx[msg.index] in self.gone:
            return
        i = idx[msg.index]
        self.results[i] = msg.result
        if self.on_result is not None:
            self.on_result(i, msg.result)

    def watch(self) -> None:
        """Send each replica the requests of its that became cancelled (all of them once ``stop()``)."""
        if not self.stopped and self.stop is not None and self.stop():
            self.stopped = True
        for g, (idx, _) in self.live.items():
            new = [k for k, i in enumerate(idx) if self.results[i] is None and i not in self.gone
                   and (self.stopped or (self.cancelled is not None and self.cancelled(i)))]
            if new:
                self.gone.update(idx[k] for k in new)
                try:
                    g.cancel(new)
                except OSError:  # a worker is gone: its replica's messages() says so
                    pass


__all__ = ["ParallelEngine", "assign_replicas", "recv"]


def parallel_parts(model, device, dtype, config: EngineConfig, tp: int, dp: int, ep: int | None = None,
                   attention: str | None = None, load_format="auto", redundant: int = 0, loads=None):
    """(LoadedModel without weights, engine, device) of a Scorer over ``tp`` x ``dp`` ranks, the
    experts of each replica in ``ep`` groups (``ParallelContext.experts``; None: the model's
    default, ``loader.default_expert_parallel``), attention laid out as ``attention`` says
    ("data" or "tensor", ``loader.attention_layout``; None: the model's default); ``redundant``
    replicas of hot experts per rank, placed by ``loads`` (``sharding.expert_placement``); ``load_format``:
    "auto" or "dummy" (``loader.load_shard``: each rank's shard at random)."""
    import torch


    for name, n in (("tensor_parallel_size", tp), ("data_parallel_size", dp), ("expert_parallel_size", ep or 1)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise LogprobeError(name, f"must be a positive integer, got {n!r}")
    check_load_format(load_format)  # a bad value refused here, before any worker starts
    if isinstance(model, LoadedModel):
        raise LogprobeError("model", "a loaded model cannot be split across processes",
                            "pass the model's name or path with tensor_parallel_size / data_parallel_size")
    dev = resolve_device(device)
    if dev.type == "cuda" and tp * dp > torch.cuda.device_count():
        raise LogprobeError("tensor_parallel_size", f"{tp} x {dp} ranks need {tp * dp} GPUs, this machine has "
                            f"{torch.cuda.device_count()}", "use fewer ranks")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dp == 1:  # torchrun: this process is one rank
        if dist.get_world_size() != tp:
            raise LogprobeError("tensor_parallel_size", f"{tp} does not match the initialised process group's "
                                f"{dist.get_world_size()} ranks", "pass the world size")
        rank = dist.get_rank()
        cfg = describe_model(model, device, dtype).model.config
        ep = default_expert_parallel(cfg, tp) if ep is None else ep
        placement = expert_placement(cfg, tp, ep, redundant, loads)
        local = torch.device(f"cuda:{torch.cuda.current_device()}") if dev.type == "cuda" else dev
        loaded = load_shard(model, ParallelContext(rank, tp, dist.group.WORLD, experts=ep, attention=attention,
                                                   placement=placement),
                            local, dtype, load_format=load_format)
        if config.max_batch_tokens is None:  # the ranks must plan the same passes: one budget for all
            config = replace(config, max_batch_tokens=agreed_budget(loaded.model, local))
        engine = Engine(loaded.model, config, local)
        control = control_group(tp, dev.type)
        if control is not None:  # out of memory before a pass: every rank splits alike (workers.FitsAgreement)
            engine.agree_fits = FitsAgreement(control)
        return loaded, engine, local
    # the workers start (import torch and the package) while this process reads the model
    launched = [WorkerGroup(tp, r) for r in range(dp)]
    try:
        loaded = describe_model(model, device, dtype)
        ep = default_expert_parallel(loaded.model.config, tp) if ep is None else ep
        # a size that cannot split the model fails here, before any shard is read; the layout resolved
        ctx = parallel_context(loaded.model.config, 0, tp, None, ep, attention)
        check_tp_invariance(config, tp, ctx.blocks)  # a fixed deterministic config fails here, not at a request
        placement = expert_placement(loaded.model.config, tp, ep, redundant, loads)
        dt = str(dtype).removeprefix("torch.") if dtype is not None else "auto"
        engine = ParallelEngine(model, dev.type, dt, config, tp, dp, ep, ctx.attention or "tensor", launched,
                                load_format, placement=placement)
    except BaseException:
        for group in launched:
            group.close()
        raise
    return loaded, engine, dev
