"""Small passes as CUDA graph replays: the host's kernel launches replaced by a few replays.

A pass of a few hundred rows (one RL sample over its cached prompt, one multiple-choice answer)
takes the GPU less time than the host takes to launch its ~15 kernels a block, so the GPU idles.
Here the model's forward is captured once per token-count bucket (``graph_bucket``) as CUDA
graphs cut at each attention call: attention alone depends on the batch's layout (its segments,
shared prefixes, cached keys), so it runs eagerly between replays on the pass's own
``AttentionMeta``; everything else depends on the row count alone. The Qwen3.5 / Qwen3-Next
hybrids' linear-attention core (the short conv and the gated delta rule, scanned per segment from
its carried state) is cut out the same way (``layers.attention.GraphCut``).

    piece 0: embedding; block 0's norm, q/k/v, rotary             -> Q, K, V (static buffers)
    attention of block 0, eager, on the pass's meta               -> O (static buffer)
    piece 1: block 0's out-projection, residual, MLP; block 1's norm, q/k/v, rotary -> Q, K, V
    ...
    piece L: block L-1's out-projection, residual, MLP; the final norm  -> hidden [bucket, H]

A pass of T rows fills rows 0..T-1 of the static ids and positions; rows T..bucket-1 are padding
(an earlier pass's ids and positions) that no real row reads: outside attention every row is
computed from itself alone. In deterministic mode the products are fixed row tiles of
``Deterministic.cuda_tile`` rows whatever T is, so a replay is bitwise the eager pass
(tests/test_graphs.py on CPU through an emulated capture, tests/test_graphs_gpu.py on CUDA).

Not captured (the pass runs eagerly): hooks, images, tensor-parallel ranks (their collectives),
models that say no (``cuda_graphs``: LongRoPE, whose length check reads the positions), passes over
``EngineConfig.cuda_graph_tokens`` rows. A capture that fails turns graphs off for the engine
with one warning. New weights copied in place keep the graphs; weights moved to new memory (a
fresh load into the same model) drop them (``GraphRunner.check_weights``).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import astuple, dataclass
from functools import partial

import torch

from ..layers.attention import AttentionMeta

# the sizes a pass pads to: fine where small passes cluster (one sample over its cached prompt)
BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def graph_bucket(rows: int, limit: int) -> int | None:
    """The captured row count a pass of ``rows`` rows pads to: the smallest bucket that holds it,
    never over ``limit`` (``EngineConfig.cuda_graph_tokens``); None: the pass runs eagerly.

    >>> [graph_bucket(n, 2048) for n in (1, 16, 17, 300, 416, 2048, 2049, 0)]
    [16, 16, 32, 384, 512, 2048, None, None]
    >>> graph_bucket(900, 1000), graph_bucket(5000, 8192)   # the limit itself, not past the buckets
    (1000, None)
    """
    if rows < 1 or rows > limit:
        return None
    bucket = next((b for b in BUCKETS if b >= rows), None)
    return None if bucket is None else min(bucket, limit)


class CudaGraphs:
    """Real capture: ``torch.cuda.CUDAGraph`` pieces sharing one memory pool (they replay in the
    order they were captured, so a later piece may reuse an earlier one's dead intermediates),
    captured on a side stream. ``thread_local``: another thread's CUDA calls (the server's, the
    host overlap's copies) do not spoil a capture."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def capturing(self):
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def begin(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        return graph

    def end(self, graph: torch.cuda.CUDAGraph) -> torch.cuda.CUDAGraph:
        graph.capture_end()
        return graph

    def abort(self, graph: torch.cuda.CUDAGraph) -> None:
        with contextlib.suppress(RuntimeError):  # an invalidated capture ends with an error
            graph.capture_end()


@dataclass(slots=True)
class Cut:
    """One layout-dependent call between two pieces: its static inputs and output, and the call,
    ``call(*inputs, meta) -> out`` (``layers.attention.GraphCut``)."""

    inputs: tuple[torch.Tensor, ...]  # each [bucket, ...]
    out: torch.Tensor  # [bucket, ...]
    call: object


class BucketGraph:
    """The model's forward at one row count, captured as pieces cut at every layout-dependent call
    (attention; the hybrids' linear-attention core): module docstring."""

    def __init__(self, bucket: int, positions: torch.Tensor, device: torch.device) -> None:
        self.bucket = bucket
        self.ids = torch.zeros(bucket, dtype=torch.long, device=device)
        # [..., bucket]: a multimodal rotary's [3, T] as well; arange, so the padding is valid
        shape = (*positions.shape[:-1], bucket)
        self.positions = torch.arange(bucket, device=device).to(positions.dtype).expand(shape).contiguous()
        self.pieces: list = []
        self.cuts: list[Cut] = []
        self.hidden: torch.Tensor | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._outs: list[torch.Tensor] = []  # each cut's output buffer, in call order (the warm-up's)
        self._backend = None
        self._piece = None

    def capture(self, model, kv_block: int | None, backend) -> None:
        """One eager pass at this size first (kernels compiled and tuned, libraries' handles made
        on the capture stream, the static buffers allocated: an allocation while capturing would
        be zeroed again by every replay), then the capture."""
        self._backend = backend
        with backend.capturing():
            warm = AttentionMeta.packed([self.bucket], kv_block)
            warm.graph_cut = partial(self._probe, AttentionMeta.packed([self.bucket], kv_block))
            model(self.ids, self.positions, warm)
            meta = AttentionMeta.packed([self.bucket], kv_block)
            meta.graph_cut = self._cut
            self._piece = backend.begin()
            try:
                self.hidden = model(self.ids, self.positions, meta)  # [bucket, H], kept: the pool's
                self.pieces.append(backend.end(self._piece))
            except BaseException:
                backend.abort(self._piece)
                raise
            finally:
                self._piece = None

    def _probe(self, meta: AttentionMeta, call, *inputs: torch.Tensor) -> torch.Tensor:
        """The warm-up's cut: the buffers the capture will need, then the call itself."""
        for i, x in enumerate(inputs):
            self._buffer(i, x.shape, x.dtype, make=True)
        out = call(*inputs, meta)
        self._outs.append(self._buffer("out", out.shape, out.dtype, make=True))
        return out

    def _cut(self, call, *inputs: torch.Tensor) -> torch.Tensor:
        """While capturing: the inputs copied into static buffers at the end of this piece, the
        next piece begun, which reads the call's output from ``out``, whose shape the warm-up saw."""
        held = tuple(self._buffer(i, x.shape, x.dtype) for i, x in enumerate(inputs))
        for buf, x in zip(held, inputs):
            buf.copy_(x)
        self.pieces.append(self._backend.end(self._piece))
        self._piece = self._backend.begin()
        out = self._outs[len(self.cuts)]  # the warm-up's pass made the same calls in the same order
        self.cuts.append(Cut(held, out, call))
        return out

    def _buffer(self, role, shape, dtype: torch.dtype, make: bool = False) -> torch.Tensor:
        """One buffer per role (input i, or the output), shape and dtype, shared by every cut: cut
        i's inputs are read before piece i + 1 writes cut i + 1's, and its output read by piece
        i + 1 before cut i + 1 writes. Made in the warm-up (``make``), zeros: the padding rows of
        ``out`` are never undefined."""
        key = (role, tuple(shape), dtype)
        if key not in self._buffers:
            if not make:
                raise RuntimeError(f"a cut's {role} of shape {tuple(shape)} met while capturing, not in the warm-up")
            self._buffers[key] = torch.zeros(shape, dtype=dtype, device=self.ids.device)
        return self._buffers[key]

    def replay(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """The pass's final hidden rows [T, H], a tensor of its own (the static one is the next
        replay's). With a cache (``meta.cache``) the cuts get copies of their inputs: the cache
        keeps keys, values and states that may be views of them."""
        T = ids.shape[0]
        self.ids[:T].copy_(ids)
        self.positions[..., :T].copy_(positions)
        for piece, cut in zip(self.pieces, [*self.cuts, None]):
            piece.replay()
            if cut is None:
                break
            inputs = [x[:T] for x in cut.inputs]
            if meta.cache is not None:
                inputs = [x.clone() for x in inputs]
            cut.out[:T].copy_(cut.call(*inputs, meta))
        return self.hidden[:T].clone()


class GraphRunner:
    """One engine's captured buckets, keyed by the numerics they were captured under."""

    def __init__(self, model, limit: int, device: torch.device, backend=None) -> None:
        self.model = model
        self.limit = limit
        self.device = device
        self.backend = backend if backend is not None else CudaGraphs(device)
        self.graphs: dict[tuple, BucketGraph] = {}
        self.captures = 0  # buckets captured (a test's and the bench's count)
        self.capture_seconds = 0.0  # their time, warm-up passes included (first-score accounting)
        self.replays = 0
        self.failed: str | None = None  # why graphs are off for this engine, after a failed capture
        self._weights = self._weights_key()

    @staticmethod
    def for_engine(model, config, device: torch.device) -> GraphRunner | None:
        """The engine's runner, or None: graphs need CUDA, ``config.cuda_graph_tokens`` > 0 and a
        model that says it can be captured (``cuda_graphs``: one rank, no host reads in its forward)."""
        if device.type != "cuda" or config.cuda_graph_tokens == 0 or not getattr(model, "cuda_graphs", False):
            return None
        return GraphRunner(model, config.cuda_graph_tokens, device)

    def takes(self, rows: int, hooks, images) -> bool:
        """Whether a pass of ``rows`` rows replays graphs."""
        return (self.failed is None and hooks is None and images is None
                and graph_bucket(rows, self.limit) is not None)

    def check_weights(self) -> None:
        """Drop the graphs when a weight or buffer no longer lives where they read it (a call's start)."""
        key = self._weights_key()
        if key != self._weights:
            self.graphs.clear()
            self._weights = key

    def _weights_key(self) -> tuple:
        return tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta, numerics) -> torch.Tensor:
        graph = self._graph(graph_bucket(ids.shape[0], self.limit), positions, meta.kv_block, numerics)
        if graph is None:
            return self.model(ids, positions, meta)
        self.replays += 1
        return graph.replay(ids, positions, meta)

    def prepare(self, numerics, budget: int | None = None) -> int:
        """Capture every bucket a text pass can take (up to the limit, and to the engine's token
        ``budget``: no pass is larger) for ``Scorer.warmup``, so that no first small pass waits for
        its capture; returns how many were captured now."""
        before = self.captures
        positions = torch.zeros(1, dtype=torch.long)
        top = self.limit if budget is None else min(self.limit, budget)
        for bucket in sorted({graph_bucket(n, self.limit) for n in (*BUCKETS, top) if n <= top} - {None}):
            if self._graph(bucket, positions, numerics.attention_block, numerics) is None:
                break
        return self.captures - before

    def _graph(self, bucket: int, positions: torch.Tensor, kv_block: int | None, numerics) -> BucketGraph | None:
        """The bucket's graphs, captured now if they are not yet; None once a capture failed."""
        key = (bucket, tuple(positions.shape[:-1]), positions.dtype, astuple(numerics))
        graph = self.graphs.get(key)
        if graph is not None or self.failed is not None:
            return graph
        graph, start = BucketGraph(bucket, positions, self.device), time.perf_counter()
        try:
            graph.capture(self.model, kv_block, self.backend)
        except Exception as e:  # noqa: BLE001 - any failure: eager passes from now on, said once
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warnings.warn(f"CUDA graphs are off for this model: capturing a {bucket}-row pass failed "
                          f"({self.failed}); passes run eagerly (same numbers)", stacklevel=4)
            return None
        finally:
            self.capture_seconds += time.perf_counter() - start
        self.graphs[key] = graph
        self.captures += 1
        return graph
