"""Prometheus metrics, one registry per app (no process-global state)."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from .batcher import Batcher, StepStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def _cuda_bytes(kind: str) -> float:
    """Bytes the CUDA caching allocator holds (``kind``: allocated or reserved); 0 before CUDA starts."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0.0
    return float(torch.cuda.memory_allocated() if kind == "allocated" else torch.cuda.memory_reserved())


class Metrics:
    def __init__(self, engine=None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("logprobe_http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("logprobe_http_request_seconds", "HTTP request latency", ["endpoint"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens_scored = Counter("logprobe_tokens_scored", "Token log-probs returned by the engine",
                                     registry=r)
        self.tokens_input = Counter("logprobe_tokens_input", "Tokens fed through the model", registry=r)
        self.queue_jobs = Gauge("logprobe_queue_requests", "HTTP requests waiting or running in the engine",
                                registry=r)
        self.queue_tokens = Gauge("logprobe_queue_tokens", "Input tokens waiting or running in the engine",
                                  registry=r)
        self.batch_requests = Histogram("logprobe_batch_requests", "Scoring requests per engine step",
                                        buckets=_SIZE_BUCKETS, registry=r)
        self.batch_jobs = Histogram("logprobe_batch_http_requests", "HTTP requests sharing one engine step",
                                    buckets=_SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram("logprobe_batch_tokens", "Input tokens per engine step",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self.dropped = Counter("logprobe_requests_dropped", "HTTP requests dropped unanswered, their work "
                               "stopped, by reason (disconnected, timeout, shutdown)", ["reason"], registry=r)
        for reason in ("disconnected", "timeout", "shutdown"):
            self.dropped.labels(reason)
        self.step_seconds = Histogram("logprobe_engine_step_seconds", "Time of one engine step",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        # memory and out-of-memory recoveries, read when scraped (the soak benchmark checks that
        # memory returns to its starting level and counts the splits it caused)
        for kind in ("allocated", "reserved"):
            Gauge(f"logprobe_cuda_memory_{kind}_bytes", f"CUDA memory {kind} by this process's caching allocator",
                  registry=r).set_function(lambda kind=kind: _cuda_bytes(kind))
        Gauge("logprobe_gc_frozen_objects", "Objects left out of the garbage collector's scans "
              "(`logprobe serve` freezes what exists once the model is loaded)",
              registry=r).set_function(gc.get_freeze_count)
        inner = getattr(engine, "inner", engine)  # the engine behind the result cache (``executor.cached``)
        if hasattr(inner, "passes"):  # Engine and ParallelEngine
            r.register(_Passes(inner))
        if engine is not None and hasattr(engine, "oom_count"):  # Engine and ParallelEngine
            Gauge("logprobe_engine_out_of_memory", "Out-of-memory errors the engine met and split around",
                  registry=r).set_function(lambda: float(engine.oom_count))
        cache = getattr(engine, "prefix_cache", None)  # engine.prefix_cache, when on
        if cache is not None:
            for name, key, text in (
                    ("bytes", "bytes", "Bytes the prefix cache holds"),
                    ("max_bytes", "max_bytes", "The prefix cache's byte budget"),
                    ("hit_rate", "hit_rate", "Input tokens read from the prefix cache / input tokens looked up"),
                    ("lookups", "lookups", "Requests looked up in the prefix cache"),
                    ("hits", "hits", "Requests resumed from a cached prefix"),
                    ("cached_tokens", "cached_tokens", "Input tokens read from the prefix cache, not computed"),
                    ("lookup_tokens", "lookup_tokens", "Input tokens of the requests looked up"),
                    ("evicted_tokens", "evicted_tokens", "Tokens evicted from the prefix cache")):
                Gauge(f"logprobe_prefix_cache_{name}", text, registry=r).set_function(
                    lambda key=key: float(cache.stats.as_dict()[key]))

    def watch(self, batcher: Batcher) -> None:
        """``logprobe_engine_busy``: 1 while the batcher's engine step runs (a client that went
        away leaves it 0 within one pass), read when scraped."""
        Gauge("logprobe_engine_busy", "1 while an engine step runs, else 0",
              registry=self.registry).set_function(lambda: float(batcher.busy))

    def observe_step(self, s: StepStats) -> None:
        self.batch_requests.observe(s.requests)
        self.batch_jobs.observe(s.jobs)
        self.batch_tokens.observe(s.tokens)
        self.step_seconds.observe(s.seconds)
        self.tokens_input.inc(s.tokens)
        self.tokens_scored.inc(s.scored)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Passes:
    """``logprobe_engine_passes_total``: forward passes the engine has computed, read when scraped
    (a counter the engine keeps: ``Engine.passes``, ``ParallelEngine.passes``)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        yield CounterMetricFamily("logprobe_engine_passes", "Forward passes the engine has computed",
                                  value=float(self.engine.passes))
