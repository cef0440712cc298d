"""The engine loop: plan (trees, chunks, budget) -> pack -> forward -> score -> collect."""

from __future__ import annotations

import contextlib
import math
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from ..config import EngineConfig, Numerics, numerics_for
from ..errors import LogprobeError
from ..layers.attention import AttentionMeta, KVCache, Segment
from ..layers.hooks import CaptureTable, Hooks, RouteTable, SteerTable
from ..layers.logprob_head import logprob_head
from ..layers.numerics import NumericsUser
from ..models.caps import ModelCaps
from ..models.moe import routed_blocks
from .budget import budget_for, model_pass_bytes, resolved_budget, row_ranks
from .delivery import Delivery, RunStopped, concat_parts
from .graphs import GraphRunner
from .host import HostCopy, HostRows, start_copy, to_device
from .images import ImageMemo, check_images, chunk_end, image_rows, planned_ids, row_positions, segment_spans
from .prefix_cache import PrefixCache
from .prefix_run import ResumePack, cacheable, chunk_keeper, keep_batch, resumable, take_pack
from .request import RequestResult, ScoreRequest
from .scheduler import Chunk, Tree, chunk_bounds, plan_work, tree_cost
from .tuning import start_tuning

# Jobs with at least this many input tokens show a progress bar (when stderr is a terminal).
PROGRESS_MIN_TOKENS = 32768
# Out of memory: a chunk of at most this many rows that still runs out fails its request.
MIN_OOM_CHUNK = 16
# Out of memory: the lowered working budget doubles back after this many good batches in a row.
OOM_RESTORE_AFTER = 8


class AgreedOutOfMemory(torch.OutOfMemoryError):
    """A pass that some rank of a replica said would not fit (``Engine.agree_fits``): raised on
    every rank at the same point, before the pass, so that each splits and retries the same way."""


@dataclass(slots=True)
class PackedBatch:
    """One forward pass: rows of token ids with positions and their ``AttentionMeta``.

    ``score_rows[i]`` is the row whose next-token distribution scores ``targets[i]``; rows are
    listed request by request (``owners``: request index and how many scored rows it has here).
    """

    input_ids: torch.Tensor  # [T]
    # [T], each sequence's own positions (continuing after a prefix or cache); [3, T] (t, h, w rows)
    # when a request has images (a text request's three rows equal)
    positions: torch.Tensor
    meta: AttentionMeta
    score_rows: torch.Tensor  # [N] rows of the hidden states whose next token is scored
    targets: torch.Tensor  # [N] the token each of those rows predicts
    temperature: torch.Tensor  # [N] per scored row (from its request)
    owners: list[tuple[int, int]]  # (request index, scored rows) in score_rows order
    hooks: Hooks | None = None  # steering and capture tables, None when no request asks
    captures: list[CaptureSlot] | None = None  # where each request's captures land in ``hooks``
    routes: list[tuple[int, int, int]] | None = None  # (request, start, end) of its rows in hooks.route.rows
    images: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [n], the vision tower's embeddings [n, H])


@dataclass(slots=True)
class CaptureSlot:
    """Capture ``capture`` of request ``request`` is ``table.out[start:end]`` (rows, project) or
    ``table.out[start]`` (sum) for this batch's part of the request."""

    request: int
    capture: int
    table: CaptureTable
    start: int
    end: int


class _HookBuilder:
    """Collects per-request steer/capture entries as rows of the packed batch, then tensors."""

    def __init__(self, route_layers: dict[str, int] | None = None) -> None:
        self.route_layers = route_layers  # router point -> MoE layer index (None: a model without routers)
        self.route_rows: list[int] = []
        self.route_slots: list[tuple[int, int, int]] = []
        self.force_rows: list[int] = []
        self.force_ids: list[torch.Tensor] = []
        self.steer: dict[tuple[str, str], tuple[list[int], list[torch.Tensor], list[int], list[float]]] = {}
        self.capture: dict[tuple[str, str], dict] = {}
        self.slots: list[tuple[int, int, tuple[str, str], int, int]] = []

    def add(self, i: int, r: ScoreRequest, input_rows: list[int]) -> None:
        """input_rows[k]: batch row of the request's token k, or -1 when not in this batch."""
        n = len(input_rows)
        if r.route or r.force_experts is not None:  # tokens 0 .. len - 2: every token fed
            ks = [k for k in range(min(n, len(r.tokens) - 1)) if input_rows[k] >= 0]
            rows = [input_rows[k] for k in ks]
            if r.route:
                start = len(self.route_rows)
                self.route_rows.extend(rows)
                self.route_slots.append((i, start, start + len(rows)))
            if r.force_experts is not None and ks:
                self.force_rows.extend(rows)
                self.force_ids.append(r.force_experts[torch.tensor(ks)])
        for s in r.steer:
            rows = [input_rows[k] for k in s.positions if k < n and input_rows[k] >= 0]
            if rows:
                rs, vs, idx, cs = self.steer.setdefault((s.point, s.op), ([], [], [], []))
                rs.extend(rows)
                idx.extend([len(vs)] * len(rows))
                cs.extend([s.coeff] * len(rows))
                vs.append(s.vector)
        for c_i, c in enumerate(r.capture):
            rows = [input_rows[k] for k in c.positions if k < n and input_rows[k] >= 0]
            if not rows:
                continue
            t = self.capture.setdefault((c.point, c.kind), {"rows": [], "groups": [], "vectors": [], "index": []})
            if c.kind == "sum":
                g = len(t["vectors"])
                t["vectors"].append(None)  # one group per (request, capture)
                t["groups"].extend([g] * len(rows))
                self.slots.append((i, c_i, (c.point, c.kind), g, g + 1))
            else:
                start = len(t["rows"])
                self.slots.append((i, c_i, (c.point, c.kind), start, start + len(rows)))
                if c.kind == "project":
                    t["index"].extend([len(t["vectors"])] * len(rows))
                    t["vectors"].append(c.vector)
            t["rows"].extend(rows)

    def build(self, device: torch.device) -> tuple[Hooks | None, list[CaptureSlot] | None,
                                                  list[tuple[int, int, int]] | None]:
        routing = bool(self.route_slots or self.force_rows)
        if not self.steer and not self.capture and not routing:
            return None, None, None
        long = lambda x: to_device(x, torch.long, device)  # noqa: E731
        hooks = Hooks()
        if routing:
            hooks.route = RouteTable(dict(self.route_layers or {}),
                                     long(self.route_rows) if self.route_slots else None,
                                     long(self.force_rows) if self.force_rows else None,
                                     torch.cat(self.force_ids).to(device) if self.force_rows else None)
        for (point, op), (rows, vectors, index, coeffs) in self.steer.items():
            hooks.steer.setdefault(point, []).append(SteerTable(
                op, long(rows), torch.stack(vectors).to(device), long(index),
                to_device(coeffs, torch.float32, device)))
        tables: dict[tuple[str, str], CaptureTable] = {}
        for (point, kind), t in self.capture.items():
            table = CaptureTable(kind, long(t["rows"]))
            if kind == "sum":
                table.groups, table.num_groups = long(t["groups"]), len(t["vectors"])
            elif kind == "project":
                table.table, table.index = torch.stack(t["vectors"]).to(device), long(t["index"])
            hooks.capture.setdefault(point, []).append(table)
            tables[(point, kind)] = table
        return (hooks, [CaptureSlot(i, c, tables[key], a, b) for i, c, key, a, b in self.slots],
                self.route_slots or None)


def pack(batch: list[Tree | Chunk], requests: list[ScoreRequest], device: torch.device,
         kv_block: int | None = None, route_layers: dict[str, int] | None = None) -> PackedBatch:
    """Lay out a planned batch. Token j of a request is predicted by the row of its input j - 1,
    wherever that row is: in the shared prefix (one row can score a different target for each
    branch), in the request's own branch, or in its chunk.

    The columns are built as numpy pieces and joined once: each request's ids leave their Python
    list once (ids and targets are slices of that array), positions and score rows are ranges
    (a 131k-row pass: 37-44 ms as Python lists on the 2-core CPU, most of it making the lists
    and turning them into tensors). Worked example, a tree of two members sharing P = 2 ids,
    [5, 6, 7, 8] and [5, 6, 9, 1], each scored from token 2 (the last token is never fed): rows
    0-1 the prefix (5, 6), row 2 the first branch (7), row 3 the second (9); token 2 of each is
    scored from prefix row 1, token 3 from its branch's row:

        >>> reqs = [ScoreRequest([5, 6, 7, 8], 2), ScoreRequest([5, 6, 9, 1], 2)]
        >>> b = pack([Tree((0, 1), 2)], reqs, torch.device("cpu"))
        >>> b.input_ids.tolist(), b.positions.tolist(), b.score_rows.tolist(), b.targets.tolist()
        ([5, 6, 7, 9], [0, 1, 2, 2], [1, 2, 1, 3], [7, 8, 9, 1])
    """
    cols = _Columns()
    segments: list[Segment] = []
    owners: list[tuple[int, int]] = []
    hooks = _HookBuilder(route_layers)
    past = 0

    def add_rows(tokens: np.ndarray, first_pos: int, context: tuple[tuple[int, int], ...],
                 r: ScoreRequest | None = None) -> int:
        """The request's (``r``'s) tokens from its token ``first_pos`` on; with images their
        positions rows and embeddings (``engine.images``)."""
        start = cols.num_rows
        if len(tokens):
            cols.ids.append(tokens)
            img = r.images if r is not None else None
            cols.positions.append(row_positions(img, first_pos, len(tokens)))
            if img is not None:
                cols.images.append(image_rows(img, first_pos, len(tokens), start))
            cols.num_rows += len(tokens)
            segments.append(Segment(start, cols.num_rows, context, segment_spans(img, first_pos, len(tokens))))
        return start

    def add_scores(i: int, n: int, score_rows: np.ndarray, targets: np.ndarray, input_rows: list[int] | None) -> None:
        """Score n tokens of request i from rows ``score_rows``; input_rows: the batch row of each of
        the request's inputs (-1: not in this batch), given for a request with hooks only."""
        r = requests[i]
        cols.rows.append(score_rows)
        cols.targets.append(targets)
        cols.temps.append(np.full(n, r.temperature, dtype=np.float32))
        owners.append((i, n))
        if r.hooked:
            hooks.add(i, r, input_rows)

    for item in batch:
        if isinstance(item, Chunk):
            r, b, e = requests[item.request], item.begin, item.end
            past = b  # rows 0..begin-1 are in the cache, before ours in the key source
            tok = np.asarray(r.tokens[b:e + 1], dtype=np.int64)  # this chunk's inputs and the target after them
            start = add_rows(tok[:e - b], b, ((0, b),) if b else (), r)
            js = range(max(r.score_begin, b + 1), min(e + 1, len(r.tokens)))
            n = len(js)
            add_scores(item.request, n, np.arange(start + js.start - 1 - b, start + js.start - 1 - b + n, dtype=np.int64),
                       tok[js.start - b:js.start - b + n],
                       [-1] * b + list(range(start, start + e - b)) if r.hooked else None)
            continue
        P = item.shared
        first = np.asarray(requests[item.members[0]].tokens, dtype=np.int64)
        prefix = add_rows(first[:P], 0, (), requests[item.members[0]])
        for i in item.members:
            r = requests[i]
            tok = first if i == item.members[0] else np.asarray(r.tokens, dtype=np.int64)
            branch = add_rows(tok[P:r.num_inputs], P, ((prefix, prefix + P),) if P else (), r)
            add_scores(i, r.num_scored, _tree_rows(prefix, P, branch, r.score_begin - 1, len(r.tokens) - 1),
                       tok[r.score_begin:],
                       [*range(prefix, prefix + P), *range(branch, branch + r.num_inputs - P)] if r.hooked else None)
    meta = AttentionMeta(segments, kv_block=kv_block, past=past)
    ids, positions, rows, targets, temps = cols.on(device)
    return PackedBatch(ids, positions, meta, rows, targets, temps, owners, *hooks.build(device),
                       images=cols.images_on(device))


def _tree_rows(prefix: int, P: int, branch: int, k0: int, k1: int) -> np.ndarray:
    """The batch rows of a tree member's inputs k0 .. k1 - 1: input k < P is prefix row prefix + k,
    input k >= P its branch's row branch + k - P.

    >>> _tree_rows(10, 3, 20, 1, 6).tolist(), _tree_rows(10, 3, 20, 4, 6).tolist(), _tree_rows(0, 0, 7, 0, 2).tolist()
    ([11, 12, 20, 21, 22], [21, 22], [7, 8])
    """
    shared = np.arange(prefix + k0, prefix + min(k1, P), dtype=np.int64)
    own = np.arange(branch + max(k0, P) - P, branch + k1 - P, dtype=np.int64)
    return np.concatenate([shared, own])


class _Columns:
    """A pass's columns as numpy pieces (``pack``), joined and sent to the device once each."""

    __slots__ = ("ids", "positions", "rows", "targets", "temps", "num_rows", "images")

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.positions: list[np.ndarray] = []
        self.rows: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []
        self.temps: list[np.ndarray] = []
        self.num_rows = 0
        self.images: list[tuple[np.ndarray, torch.Tensor]] = []  # (batch rows, embeddings) of image tokens

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(ids, positions, score rows, targets, temperatures) on ``device`` (``to_device``)."""
        def joined(parts: list[np.ndarray], dtype) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(parts, axis=-1) if parts else np.zeros(0, dtype=dtype))

        positions = self.positions
        if any(p.ndim == 2 for p in positions):  # a request with images: every piece as (t, h, w) rows
            positions = [np.broadcast_to(p, (3, p.shape[-1])) for p in positions]
        longs = [to_device(joined(p, np.int64), torch.long, device) for p in (self.ids, positions, self.rows,
                                                                               self.targets)]
        return (*longs, to_device(joined(self.temps, np.float32), torch.float32, device))


    def images_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [n], embeddings [n, H]) of the pass's image tokens, or None: no images."""
        if not self.images:
            return None
        rows = np.concatenate([r for r, _ in self.images])
        return to_device(torch.from_numpy(rows), torch.long, device), torch.cat([e for _, e in self.images]).to(device)


def check_targets(requests: list[ScoreRequest], vocab_size: int) -> None:
    """What the head would check on the device, checked on the host's lists (``logprob_head``'s
    ``checked``: two synchronisations fewer per pass on CUDA): scored ids in [0, vocab_size),
    temperatures finite and > 0."""
    for i, r in enumerate(requests):
        scored = r.tokens[r.score_begin:]
        if min(scored) < 0 or max(scored) >= vocab_size:
            raise LogprobeError(f"requests[{i}].tokens", f"scored ids must be in [0, {vocab_size})")
        if not (math.isfinite(r.temperature) and r.temperature > 0):
            raise LogprobeError(f"requests[{i}].temperature", f"must be finite and > 0, got {r.temperature!r}")


class Engine:
    """Runs ScoreRequests on a model (``forward(ids, positions, meta) -> hidden``, ``head_params()``).

    Shared prefixes and chunking need a model with ``caps.context``; for others each request
    runs as an independent sequence (a request over the budget runs whole, alone)."""

    weights_refusal: Exception | None = None  # raised by ``run`` while set (``Scorer``: in-place updates)

    per_request_errors = True  # executor.Executor: on_error gets each request that fails alone
    in_process = True  # executor.Executor: the model and its weights live in this process

    def __init__(self, model: nn.Module, config: EngineConfig, device: torch.device) -> None:
        if config.max_batch_tokens is None:  # the default: from the device and its free memory
            config = replace(config, max_batch_tokens=budget_for(model, device))
        self.model = model
        self.start_budget = config.max_batch_tokens  # what a later config's None stands for
        self._config = config
        self.device = device
        self._numerics: Numerics | None = None  # of this config, made when first needed
        self._splittable = ModelCaps.of(model).tensor_parallel  # column blocks mean something
        self._context = ModelCaps.of(model).context
        self._align = ModelCaps.of(model).state_align  # where a sequence may be cut (scheduler.plan_work)
        self._ranks = row_ranks(model)  # ranks sharing a pass's rows (data-parallel attention)
        # their rows balanced by rows and attention pairs (``models.base.attention_pair_weight``)
        self._pair_weight = getattr(model, "pair_weight", 0) if self._ranks > 1 else 0
        # out of memory: the working budget (<= config.max_batch_tokens), see ``run``
        self.budget = config.max_batch_tokens
        self.restore_after = OOM_RESTORE_AFTER
        self.oom_count = 0  # out-of-memory errors met (and recovered from, or failed a request)
        self.max_ok_tokens = 0  # the most tokens (rows + cached keys) one good pass has held
        self._good = 0
        # called as fault_hook(rows, tokens) before each forward pass (tokens: rows + cached keys);
        # tests raise torch.OutOfMemoryError from it, or count passes
        self.fault_hook: Callable[[int, int], None] | None = None
        # a replica's agreement before each pass (set by executor.workers; None: one process):
        # agree_fits(fits) -> whether every rank's pre-flight said yes (``_preflight``)
        self.agree_fits: Callable[[bool], bool] | None = None
        self.passes = 0  # forward passes started (the server's logprobe_engine_passes_total)
        self._images: tuple[list[ScoreRequest], ImageMemo] | None = None  # a run's requests and their ImageMemo
        # across runs: the KV (and hybrid states) of token prefixes already computed
        # (engine.prefix_cache; set by the owner: Scorer(prefix_cache=...)), None: off
        self.prefix_cache: PrefixCache | None = None
        self._hidden: torch.Tensor | None = None  # the last recorded pass's final hidden rows (prefix cache)
        # autotuned kernels' choices from the shipped tables and the persistent cache (CUDA only)
        self.tuning = start_tuning(model, config, device)
        # small passes replayed as CUDA graphs (engine.graphs; None: every pass eager)
        self.graphs = GraphRunner.for_engine(model, config, device)

    def close(self) -> None:
        """Nothing to stop (``executor.Executor``): the model lives in this process."""

    @torch.no_grad()
    def run(
        self,
        requests: list[ScoreRequest],
        on_result: Callable[[int, RequestResult], None] | None = None,
        progress: bool | None = None,
        *,
        on_error: Callable[[int, Exception], None] | None = None,
        stop: Callable[[], bool] | None = None,
        cancelled: Callable[[int], bool] | None = None,
        on_batch: Callable[[], None] | None = None,
    ) -> list[RequestResult]:
        """Results in input order; ``on_result(i, result)`` is called as each request completes.

        Out of memory (``torch.OutOfMemoryError`` in a forward pass or the head) is not fatal: the
        batch's requests are planned again under half its rows (down to one request, then chunks
        of it down to ``MIN_OOM_CHUNK`` rows) and the working budget ``self.budget`` is lowered for
        the batches that follow, doubling back after ``self.restore_after`` good batches in a row
        (never above ``config.max_batch_tokens``). No number changes (bitwise in deterministic
        mode: chunking and the budget never change bits). Only a request that does not fit even
        alone fails, and alone: with ``on_error`` its slot in the returned list is None and
        ``on_error(i, RequestOutOfMemory)`` is called; without it every other request still runs
        (and reaches ``on_result``), then the first such error is raised. In a replica of several
        ranks (``agree_fits``) the ranks agree on each out-of-memory before the pass, and split
        alike; one inside a pass is raised (``_preflight``).

        ``stop()`` is asked before each forward pass; True raises ``RunStopped`` there: every
        request completed so far has reached ``on_result`` (a job interrupted by a signal).
        ``cancelled(i)`` is asked of request ``i`` before each pass that would run it (a chunked
        request: before each chunk); True leaves it out of that pass and every later one: its
        slot stays None, and neither ``on_result`` nor ``on_error`` hears of it (the HTTP client
        went away, or its deadline passed).

        ``on_batch()`` is called each time a pass's results have all reached ``on_result`` (a
        worker process sends them to its driver as one message: ``executor.workers.Outbox``)."""
        if self.weights_refusal is not None:  # an in-place weight update under way, or failed part way
            raise self.weights_refusal
        dev = self.device
        if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
            with torch.cuda.device(dev):  # Triton launches on the current device: make it this engine's
                return self.run(requests, on_result, progress, on_error=on_error, stop=stop, cancelled=cancelled,
                                on_batch=on_batch)
        self._check_supported(requests)
        if self.graphs is not None:
            self.graphs.check_weights()
        out = Delivery(requests, on_result, on_error, self._progress_bar(sum(r.num_inputs for r in requests), progress),
                       on_batch)
        cache = self.prefix_cache if self._context else None
        resumed = resumable(cache, requests, self._align) if cache is not None else []
        queue = self._plan(requests, sorted(set(range(len(requests))) - set(resumed)))
        planned_at = self.budget
        while queue:
            if stop is not None and stop():
                out.settle()
                raise RunStopped()
            unit = queue.popleft()
            if cancelled is not None and any(cancelled(m) for m in _pending([unit])):
                # plan what is left without the cancelled requests
                queue = self._plan(requests, [m for m in _pending([unit, *queue]) if not cancelled(m)])
                planned_at = self.budget
                continue
            if isinstance(unit, int):  # a request over the budget: its chunks, one per batch, in order
                out.settle()
                self._run_chunks(requests, unit, out, stop, cancelled)
            elif (again := self._run_unit(requests, unit, out)) is not None:
                # out of memory: under the lowered budget (at most half its rows) with everything not yet run
                queue = self._plan(requests, again + _pending(queue))
                planned_at = self.budget
                continue
            if self.budget != planned_at:  # lowered (or raised back): plan what is left again
                queue = self._plan(requests, _pending(queue))
                planned_at = self.budget
        # the last batch of trees stays in flight: the first pack is planned while it runs
        self._run_resumed(requests, deque(resumed), out, stop, cancelled)
        self._images = None  # the run's image embeddings stay on its requests only
        results = out.close()
        if self.tuning is not None:  # what this run tuned, kept for the next process
            self.tuning.after_run()
        return results

    def _run_resumed(self, requests: list[ScoreRequest], queue: deque[int], out: Delivery,
                     stop: Callable[[], bool] | None, cancelled: Callable[[int], bool] | None) -> None:
        """The requests with a cached prefix (``engine.prefix_run``), each from its longest one:
        several to a pass (``take_pack``), or alone in chunks (over the budget; hybrid models)."""
        while queue:
            if stop is not None and stop():
                out.settle()
                raise RunStopped()
            if cancelled is not None:
                queue = deque(m for m in queue if not cancelled(m))
                if not queue:
                    return
            members, alone = take_pack(self.prefix_cache, requests, queue, self.whole_budget, self._align)
            if alone is not None:
                out.settle()
                self._run_chunks(requests, alone, out, stop, cancelled, resume=True)
            else:
                self._run_pack(requests, members, out, stop, cancelled)

    def _run_pack(self, requests: list[ScoreRequest], members: list[int], out: Delivery,
                  stop: Callable[[], bool] | None, cancelled: Callable[[int], bool] | None) -> None:
        """One pass over resumed requests (``prefix_run.ResumePack``); tokens scored by cached rows
        share its head call. Out of memory: the budget lowered, each request alone in chunks."""
        rp = ResumePack(self.prefix_cache, requests, members, len(self.model.layers))
        ids, positions, segments, rows, targets, temps, owners = rp.layout()
        as_long = lambda x: to_device(x, torch.long, self.device)  # noqa: E731
        meta = AttentionMeta(segments, cache=rp.kv, kv_block=self.numerics.attention_block, past=rp.past)
        packed = PackedBatch(as_long(ids), as_long(positions), meta, as_long(rows), as_long(targets),
                             to_device(temps, torch.float32, self.device), owners)
        oom = False
        try:
            hidden = self._forward(packed)  # [T, H]
            hidden = rp.with_context(hidden)  # [past + T, H]: score_rows index the prefixes' rows, then the pass's
            launched = self.score(requests, packed, hidden)
        except torch.OutOfMemoryError as e:
            if not self._recoverable(e):
                raise
            oom = True
        except BaseException:
            out.settle()  # the pass before is delivered, as in ``_run_unit``
            raise
        # the pass before (trees or a pack) is read only now, as in ``_run_unit``: its GPU work ran
        # while this pack was planned and launched
        out.settle()
        if oom:
            del rp, packed, meta
            self._out_of_memory(len(ids))
            for m in members:  # their lookups were counted by the pack
                self._run_chunks(requests, m, out, stop, cancelled, resume=True, record=False)
            return
        rp.keep(hidden)
        self._succeeded(meta.num_rows + meta.past)
        launched.cached = rp.begin
        out.hold(launched)  # progress: the pack's rows, each member's inputs from ``first`` on
        if not self.config.overlap_host:
            out.settle()

    def _check_supported(self, requests: list[ScoreRequest]) -> None:
        if self.config.deterministic and not (self._context or ModelCaps.of(self.model).deterministic):
            raise LogprobeError("deterministic", f"{type(self.model).__name__} has no deterministic kernels",
                                "use a native model or the transformers backend, or turn it off")
        if any(r.route or r.force_experts is not None for r in requests) and not self.route_layers:
            raise LogprobeError("return_routed_experts" if any(r.route for r in requests) else "routed_experts",
                                f"{type(self.model).__name__} has no mixture-of-experts layers: no routed experts",
                                "ask for routed experts of a mixture-of-experts model (Qwen-MoE, Mixtral, ...)")
        if not ModelCaps.of(self.model).hooks and any(r.steer or r.capture for r in requests):
            raise LogprobeError("steer" if any(r.steer for r in requests) else "capture",
                                f"{type(self.model).__name__} has no hook points",
                                "use a native model (GGUF or a Llama-family directory)")
        check_targets(requests, self.model.head_params().vocab_size)
        check_images(self.model, requests)

    def _run_unit(self, requests: list[ScoreRequest], unit: list[Tree], out: Delivery) -> list[int] | None:
        """Launch one batch of trees, then deliver the batch before it. Out of memory: the request
        indices to plan again under the lowered budget (None when the batch ran, or when its one
        request failed alone)."""
        rows = sum(tree_cost(t, out.lengths) for t in unit)
        oom = None
        cache = self.prefix_cache if self._context else None
        # with a prefix cache, the pass's keys/values are recorded (a cache with no past changes
        # no number) and the members' prefixes kept
        record = KVCache.empty(len(self.model.layers)) if cache is not None else None
        try:
            packed, launched = self._run_batch(requests, unit, record)
        except torch.OutOfMemoryError as e:
            if not self._recoverable(e):
                raise
            oom = _first_line(e)
        except BaseException:
            out.settle()  # the batches before it are delivered, as without the overlap
            raise
        # read the previous batch's results only now: its GPU work ran while this one was
        # planned, packed and launched (config.overlap_host; bitwise the same either way)
        out.settle()
        if oom is None:
            if record is not None:
                keep_batch(cache, unit, requests, record, self._hidden)
                self._hidden = None
            self._succeeded(packed.meta.num_rows)
            out.hold(launched)
            if not self.config.overlap_host:
                out.settle()
            return None
        self._out_of_memory(rows)
        members = [m for t in unit for m in t.members]
        if len(members) == 1 and not (self._context and rows > MIN_OOM_CHUNK):
            out.fail(members[0], rows, rows, self.max_ok_tokens, oom)  # alone and not to be cut
            return None
        return members

    def _plan(self, requests: list[ScoreRequest], indices) -> deque[list[Tree] | int]:
        """Units of work for ``indices`` under the working budget: batches of trees (request indices
        of ``requests``), or a request index whose chunks run one per batch."""
        idx = sorted(indices)
        sub = [requests[i] for i in idx]
        cfg = self.config
        # under data-parallel attention a batch with hooks runs whole on every rank: a rank's share
        whole = self._ranks > 1 and any(r.hooked for r in sub)
        plan = plan_work([planned_ids(r) for r in sub], self.whole_budget if whole else self.budget,
                         share=cfg.share_prefixes and self._context,
                         min_shared=cfg.min_shared_prefix, chunk=self._context,
                         # steered rows or forced experts differ: no sharing (images: by content, planned_ids)
                         unshared={k for k, r in enumerate(sub) if r.steer or r.force_experts is not None},
                         align=self._align, ranks=1 if whole else self._ranks,
                         pair_weight=self._pair_weight)
        units: deque[list[Tree] | int] = deque()
        for batch in plan:
            item = batch[0]
            if isinstance(item, Chunk):
                if item.begin == 0:
                    units.append(idx[item.request])
            else:
                units.append([Tree(tuple(idx[m] for m in t.members), t.shared) for t in batch])  # type: ignore[union-attr]
        return units

    @property
    def whole_budget(self) -> int:
        """The rows of a pass that runs whole on every rank (chunks over a KV cache, resumed cached
        prefixes, batches with hooks): under data-parallel attention a rank's share of the working
        budget (each rank's memory was sized for its share), else the budget."""
        return max(1, self.budget // self._ranks)

    def _run_batch(self, requests: list[ScoreRequest], batch: list, cache: KVCache | None = None):
        """One forward pass and its head, queued: (packed batch, ``Launched``)."""
        if isinstance(self.model, NumericsUser):  # before the vision tower runs: its products follow them
            self.model.set_numerics(self.numerics)
        if any(r.images is not None for r in requests):
            self._image_memo(requests).embed(self.model, requests, [
                i for item in batch for i in ((item.request,) if isinstance(item, Chunk) else item.members)])
        packed = pack(batch, requests, self.device, self.numerics.attention_block, self.route_layers)
        packed.meta.cache = cache
        hidden = self._forward(packed)  # [T, H]
        if cache is not None and self.prefix_cache is not None:
            self._hidden = hidden  # its rows are kept with the keys (prefix_run)
        return packed, self.score(requests, packed, hidden)

    def _image_memo(self, requests: list[ScoreRequest]) -> ImageMemo:
        """The tower outputs of this run's images (``ImageMemo``), made on its first batch with images."""
        if self._images is None or self._images[0] is not requests:
            self._images = (requests, ImageMemo(requests))
        return self._images[1]

    def _forward(self, packed: PackedBatch) -> torch.Tensor:
        """The model on a packed batch -> its final hidden rows [T, H] (``_preflight`` first)."""
        self._preflight(packed.meta.num_rows, packed.meta.num_rows + packed.meta.past)
        self.passes += 1
        with self._computing():
            return self._call_model(packed)

    def _computing(self):
        """A context: the model under this config's numerics (a no-op unless another engine's ran
        last), and in deterministic mode every autotuned kernel in its pinned configuration, never
        a timed one."""
        if isinstance(self.model, NumericsUser):
            self.model.set_numerics(self.numerics)
        return contextlib.nullcontext() if self.tuning is None else self.tuning.mode(self.numerics.deterministic)

    @torch.no_grad()
    def prepare_graphs(self) -> int:
        """Capture the CUDA graphs of every small-pass bucket now, under this config's numerics
        (``engine.graphs``; ``Scorer.warmup``); returns how many were captured (0 without graphs)."""
        if self.graphs is None:
            return 0
        with self._computing():
            return self.graphs.prepare(self.numerics, self.budget)

    def _call_model(self, packed: PackedBatch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.takes(packed.input_ids.shape[-1], packed.hooks, packed.images):
            return self.graphs(packed.input_ids, packed.positions, packed.meta, self.numerics)
        if packed.images is not None:
            return self.model(packed.input_ids, packed.positions, packed.meta, packed.hooks, images=packed.images)
        if packed.hooks is None:
            return self.model(packed.input_ids, packed.positions, packed.meta)
        return self.model(packed.input_ids, packed.positions, packed.meta, packed.hooks)

    def _preflight(self, rows: int, tokens: int) -> None:
        """Before a pass of ``rows`` rows (``tokens``: with cached keys): ``fault_hook``, and in a
        replica (``agree_fits`` set) the ranks' agreement. There each rank answers whether the pass
        fits (on CUDA it reserves the pass's estimated working memory, ``budget.pass_bytes``, which
        the caching allocator then holds for the pass; an out-of-memory there, or from
        ``fault_hook``, is "no"), and when any rank said no every rank raises
        ``AgreedOutOfMemory`` here, at the same point of the same plan: the split and retry that
        follow are the same on every rank, and so are the numbers.

            rank 0: fits, rank 1: no  -> both raise; both halve the batch and lower the budget

        An out-of-memory inside a pass, past this point, cannot be agreed (the other ranks are
        inside its collectives): in a replica it is not recovered from (``_recoverable``)."""
        if self.agree_fits is None:
            if self.fault_hook is not None:
                self.fault_hook(rows, tokens)
            return
        why = None
        try:
            if self.fault_hook is not None:
                self.fault_hook(rows, tokens)
            if self.device.type == "cuda":  # freed at once: the allocator keeps the block for the pass
                torch.empty(model_pass_bytes(self.model, rows), dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as e:
            why = _first_line(e)
        if not self.agree_fits(why is None):
            raise AgreedOutOfMemory(why or f"another rank of the replica has no memory for a pass of {rows} rows")

    def _recoverable(self, e: torch.OutOfMemoryError) -> bool:
        """Whether an out-of-memory error is split and retried here: always in one process; in a
        replica only the agreed one (``_preflight``), any other leaves this rank out of step with
        the others and is raised (the worker fails its replica)."""
        return self.agree_fits is None or isinstance(e, AgreedOutOfMemory)

    def _score_cached(self, r: ScoreRequest, hidden: torch.Tensor, begin: int) -> RequestResult:
        """Tokens ``score_begin .. begin`` of ``r`` from the cached final hidden rows of inputs
        ``score_begin - 1 .. begin - 1`` (``hidden``): the head alone, as a pass would run it."""
        js = range(r.score_begin, begin + 1)
        dev = self.device
        targets = to_device([r.tokens[j] for j in js], torch.long, dev)
        temps = torch.full((len(js),), r.temperature, dtype=torch.float32, device=dev)
        n = self.numerics
        out = logprob_head(hidden.to(dev), self.model.head_params(), targets, temps, top_k=r.top_k,
                           entropy=r.entropy, token_chunk=n.head_token_chunk, vocab_chunk=n.head_vocab_chunk,
                           deterministic=n.deterministic, checked=True)
        return _slice(start_copy(out, r.top_k, r.entropy).wait(), slice(0, len(js)), r)

    def _run_chunks(self, requests: list[ScoreRequest], m: int, out: Delivery,
                    stop: Callable[[], bool] | None = None, cancelled: Callable[[int], bool] | None = None,
                    resume: bool = False, record: bool = True) -> None:
        """Request ``m``'s chunks in order through one KV cache. Out of memory: the cache is cut
        back to the chunk's start and the chunk halved (down to ``MIN_OOM_CHUNK`` rows, then the
        request fails). Cancelled between chunks: left unfinished, undelivered. ``resume``: the
        cache starts as the request's longest prefix in ``self.prefix_cache`` (``record``: its
        lookup counted in the cache's stats).

        With a prefix cache the request's prefixes are kept as it goes (``prefix_run.chunk_keeper``:
        chunks also end at the grid points where a hybrid state is stored)."""
        r = requests[m]
        n = r.num_inputs
        cache = KVCache.empty(len(self.model.layers))
        keeper = chunk_keeper(self.prefix_cache, r, self._align, cache, resume, record) \
            if self.prefix_cache is not None and cacheable(r) else None
        b = keeper.begin if keeper is not None else 0
        parts: list[RequestResult] = []
        if b >= r.score_begin:  # tokens scored by cached rows: from their kept hidden states
            parts.append(self._score_cached(r, keeper.hidden_rows(r.score_begin - 1, b), b))
        size = self.whole_budget  # this request's chunk size: only ever halved
        while b < n:
            if stop is not None and stop():
                raise RunStopped()
            if b > 0 and cancelled is not None and cancelled(m):
                return
            e = chunk_bounds(n - b, max(1, min(size, self.whole_budget)), self._align)[0][1] + b
            if keeper is not None:
                e = keeper.end(b, e)
            e = chunk_end(r.images, b, e)  # never inside a run of image tokens that attend both ways
            oom = None
            try:
                packed, launched = self._run_batch(requests, [Chunk(m, b, e)], cache)
                scored = launched.results()
            except torch.OutOfMemoryError as exc:
                if not self._recoverable(exc):
                    raise
                oom = _first_line(exc)
            if oom is not None:
                _truncate(cache, b)
                cache.discard()  # linear-attention states stay those after row b
                self._out_of_memory(e - b)
                if e - b <= max(MIN_OOM_CHUNK, self._align):
                    out.fail(m, e - b, e, self.max_ok_tokens, oom)
                    return
                size = max(MIN_OOM_CHUNK, (e - b) // 2)
                continue
            cache.commit()  # the linear-attention states after row e carry to the next chunk
            if keeper is not None:
                keeper.keep(e, self._hidden)
                self._hidden = None
            self._succeeded(e)
            parts.extend(part for _, part in scored)
            out.progress(e - b)
            b = e
        res = concat_parts(parts, r)
        res.cached_tokens = keeper.begin if keeper is not None else 0
        out.finish(m, res)
        out.batch_done()

    def _out_of_memory(self, rows: int) -> None:
        """A batch of ``rows`` rows ran out of memory: free the allocator's cache, lower the budget."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.oom_count += 1
        self.budget = max(1, min(self.budget, rows // 2))
        self._good = 0

    @property
    def config(self) -> EngineConfig:
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        """The config of the next runs (deterministic on or off, say). ``max_batch_tokens=None``
        keeps the budget this engine started with (chosen once, agreed by TP ranks); a new budget
        replaces the working one, an unchanged one keeps any lowering after an out-of-memory."""
        config = resolved_budget(config, self.start_budget)
        if self.prefix_cache is not None and config.deterministic != self._config.deterministic:
            self.prefix_cache.clear()  # its keys were computed under the other mode's kernels
        if config.max_batch_tokens != self._config.max_batch_tokens:
            self.budget = config.max_batch_tokens
        if config.cuda_graph_tokens != self._config.cuda_graph_tokens:
            self.graphs = GraphRunner.for_engine(self.model, config, self.device)
        self._config = config
        self._numerics = None  # derived again from this config, when first needed

    def _succeeded(self, tokens: int) -> None:
        """A forward pass that held ``tokens`` (rows and cached keys) ran: raise the budget back
        gradually (doubled after ``restore_after`` good batches in a row)."""
        self.max_ok_tokens = max(self.max_ok_tokens, tokens)
        self._good += 1
        if self.budget < self.config.max_batch_tokens and self._good >= self.restore_after:
            self.budget = min(self.config.max_batch_tokens, self.budget * 2)
            self._good = 0

    def score(self, requests: list[ScoreRequest], packed: PackedBatch, hidden: torch.Tensor) -> Launched:
        """The head on a batch's rows, its results' copy to the host started (``Launched.results``
        reads them). Head options are per request: the head computes the largest top-k and entropy
        asked for in the batch (neither changes any other number of a row), each request gets its own."""
        batch = [requests[i] for i, _ in packed.owners]
        if len(packed.score_rows) == 0:  # only a chunk holding a capture's extra last row
            return Launched(packed, batch, None)
        top_k = max(r.top_k for r in batch)
        entropy = any(r.entropy for r in batch)
        out = logprob_head(hidden[packed.score_rows], self.model.head_params(), packed.targets,
                           packed.temperature, top_k=top_k, entropy=entropy,
                           token_chunk=self.numerics.head_token_chunk, vocab_chunk=self.numerics.head_vocab_chunk,
                           deterministic=self.numerics.deterministic, checked=True)
        return Launched(packed, batch, start_copy(out, top_k, entropy))

    @property
    def route_layers(self) -> dict[str, int]:
        """Each MoE block's router point -> its index among the MoE layers, in layer order ({}: none)."""
        if getattr(self, "_route_layers", None) is None:
            self._route_layers = route_layers(self.model)
        return self._route_layers

    @property
    def numerics(self) -> Numerics:
        """How the model computes under this engine's config on its device: derived once per
        config (``config.numerics_for``) and handed to the model before each pass
        (``layers.numerics``: the model rewrites its layers only when it differs)."""
        if self._numerics is None:
            ctx = getattr(self.model, "ctx", None)  # a native model's tensor-parallel group
            self._numerics = numerics_for(self.config, self.device, splittable=self._splittable,
                                          tp_size=ctx.size if ctx is not None else 1,
                                          tp_blocks=ctx.blocks if ctx is not None else 1,
                                          overlapped=getattr(ctx, "data_attention", False))
        return self._numerics

    def _progress_bar(self, total: int, progress: bool | None):
        show = self.config.progress if progress is None else progress
        if show is None:
            show = total >= PROGRESS_MIN_TOKENS and sys.stderr.isatty()
        if not show:
            return None
        from tqdm import tqdm

        return tqdm(total=total, unit="tok", desc="scoring", file=sys.stderr)


@dataclass(slots=True)
class Launched:
    """A batch whose forward pass and head are queued on the device; ``results()`` waits for its
    host copy (``engine.host``) and gives each request's part, captures attached."""

    packed: PackedBatch
    batch: list[ScoreRequest]  # the request of each of packed.owners
    copy: HostCopy | None  # None: the batch scores no row
    ready: list[tuple[int, RequestResult]] | None = None  # parts already made (an engine scoring otherwise)
    cached: dict[int, int] | None = None  # a pack's members: request index -> tokens read from the prefix cache

    def results(self) -> list[tuple[int, RequestResult]]:
        if self.ready is not None:
            return self.ready
        owners = self.packed.owners
        if self.copy is None:
            empty = torch.empty(0)
            scored = [(i, RequestResult(empty, empty.long(), empty if r.entropy else None,
                                        empty.long().view(0, r.top_k) if r.top_k else None,
                                        empty.view(0, r.top_k) if r.top_k else None))
                      for (i, _), r in zip(owners, self.batch)]
        else:
            rows, scored, offset = self.copy.wait(), [], 0
            for (i, n), r in zip(owners, self.batch):
                scored.append((i, _slice(rows, slice(offset, offset + n), r)))
                offset += n
        _attach_captures(scored, self.packed.captures or [])
        _attach_routes(scored, self.packed)
        if self.cached is not None:
            for i, part in scored:
                part.cached_tokens = self.cached[i]
        return scored


def _slice(out: HostRows, sl: slice, r: ScoreRequest) -> RequestResult:
    # copies, not views of the batch's buffer: a result may be kept, or pickled to another
    # process (a view would carry the whole batch's storage with it)
    return RequestResult(
        logprobs=out.logprobs[sl].clone(),
        ranks=out.ranks[sl].clone(),
        entropy=out.entropy[sl].clone() if r.entropy else None,
        topk_ids=out.topk_ids[sl, : r.top_k].clone() if r.top_k else None,
        topk_logprobs=out.topk_logprobs[sl, : r.top_k].clone() if r.top_k else None,
    )


def _attach_captures(scored: list[tuple[int, RequestResult]], slots: list[CaptureSlot]) -> None:
    """Give each request's part its capture pieces (None where this batch holds none of a capture)."""
    by_request = {i: res for i, res in scored}
    for slot in slots:
        res = by_request[slot.request]
        if res.captures is None:
            res.captures = []  # (capture index, piece) until concat_parts orders them
        out = slot.table.out
        piece = out[slot.start] if slot.table.kind == "sum" else out[slot.start:slot.end]
        res.captures.append((slot.capture, piece.cpu()))


def route_layers(model: nn.Module) -> dict[str, int]:
    """Router point (``blocks.l.router``) -> MoE layer index, in layer order, of a native model."""
    return {m.router_point: j for j, (_, m) in enumerate(routed_blocks(model))}


def _attach_routes(scored: list[tuple[int, RequestResult]], packed: PackedBatch) -> None:
    """Each routing request's part gets its rows' expert ids [n, moe_layers, k] (int64, host)."""
    if not packed.routes:
        return
    table = packed.hooks.route
    ids = torch.stack([table.out[p] for p in sorted(table.layers, key=table.layers.get)], dim=1).cpu()  # [N, L, k]
    by_request = {i: res for i, res in scored}
    for i, a, b in packed.routes:
        by_request[i].routed_experts = ids[a:b].long()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().split("\n")[0]
    return text if len(text) <= 200 else text[:197] + "..."


def _pending(queue) -> list[int]:
    """The request indices in units of work not yet run."""
    return sorted(m for u in queue for m in ((u,) if isinstance(u, int) else (m for t in u for m in t.members)))


def _truncate(cache: KVCache, n: int) -> None:
    """Cut a KV cache back to its first ``n`` rows (a pass that failed part-way may have appended)."""
    for layer, k in enumerate(cache.keys):
        # a list: cached pieces no pass has joined yet (``KVCache``), nothing appended to them
        if k is not None and not isinstance(k, list) and k.shape[0] > n:
            cache.keys[layer] = k[:n] if n else None
            cache.values[layer] = cache.values[layer][:n] if n else None
