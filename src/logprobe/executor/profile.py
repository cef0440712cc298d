"""Where a pass's time goes on each rank: one engine run under ``torch.profiler``, folded into a
small per-rank summary that travels back to the driver (``messages.Profile`` / ``Profiled``).

Why a message to the workers, not the ranks as threads of one process: the question is what the
real multi-GPU run does, and only the worker processes run it (NCCL between processes, one CUDA
context each, each rank's own Python thread launching its kernels). Ranks as threads share one
interpreter lock and exchange collectives through memory (``tests/tp_threads.py``), so their
launch overheads and collective times would be those of another program. The profiler therefore
runs inside each worker, around the same ``Engine.run`` a ``Run`` message makes, and only a
compact summary crosses the socket: per kernel name its calls and total time, and each
collective's duration in launch order (a few numbers per layer and batch), never a trace.

What is counted (``RankProfile``):

* on CUDA, the device's kernels, copies and memsets (CUPTI; no CPU ops are recorded, which keeps
  the profiler's own overhead to the launches); on CPU (gloo), each op's self time on the calling
  thread and each gloo collective's time on gloo's own thread;
* ``wall_s``: the run on this rank, from the first launch to the device being idle again;
* ``busy_s``: the time at least one counted event ran (the union of their intervals: on CUDA, the
  time the GPU was busy; ``wall_s - busy_s`` is the time it sat idle, waiting for launches or for
  a host synchronisation); a one-element add on the device as the run starts and another as it
  returns bracket the run, so the longest idle spans (``gaps``) include the host's planning
  before the first kernel and its delivery of results after the last;
* ``collectives``: each collective's duration in launch order. Every rank joins every collective
  in the same order, so call i is the same collective on every rank; it ends at about the same
  moment everywhere, so the rank that arrived last waited least, and its duration is the
  transfer. ``waits`` charges each rank the rest: sum over calls of (its duration - the shortest
  rank's). Worked example, two calls on two ranks, durations (5, 2) us and (1, 4) us: rank 0
  waited 5 - 1 = 4 and 2 - 2 = 0, rank 1 0 and 2, so ``waits`` gives (4.0, 2.0);
* ``rows`` and ``pairs``: the rows this rank ran through its blocks and the (query, key) pairs its
  attention computed, read from the model's own cut of each pass (``ScoringModel.row_split``,
  ``AttentionMeta.share``): the rank's share of the batch under data-parallel attention, every row
  otherwise (``attention_pairs``).

>>> waits([RankProfile(0, 1.0, (), (("all-gather", 5.0), ("all-gather", 2.0))),
...        RankProfile(1, 1.0, (), (("all-gather", 1.0), ("all-gather", 4.0)))])
(4.0, 2.0)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ..config import EngineConfig
from ..engine.request import RequestResult, ScoreRequest
from ..engine.runner import Engine
from ..layers.attention import Segment

COLLECTIVES = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce", "broadcast")
# kernel families, in the order the first matching rule wins: (family, lower-case name fragments)
FAMILY_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("all-gather", ("allgather", "all_gather")),
    ("reduce-scatter", ("reducescatter", "reduce_scatter")),
    ("all-to-all", ("sendrecv", "alltoall", "all_to_all")),
    ("all-reduce", ("allreduce", "all_reduce")),
    ("broadcast", ("broadcast",)),
    ("head", ("_head_partials", "_target_logit", "logprob_head")),
    ("gated-delta", ("gated_delta", "chunk_fwd", "chunk_local", "chunk_scaled_dot", "kkt", "solve_tril",
                     "merge_16x16", "recompute_w_u", "wy_fast", "l2norm", "fused_recurrent")),  # fla's kernels
    ("conv", ("conv1d", "_conv_kernel", "_final_kernel", "convolution")),
    ("moe", ("_gate_up_kernel", "_down_kernel", "_combine_kernel", "_combine_rows_kernel", "fused_moe")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),  # before routing: flash kernels say softmax
    ("routing", ("topk", "sort", "scan", "bincount", "histogram", "nonzero", "deviceselect", "softmax")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "cublas", "xmma", "wgmma", "splitk", "matmul", "_scaled_mm",
              "_w4a16", "_expand", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),  # _expand*: GGUF / W4
    ("copy", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")),  # a copy functor's elementwise
    ("elementwise", ("elementwise", "vectorized", "reduce", "norm", "rotary", "rope", "silu", "gelu", "sigmoid",
                     "softplus", "quantize", "fill", "functor", "triton_", "aten::")),
)


def kernel_family(name: str) -> str:
    """The family of a kernel (CUDA) or op (CPU) name: a collective, ``head``, ``gated-delta``
    (fla's chunk kernels), ``conv`` (the short conv), ``moe`` (the fused expert kernels),
    ``attention``, ``routing`` (top-k, sorts, scans, softmax), ``gemm``,
    ``copy`` (copies, memsets, gathers and scatters), ``elementwise``, or ``other``.

    >>> [kernel_family(n) for n in ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "ncclDevKernel_SendRecv",
    ...  "gloo:all_gather", "_gate_up_kernel", "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "Memcpy DtoD (Device -> Device)",
    ...  "void at::native::sbtopk::gatherTopK<float>", "aten::addmm", "_rmsnorm", "mystery")]
    ['reduce-scatter', 'all-to-all', 'all-gather', 'moe', 'gemm', 'copy', 'routing', 'gemm', 'elementwise', 'other']
    """
    low = name.lower()
    for family, parts in FAMILY_RULES:
        if any(p in low for p in parts):
            return family
    return "other"


@dataclass(frozen=True, slots=True)
class RankProfile:
    """One rank's profiled run: ``kernels`` are (name, calls, total us), largest first;
    ``collectives`` (family, us) in launch order; ``rows`` / ``pairs`` as the module says."""

    rank: int
    wall_s: float
    kernels: tuple[tuple[str, int, float], ...]
    collectives: tuple[tuple[str, float], ...]
    rows: int = 0
    pairs: int = 0
    busy_s: float = 0.0
    host_waits: tuple[tuple[str, int, float], ...] = ()  # (CUDA runtime call, calls, us): ``host_waits``
    gaps: tuple[tuple[float, float, str, str], ...] = ()  # the GPU's longest idle spans: ``idle_gaps``
    small_gaps_us: float = 0.0  # idle time in spans shorter than ``idle_gaps``'s threshold (launch-bound)

    def families(self) -> dict[str, float]:
        """Total us per ``kernel_family``, largest first."""
        out: dict[str, float] = {}
        for name, _, us in self.kernels:
            out[kernel_family(name)] = out.get(kernel_family(name), 0.0) + us
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def waits(ranks: list[RankProfile], family: str | None = None) -> tuple[float, ...] | None:
    """Us each rank waited in collectives (see the module docstring), in those of ``family`` only
    if given; None if the ranks did not record the same collectives in the same order (then no
    call can be matched).

    >>> a = RankProfile(0, 1.0, (), (("all-gather", 5.0), ("reduce-scatter", 2.0)))
    >>> b = RankProfile(1, 1.0, (), (("all-gather", 1.0), ("reduce-scatter", 4.0)))
    >>> waits([a, b], "reduce-scatter")
    (0.0, 2.0)
    """
    kinds = [tuple(k for k, _ in r.collectives) for r in ranks]
    if any(k != kinds[0] for k in kinds):
        return None
    calls = [c for k, c in zip(kinds[0], zip(*[[us for _, us in r.collectives] for r in ranks]))
             if family is None or k == family]  # [calls][ranks]
    return tuple(round(sum(c[i] - min(c) for c in calls), 3) for i in range(len(ranks)))


def attention_pairs(segments: list[Segment]) -> int:
    """The (query, key) pairs causal attention computes over packed segments: a segment of n rows
    reading c context keys (a shared prefix) attends n·c + n(n + 1)/2 of them (about L²/2 for a
    lone sequence of L rows).

    >>> attention_pairs([Segment(0, 4), Segment(4, 6, ((0, 4),))])
    21
    """
    total = 0
    for s in segments:
        n = s.end - s.start
        total += n * s.num_context + n * (n + 1) // 2
    return total


def profile_run(engine: Engine, requests: list[ScoreRequest], config: EngineConfig, rank: int = 0,
                on_result: Callable[[int, RequestResult], None] | None = None,
                on_batch: Callable[[], None] | None = None) -> RankProfile:
    """``engine.run(requests)`` under ``config``, profiled -> this rank's ``RankProfile`` (the
    results go to ``on_result`` and ``on_batch`` as in an ordinary run)."""
    cuda = engine.device.type == "cuda"
    counts = [0, 0]  # rows, pairs of this rank's share of every pass
    handle = engine.model.register_forward_pre_hook(_share_counter(engine.model, counts))
    engine.config = config
    # a one-element add on the device as the run starts and as it returns: the idle spans then
    # include the host's time before the first kernel and after the last (``idle_gaps``)
    mark = torch.zeros(1, device=engine.device) if cuda else None
    try:
        _sync(cuda)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            _mark(mark)
            engine.run(requests, on_result=on_result, progress=False, on_batch=on_batch)
            _mark(mark)
            _sync(cuda)
            wall = time.perf_counter() - t
    finally:
        handle.remove()
    events = prof.events()
    kernels, collectives = summarise(events, cuda)
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in events
             if e.device_type == (DeviceType.CUDA if cuda else DeviceType.CPU)]
    busy = busy_union([(a, b) for a, b, _ in spans])
    gaps, small = idle_gaps(spans) if cuda else ((), 0.0)
    return RankProfile(rank, round(wall, 6), kernels, collectives, counts[0], counts[1], round(busy / 1e6, 6),
                       host_waits(events) if cuda else (), gaps, small)


def idle_gaps(spans: list[tuple[float, float, str]], at_least_us: float = 500.0, keep: int = 8
              ) -> tuple[tuple[tuple[float, float, str, str], ...], float]:
    """Where the device sat idle between its events (start us, end us, name): the ``keep`` longest
    spans of at least ``at_least_us`` as (offset from the first event's start us, length us, the
    event before, the event after), longest first, and the total us of the shorter ones (idle
    while the host launched: many small holes).

    >>> idle_gaps([(0, 10, "a"), (12, 20, "b"), (900, 950, "c")], at_least_us=100)
    (((20, 880, 'b', 'c'),), 2.0)
    """
    long, small, end, last, first = [], 0.0, None, "", None
    for a, b, name in sorted(spans):
        first = a if first is None else first
        if end is not None and a > end:
            if a - end >= at_least_us:
                long.append((round(end - first, 3), round(a - end, 3), last[:60], name[:60]))
            else:
                small += a - end
        if end is None or b > end:
            end, last = b, name
    return tuple(sorted(long, key=lambda g: -g[1])[:keep]), round(small, 3)


# CUDA runtime calls in which the host waits for the device: an explicit synchronisation, or a
# copy to or from pageable memory (``.tolist()``, ``.item()``, ``torch.tensor(..., device=)``),
# which PyTorch follows with a stream synchronisation
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def host_waits(events) -> tuple[tuple[str, int, float], ...]:
    """The host's blocking CUDA runtime calls among profiler events: (name, calls, total us),
    largest first. Each is a point where the host stopped launching until the GPU caught up (the
    profiled run's closing synchronisation is one of them); what the GPU then idles is the host's
    planning and launching after it. ``cudaMemcpyAsync`` counts only when PyTorch then
    synchronises (it is listed under that synchronisation)."""
    totals: dict[str, list] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name in BLOCKING_CALLS:
            entry = totals.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.elapsed_us()
    return tuple(sorted(((n, c, round(us, 3)) for n, (c, us) in totals.items()), key=lambda k: -k[2]))


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: the time at least one of them ran.

    >>> busy_union([(0, 4), (2, 5), (7, 8)])
    6
    """
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def _mark(mark: torch.Tensor | None) -> None:
    if mark is not None:
        mark.add_(1)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _share_counter(model, counts: list[int]):
    """A forward pre-hook adding each pass's rows and attention pairs on this rank to ``counts``:
    the model's own cut (``row_split``) of the pass's ``AttentionMeta``, or every row."""

    def hook(module, args):
        meta, hooks = args[2], (args[3] if len(args) > 3 else None)
        split = model.row_split(meta, hooks) if hasattr(model, "row_split") else None
        own = meta.share(split) if split is not None else meta
        counts[0] += own.num_rows
        counts[1] += attention_pairs(own.segments)

    return hook


def summarise(events, cuda: bool) -> tuple[tuple[tuple[str, int, float], ...], tuple[tuple[str, float], ...]]:
    """Profiler events -> ((name, calls, total us) largest first, (collective family, us) in launch
    order). On CUDA: device events only (kernels, copies, memsets). On CPU: synchronous ops by
    their self time, asynchronous ones (gloo's work on its own thread) by their duration."""
    totals: dict[str, list] = {}
    timed: list[tuple[float, str, float]] = []  # (start, family, us) of collectives
    for e in events:
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
        elif e.device_type != DeviceType.CPU:
            continue
        else:
            us = e.time_range.elapsed_us() if e.is_async else e.self_cpu_time_total
        family = kernel_family(e.name)
        if family in COLLECTIVES and (cuda or e.is_async):  # the collective's execution, not its launch
            timed.append((e.time_range.start, family, us))
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    kernels = tuple(sorted(((n, c, round(us, 3)) for n, (c, us) in totals.items()), key=lambda k: -k[2]))
    return kernels, tuple((f, round(us, 3)) for _, f, us in sorted(timed, key=lambda t: t[0]))
