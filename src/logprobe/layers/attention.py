"""Causal attention over a packed batch described by an explicit ``AttentionMeta``.

A packed batch is a list of *segments*: contiguous query rows of one sequence. A segment's keys
are, in position order, its *context* (fully visible: a shared prefix's rows, or earlier chunks'
cached keys) followed by its own rows, seen causally. So the keys of a segment with ``c`` context
keys and ``n`` own rows are positions ``0 .. c + n - 1`` of its sequence and own row ``i`` sees
keys ``0 .. c + i`` (causal aligned bottom-right, as varlen flash attention does when
``seqlen_k > seqlen_q``). Attention never crosses segments otherwise.

Keys are indexed in one *key source*: the cached keys of earlier chunks (``cache``, rows
``0 .. past - 1``) followed by this batch's keys (rows ``past .. past + T - 1``). Context spans are
rows of the key source, so one kind of span serves both a shared prefix and a chunk cache. The
cache may hold the cached rows of several sequences one after another, each segment naming its
own span: several sequences resumed from their own cached prefixes share one pass. Worked
example: sequence a (3 rows cached) and b (2 rows cached) laid in one cache, ``past = 5``, then
two new rows of a and one of b; a's keys are cache rows 0..2 and its own rows 5, 6, b's are cache
rows 3, 4 and its row 7:

    >>> segs = [Segment(0, 2, ((0, 3),)), Segment(2, 3, ((3, 5),))]
    >>> varlen_index(segs, past=5)
    ([0, 2, 3], [0, 5, 8], [0, 1, 2, 5, 6, 3, 4, 7])

Two kernels compute the same function:
* ``kv_block=None``: PyTorch SDPA per segment (its fused CPU kernel; the fastest here).
* ``kv_block=B`` (deterministic mode): queries in tiles of B rows and keys in blocks of B,
  both aligned to key index 0 of the sequence, an online softmax over the blocks in a fixed
  order, fixed-shape products. A query's result then depends only on its own query vector and
  keys, never on how many other rows, segments or context spans the call holds, nor on where
  its keys came from (prefix rows, cache, or its own rows): bitwise.

Attention sinks (gpt-oss): a learned logit ``sinks[h]`` per query head joins every row's softmax
denominator and contributes no value, ``o = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))``.
SDPA takes it as one extra key whose score is the sink and whose value is zero; the tiled kernel
starts each row's online softmax from it (max = sink, sum = 1, nothing accumulated); the CUDA path
rescales FlashAttention's output by its log-sum-exp (``attention_gpu.sink_rescale``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from ..errors import LogprobeError
from ..parallel.rows import RowSplit
from .attention_gpu import (
    LONG_ROWS,
    causal_tail_attention,
    cu_tensors,
    cudnn_dense,
    flash_varlen_attention,
    host_to,
    triton_varlen_attention,
)


@dataclass(slots=True)
class KVCache:
    """Keys/values of the rows already run for one chunked sequence, per layer ([past, Hkv, D]).
    A layer's entry may also be a list of such tensors, in row order (several cached prefixes,
    ``engine.prefix_run.ResumePack``): the first ``extend`` joins them with the new rows in one copy."""

    keys: list[torch.Tensor | list[torch.Tensor] | None]
    values: list[torch.Tensor | list[torch.Tensor] | None]
    # linear-attention layers (layers.linear_state): each layer's state after the rows committed so
    # far, and the state a pass in flight has reached (``commit`` makes it the carried one)
    states: dict[int, object] = field(default_factory=dict)
    pending: dict[int, object] = field(default_factory=dict)

    @classmethod
    def empty(cls, num_layers: int) -> KVCache:
        return cls([None] * num_layers, [None] * num_layers)

    def commit(self) -> None:
        """The pass that wrote ``pending`` ran in full: its states are the carried ones now."""
        self.states.update(self.pending)
        self.pending.clear()

    def discard(self) -> None:
        """The pass failed part-way (out of memory): forget what it wrote."""
        self.pending.clear()

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this batch's k/v [T, Hkv, D]; return the key source [past + T, Hkv, D] of the layer
        (a new tensor: the cached rows are read, never written).

        >>> c = KVCache([[torch.zeros(2, 1, 1), torch.ones(1, 1, 1)]], [[torch.zeros(2, 1, 1), torch.ones(1, 1, 1)]])
        >>> c.extend(0, torch.full((1, 1, 1), 2.0), torch.full((1, 1, 1), 2.0))[0].flatten().tolist()
        [0.0, 0.0, 1.0, 2.0]
        """
        if self.keys[layer] is not None:
            k = torch.cat([*_parts(self.keys[layer]), k])
            v = torch.cat([*_parts(self.values[layer]), v])
        self.keys[layer], self.values[layer] = k, v
        return k, v


def _parts(x: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return x if isinstance(x, list) else [x]


@dataclass(frozen=True, slots=True)
class Segment:
    """Query rows ``start:end`` of the batch; ``context``: key-source row spans seen in full, in
    position order, before the segment's own rows (which are key-source rows past+start:past+end).
    ``spans``: bidirectional spans [a, e) in the segment's key indices (context keys first, then
    its own rows), each within its own rows: a row at key index a <= i < e sees keys 0 .. e - 1
    (a sliding window still applies: i - j < window), not only 0 .. i (Gemma 3's image tokens)."""

    start: int
    end: int
    context: tuple[tuple[int, int], ...] = ()
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def num_context(self) -> int:
        return sum(b - a for a, b in self.context)


@dataclass(frozen=True, slots=True)
class GraphCut:
    """A call whose work depends on the batch's layout (attention over segments, the linear
    attention's scan), cut out of a captured CUDA graph (``engine.graphs``): while capturing, a
    layer hands ``meta.graph_cut`` this and its row tensors ([T, ...] each) instead of calling;
    each replay calls ``fn(*rows, meta, *args)`` on the pass's own meta.

    >>> GraphCut(lambda x, meta, k: x * k, (3,))(torch.ones(2), None).tolist()
    [3.0, 3.0]
    """

    fn: object
    args: tuple

    def __call__(self, *rows_and_meta):
        return self.fn(*rows_and_meta, *self.args)


@dataclass(slots=True)
class AttentionMeta:
    """Who attends to what in one forward pass (see the module docstring).

    segments: tile the batch rows in order. cache: cached keys/values, which precede this batch's
    in the key source; this batch's keys/values are appended to it. It holds one chunked sequence's
    earlier chunks, or several sequences' cached prefixes one after another (``engine.prefix_run``),
    each segment's context span naming its own rows. kv_block: None = fastest kernel; an int = the
    deterministic tiled kernel with that query tile / KV split size.
    """

    segments: list[Segment]
    cache: KVCache | None = None
    kv_block: int | None = None
    past: int = field(default=0)  # rows in the cache before this batch (for the key-source index)
    varlen_cache: tuple | None = field(default=None, repr=False)  # varlen() for the GPU path, built once
    split_cache: tuple | None = field(default=None, repr=False)  # _gpu's long / short split, built once
    span_cache: tuple | None = field(default=None, repr=False)  # span_plan() for the GPU path, built once
    plan_cache: dict = field(default_factory=dict, repr=False)  # default mode's kernel programs, built once
    state_route: object = field(default=None, repr=False)  # layers.linear_state.route_states, built once
    # while ``engine.graphs`` captures a pass: called in place of a layout-dependent call (the cut
    # between two graphs), as ``graph_cut(GraphCut(...), *row_tensors) -> out``
    graph_cut: object = field(default=None, repr=False)
    # data-parallel attention (``parallel.rows``): this meta is rank ``rows.rank``'s share of a batch
    # split by sequences over the group, its segments re-based to its own first row; None: every row
    rows: RowSplit | None = None

    @classmethod
    def packed(cls, lengths: list[int], kv_block: int | None = None) -> AttentionMeta:
        """Independent causal sequences of these lengths, concatenated (the cu_seqlens layout)."""
        segs, start = [], 0
        for n in lengths:
            segs.append(Segment(start, start + n))
            start += n
        return cls(segs, kv_block=kv_block)

    @property
    def num_rows(self) -> int:
        return self.segments[-1].end if self.segments else 0

    def cuts(self) -> list[int]:
        """The rows at which the batch may be cut between ranks (``parallel.rows.assign_rows``):
        0, the row count, and each segment's start unless a segment from there on reads keys
        before it (a shared prefix stays with its branches). Only for a batch with no cache.

        >>> AttentionMeta([Segment(0, 4), Segment(4, 6, ((0, 4),)), Segment(6, 9, ((0, 4),)), Segment(9, 12)]).cuts()
        [0, 9, 12]
        """
        if self.cache is not None or self.past:
            raise ValueError("a batch over cached keys is not cut between ranks")
        cuts, low = [self.num_rows], self.num_rows
        for seg in reversed(self.segments):  # low: the first row any segment from here on reads
            low = min([low, seg.start, *(a for a, _ in seg.context)])
            if low == seg.start and 0 < seg.start < cuts[-1]:
                cuts.append(seg.start)
        if cuts[-1] != 0:
            cuts.append(0)
        return cuts[::-1]

    def share(self, split: RowSplit) -> AttentionMeta:
        """Rank ``split.rank``'s rows of this batch (``split.own``, cut at ``cuts``) as a batch of
        their own: the segments inside them, shifted to start at row 0 (context spans too).

        >>> meta = AttentionMeta([Segment(0, 4), Segment(4, 6, ((0, 4),)), Segment(6, 9)], kv_block=2)
        >>> meta.share(RowSplit((0, 6, 9), rank=1)).segments, meta.share(RowSplit((0, 6, 9), rank=1)).kv_block
        ([Segment(start=0, end=3, context=(), spans=())], 2)
        """
        a, b = split.own
        segs = [Segment(s.start - a, s.end - a, tuple((c0 - a, c1 - a) for c0, c1 in s.context), s.spans)
                for s in self.segments if a <= s.start and s.end <= b and s.end > s.start]
        return AttentionMeta(segs, kv_block=self.kv_block, rows=split)

    def varlen(self) -> tuple[list[int], list[int], list[int]]:
        """The same mask for a varlen kernel: ``cu_seqlens_q``, ``cu_seqlens_k`` and the key-source
        rows to gather (``key_index``) so segment s's keys are ``key_index[cu_k[s]:cu_k[s+1]]``;
        causal bottom-right within each segment. (A FlexAttention block mask can be built from it.)"""
        return varlen_index(self.segments, self.past)


def varlen_index(segments: list[Segment], past: int) -> tuple[list[int], list[int], list[int]]:
    """``AttentionMeta.varlen`` of some segments: cu_q counts their query rows in the order given
    (packed one after the other), cu_k and the key-source rows their keys.

    >>> varlen_index([Segment(0, 2), Segment(2, 3, ((0, 1),))], past=0)
    ([0, 2, 3], [0, 2, 4], [0, 1, 0, 2])
    """
    cu_q, cu_k, index = [0], [0], []
    for s in segments:
        for a, b in s.context:
            index.extend(range(a, b))
        index.extend(range(past + s.start, past + s.end))
        cu_q.append(cu_q[-1] + s.end - s.start)
        cu_k.append(len(index))
    return cu_q, cu_k, index


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMeta,
    layer: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    bidirectional: bool = True,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of this batch -> [T, Hq, D]; Hq a multiple of Hkv (GQA).
    ``sinks`` [Hq]: each head's sink logit (module docstring), None for none. ``bidirectional``:
    whether this layer runs the segments' bidirectional spans (Gemma 4: its sliding layers only)."""
    if meta.graph_cut is not None:  # a CUDA graph is being captured: attention runs between replays
        return meta.graph_cut(GraphCut(packed_attention, (layer, scale, sliding_window, sinks, bidirectional)), q, k, v)
    if q.shape[0] == 0 and meta.cache is None:  # a rank with no rows of a split batch (``AttentionMeta.rows``)
        return torch.empty_like(q)
    if meta.cache is not None:
        k, v = meta.cache.extend(layer, k, v)  # key source [past + T, Hkv, D]
    past = k.shape[0] - q.shape[0]
    spans = [seg for seg in meta.segments if seg.spans] if bidirectional else []
    if spans and sinks is not None:
        raise LogprobeError("sinks", "bidirectional spans are not run with attention sinks",
                            "score images with a model without attention sinks")
    if q.is_cuda:
        # one varlen call for the whole batch (layers/attention_gpu.py); also in deterministic
        # mode: a row's key blocks start at its sequence's first key and run in a fixed order,
        # whatever else is packed (tests/test_gpu.py checks bitwise invariance)
        o = _gpu(q, k, v, meta, past, scale, sliding_window, sinks)
        if o is not None:
            if spans and not _gpu_spans(o, q, k, v, meta, past, scale, sliding_window):
                for seg in spans:
                    _overwrite_spans(o, q, k, v, seg, past, scale, sliding_window, meta.kv_block)
            return o
    out = torch.empty_like(q)
    for seg in meta.segments:
        if seg.end == seg.start:
            continue
        ks, vs = _segment_keys(k, seg, past), _segment_keys(v, seg, past)  # [c + n, Hkv, D]
        qs = q[seg.start:seg.end]
        if meta.kv_block is None:
            out[seg.start:seg.end] = _sdpa(qs, ks, vs, scale, sliding_window, sinks)
        else:
            out[seg.start:seg.end] = _tiled(qs, ks, vs, scale, sliding_window, meta.kv_block, sinks)
    for seg in spans:
        _overwrite_spans(out, q, k, v, seg, past, scale, sliding_window, meta.kv_block)
    return out


def _overwrite_spans(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segment, past: int,
                     scale: float, window: int | None, block: int | None) -> None:
    """The rows of each bidirectional span [a, e) of ``seg`` computed again as queries at key
    indices a .. e - 1 over the keys 0 .. e - 1 with no causal mask (only the window), written over
    their causal rows in ``out``: the other rows keep their bits, and a span row's bits depend on
    its query and keys alone (the tiled kernel's blocks aligned to key index 0, as ``_tiled``)."""
    ks, vs = _segment_keys(k, seg, past), _segment_keys(v, seg, past)  # [c + n, Hkv, D]
    for a, e in seg.spans:
        rows = slice(*_span_rows(seg, a, e))
        if block is None:
            out[rows] = _sdpa_open(q[rows], ks[:e], vs[:e], scale, window)
        else:
            out[rows] = _tiled(q[rows], ks[:e], vs[:e], scale, window, block, causal=False)


def _span_rows(seg: Segment, a: int, e: int) -> tuple[int, int]:
    """The batch rows of span [a, e) of ``seg`` (key indices; its context keys come first)."""
    c = seg.num_context
    if not c <= a < e <= c + seg.end - seg.start:
        raise LogprobeError("images", f"span {a}..{e - 1} is not within the segment's own rows {c}.."
                            f"{c + seg.end - seg.start - 1}", "report this: a pass was cut inside an image")
    return seg.start + a - c, seg.start + e - c


def span_plan(segments: list[Segment], past: int, device: torch.device) -> tuple:
    """Every bidirectional span of ``segments`` as one varlen call of its own (``_gpu_spans``):
    span s's queries are its rows, its keys the first e keys of its segment (context, then own
    rows) -> (query rows [S], key-source rows [K] on ``device``, cu_q, cu_k, and both on ``device``).
    Segment b (two context rows, own rows 3..6 of the batch) with a span over key indices 3 and 4:

    >>> plan = span_plan([Segment(0, 3), Segment(3, 7, ((0, 2),), spans=((3, 5),))], 0, torch.device("cpu"))
    >>> plan[0].tolist(), plan[1].tolist(), plan[2], plan[3]
    ([4, 5], [0, 1, 3, 4, 5], [0, 2], [0, 5])
    """
    rows, keys, cu_q, cu_k = [], [], [0], [0]
    for seg in segments:
        for a, e in seg.spans:
            r0, r1 = _span_rows(seg, a, e)
            rows.append(torch.arange(r0, r1))
            left = e  # the segment's first e keys, run by run of the key source
            for k0, k1 in [*seg.context, (past + seg.start, past + seg.end)]:
                take = min(left, k1 - k0)
                keys.append(torch.arange(k0, k0 + take))
                left -= take
            cu_q.append(cu_q[-1] + r1 - r0)
            cu_k.append(cu_k[-1] + e)
    rows_t, keys_t = (host_to(torch.cat(x), device) for x in (rows, keys))
    return rows_t, keys_t, cu_q, cu_k, cu_tensors(cu_q, cu_k, device)


def _gpu_spans(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
               past: int, scale: float, window: int | None) -> bool:
    """``_overwrite_spans`` for every span of the batch in one non-causal varlen FlashAttention
    call (each span a sequence whose keys start at its segment's first key, so its rows' bits
    depend on nothing else in the batch, in deterministic mode too); False where FlashAttention
    does not take the shapes (the caller then runs ``_overwrite_spans``)."""
    if meta.span_cache is None:  # once per batch, not per layer
        meta.span_cache = span_plan(meta.segments, past, q.device)
    rows, keys, cu_q, cu_k, cu = meta.span_cache
    o = flash_varlen_attention(q[rows], k[keys], v[keys], cu_q, cu_k, scale, window, cu=cu, causal=False)
    if o is None:
        return False
    out[rows] = o
    return True


def _sdpa_open(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """Queries q [n, Hq, D] at key indices c .. c + n - 1 over every key k/v [c + n, Hkv, D], but
    those past the window (i - j >= window) -> [n, Hq, D]."""
    n, c = q.shape[0], k.shape[0] - q.shape[0]
    mask = None
    if window is not None:
        qi = torch.arange(c, c + n, device=q.device)[:, None]
        mask = qi - torch.arange(c + n, device=q.device)[None, :] < window
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


def _gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta, past: int, scale: float,
         window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """The CUDA kernels (layers/attention_gpu.py). Default mode: segments of ``LONG_ROWS`` rows or
    more on cuDNN, the rest in one call of the project's varlen kernel (``kernels.attention``:
    head_dim 64 and 128) or of FlashAttention-2. Deterministic mode: every segment in one call of
    the same varlen kernel (batch-invariant, as FlashAttention-2 is) or of FlashAttention-2.
    Windows and sinks: FlashAttention-2."""
    if meta.kv_block is not None or window is not None or sinks is not None:
        return _flash(q, k, v, meta, scale, window, sinks, fast=window is None and sinks is None)
    if meta.split_cache is None:  # once per batch, not per layer
        meta.split_cache = _split(meta, past, q.device)
    long, short = meta.split_cache
    if not long:
        return _flash(q, k, v, meta, scale, window, fast=True)
    out = torch.empty_like(q)
    for seg in long:
        ks, vs = _segment_keys(k, seg, past), _segment_keys(v, seg, past)
        o = causal_tail_attention(q[seg.start:seg.end], ks, vs, partial(cudnn_dense, scale=scale))
        if o is None:  # cuDNN refused the shape: the whole batch on FlashAttention
            return _flash(q, k, v, meta, scale, window)
        out[seg.start:seg.end] = o
    if short is not None:
        rows, keys, cu_q, cu_k, cu = short
        o = _varlen(q[rows], k[keys], v[keys], cu_q, cu_k, cu, scale, window, plans=meta.plan_cache)
        if o is None:
            return _flash(q, k, v, meta, scale, window)
        out[rows] = o
    return out


def _split(meta: AttentionMeta, past: int, device: torch.device) -> tuple[list[Segment], tuple | None]:
    """The segments ``_gpu`` runs on cuDNN, and for the others (None if none): their query rows
    [T short], key-source rows, cu_q and cu_k of one varlen call."""
    long = [s for s in meta.segments if s.end - s.start >= LONG_ROWS]
    short = [s for s in meta.segments if s.end - s.start < LONG_ROWS]
    if not long or not short:
        return long, None
    cu_q, cu_k, index = varlen_index(short, past)
    rows = host_to(torch.cat([torch.arange(s.start, s.end) for s in short]), device)  # [T short]
    keys = host_to(torch.tensor(index, dtype=torch.long), device)
    return long, (rows, keys, cu_q, cu_k, cu_tensors(cu_q, cu_k, device))


def _segment_keys(x: torch.Tensor, seg: Segment, past: int) -> torch.Tensor:
    """One segment's keys (or values) from the key source [past + T, Hkv, D]: its context spans, then
    its own rows; a slice, not a copy, when they follow each other (a chunk over its cache)."""
    spans = [*seg.context, (past + seg.start, past + seg.end)]
    if all(a1 == b0 for (_, a1), (b0, _) in zip(spans, spans[1:])):
        return x[spans[0][0]:spans[-1][1]]
    return torch.cat([x[a:b] for a, b in spans])


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta, scale: float,
           window: int | None, sinks: torch.Tensor | None = None, fast: bool = False) -> torch.Tensor | None:
    """The varlen form of ``meta``: each segment's keys (context spans + own rows) gathered into
    one packed key tensor; FlashAttention aligns the causal diagonal bottom-right, as segments do.
    ``fast`` (default mode, no window nor sinks): the project's kernel where it runs."""
    if meta.varlen_cache is None:  # once per batch, not per layer (``varlen_plan``)
        meta.varlen_cache = varlen_plan(meta, k.shape[0], q.device)
    cu_q, cu_k, keys, cu = meta.varlen_cache
    if isinstance(keys, torch.Tensor):
        k, v = k[keys], v[keys]  # [total keys, Hkv, D]
    elif keys != (0, k.shape[0]):
        k, v = k[keys[0]:keys[1]], v[keys[0]:keys[1]]
    return _varlen(q, k, v, cu_q, cu_k, cu, scale, window, sinks, meta.plan_cache if fast else None)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int], cu: tuple,
            scale: float, window: int | None, sinks: torch.Tensor | None = None, plans: dict | None = None
            ) -> torch.Tensor | None:
    """One varlen call over packed keys: the project's kernel where it runs (``plans``, the batch's
    ``AttentionMeta.plan_cache``; None: not tried), else FlashAttention-2; None where neither does."""
    if plans is not None:
        o = triton_varlen_attention(q, k, v, cu_q, cu_k, scale, cu, plans)
        if o is not None:
            return o
    return flash_varlen_attention(q, k, v, cu_q, cu_k, scale, window, sinks, cu=cu)


def varlen_plan(meta: AttentionMeta, num_keys: int, device: torch.device) -> tuple:
    """What ``_flash`` needs of ``meta`` for every layer: cu_q, cu_k (lists), the keys to pass, and
    cu_q, cu_k on ``device``. The keys: the key-source rows ``(a, b)`` when the segments' keys
    follow each other there (a slice: one sequence over its cached rows, a resumed request over its
    cached prefix, independent sequences), else a row index [total keys] to gather them.

    >>> plan = varlen_plan(AttentionMeta([Segment(0, 2, ((0, 5),))], past=5), 7, torch.device("cpu"))
    >>> plan[:3]    # a request resumed over its 5 cached rows reads the key source as it is
    ([0, 2], [0, 7], (0, 7))
    >>> varlen_plan(AttentionMeta([Segment(0, 3), Segment(3, 5, ((0, 3),))]), 5, torch.device("cpu"))[2]
    tensor([0, 1, 2, 0, 1, 2, 3, 4])
    """
    cu_q, cu_k, runs = [0], [0], []  # runs: [a, b) key-source rows, in key order, merged
    for s in meta.segments:
        for a, b in [*s.context, (meta.past + s.start, meta.past + s.end)]:
            if runs and runs[-1][1] == a:
                runs[-1][1] = b
            elif b > a:
                runs.append([a, b])
        cu_q.append(cu_q[-1] + s.end - s.start)
        cu_k.append(cu_k[-1] + s.num_context + s.end - s.start)
    if len(runs) <= 1:
        keys: tuple[int, int] | torch.Tensor = tuple(runs[0]) if runs else (0, 0)
    else:  # the row index built from ranges, not from a host list of every key
        keys = host_to(torch.cat([torch.arange(a, b) for a, b in runs]), device)  # [total keys]
    return cu_q, cu_k, keys, cu_tensors(cu_q, cu_k, device)


def _visible(qi: torch.Tensor, kj: torch.Tensor, window: int | None) -> torch.Tensor:
    """Key index kj is visible from the query at key index qi (the transformers convention for
    sliding windows: qi - window < kj <= qi)."""
    mask = kj <= qi
    if window is not None:
        mask = mask & (qi - kj < window)
    return mask


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One segment: q [n, Hq, D], k/v [c + n, Hkv, D] -> [n, Hq, D] with PyTorch SDPA."""
    n, c = q.shape[0], k.shape[0] - q.shape[0]
    gqa = q.shape[1] != k.shape[1]
    # 4-D inputs let SDPA pick its fused (flash) CPU kernel instead of the math path
    qs = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    ks = k.transpose(0, 1)[None]  # [1, Hkv, c + n, D]
    vs = v.transpose(0, 1)[None]
    if sinks is not None:
        return _sdpa_sinks(qs, ks, vs, c, scale, window, sinks)
    if c == 0 and (window is None or n <= window):
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
    else:  # is_causal aligns top-left; with context the diagonal is shifted by c
        qi = torch.arange(c, c + n, device=q.device)[:, None]
        kj = torch.arange(c + n, device=q.device)[None, :]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=_visible(qi, kj, window), scale=scale,
                                           enable_gqa=gqa)
    return o[0].transpose(0, 1)  # [n, Hq, D]


def _sdpa_sinks(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, c: int, scale: float, window: int | None,
                sinks: torch.Tensor) -> torch.Tensor:
    """``_sdpa`` with a sink per head: one more key, first, whose score is the head's sink and whose
    value is zero, so it adds exp(sink) to the denominator and nothing else. The score comes from
    one extra dimension (1 in every query, 0 in every real key, sink / scale in the sink key; k/v
    repeated per query head), so the mask stays one boolean [n, 1 + c + n] shared by the heads.
    qs [1, Hq, n, D], ks/vs [1, Hkv, c + n, D] -> [n, Hq, D]."""
    Hq, n, D = qs.shape[1], qs.shape[2], qs.shape[3]
    g = Hq // ks.shape[1]
    ks, vs = ks.repeat_interleave(g, dim=1), vs.repeat_interleave(g, dim=1)  # [1, Hq, c + n, D]
    sink_key = torch.zeros(1, Hq, 1, D + 1, dtype=qs.dtype, device=qs.device)
    sink_key[0, :, 0, D] = sinks.to(qs.dtype) / scale
    q1 = F.pad(qs, (0, 1), value=1.0)  # [1, Hq, n, D + 1]
    k1 = torch.cat([sink_key, F.pad(ks, (0, 1))], 2)  # [1, Hq, 1 + c + n, D + 1]
    v1 = torch.cat([torch.zeros_like(vs[:, :, :1]), vs], 2)  # [1, Hq, 1 + c + n, D]
    qi = torch.arange(c, c + n, device=qs.device)[:, None]
    kj = torch.arange(c + n, device=qs.device)[None, :]
    mask = torch.cat([torch.ones(n, 1, dtype=torch.bool, device=qs.device), _visible(qi, kj, window)], 1)
    o = F.scaled_dot_product_attention(q1, k1, v1, attn_mask=mask, scale=scale)  # [1, Hq, n, D]
    return o[0].transpose(0, 1)  # [n, Hq, D]


def _tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
           block: int, sinks: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """The deterministic kernel for one segment: q [n, Hq, D], k/v [c + n, Hkv, D] -> [n, Hq, D].

    Query rows sit in tiles of ``block`` rows at their key index (tile t holds key indices
    t*B .. t*B + B - 1, zero rows elsewhere); keys in blocks of B from index 0 (sequence starts
    aligned to the block). For each key block, in order, every query tile that reaches it does
    fixed-shape [B, D] x [D, B] and [B, B] x [B, D] products (batched over tiles and heads, never
    split along D or the keys) and an online-softmax update. So a row meets the same blocks, in
    the same order, through the same shapes, whatever else is in the call. (With a sliding
    window a block fully masked for a row leaves its state bitwise unchanged: alpha = 1, zero
    weights.) With ``sinks`` [Hq] every row starts from its head's sink (running max = sink,
    sum = 1, nothing accumulated): a row's bits still depend on nothing else in the call.
    ``causal=False`` (a bidirectional span, ``_overwrite_spans``): every key is visible but for
    the window (``_open_blocks``).
    """
    n, Hq, D = q.shape
    total, Hkv = k.shape[0], k.shape[1]
    B = block
    first = (total - n) // B  # tile of the first query row
    n_tiles = -(-total // B) - first
    n_blocks = -(-total // B)
    qbuf = q.new_zeros(n_tiles * B, Hq, D)
    off = total - n - first * B
    qbuf[off:off + n] = q
    qt = qbuf.view(n_tiles, B, Hq, D).transpose(1, 2).contiguous()  # [tiles, Hq, B, D]
    kbuf = k.new_zeros(n_blocks * B, Hkv, D)
    kbuf[:total] = k
    vbuf = v.new_zeros(n_blocks * B, Hkv, D)
    vbuf[:total] = v
    g = Hq // Hkv
    # [blocks, Hq, B, D]: each query head next to its kv head (GQA), as SDPA's enable_gqa
    kb = kbuf.view(n_blocks, B, Hkv, D).transpose(1, 2).repeat_interleave(g, dim=1).contiguous()
    vb = vbuf.view(n_blocks, B, Hkv, D).transpose(1, 2).repeat_interleave(g, dim=1).contiguous()
    m = q.new_full((n_tiles, Hq, B, 1), -torch.inf, dtype=torch.float32)
    s = q.new_zeros((n_tiles, Hq, B, 1), dtype=torch.float32)
    acc = q.new_zeros((n_tiles, Hq, B, D), dtype=torch.float32)
    if sinks is not None:  # exp(sink - max) joins the denominator; no value
        m = sinks.float().view(1, Hq, 1, 1).expand(n_tiles, Hq, B, 1).contiguous()
        s = torch.ones_like(s)
    if not causal:
        _open_blocks(qt, kb, vb, m, s, acc, first, scale, window, total)
    elif window is None:
        _causal_blocks(qt, kb, vb, m, s, acc, first, scale)
    else:
        _window_blocks(qt, kb, vb, m, s, acc, first, scale, window, total)
    o = (acc / s).to(q.dtype)  # [tiles, Hq, B, D]
    return o.transpose(1, 2).reshape(n_tiles * B, Hq, D)[off:off + n]


def _causal_blocks(qt, kb, vb, m, s, acc, first: int, scale: float) -> None:
    """Online softmax over key blocks 0, 1, ... (no window). Tile t (absolute index first + t)
    meets blocks 0 .. first + t, and only the last of them (its diagonal) needs a mask; every
    row sees key 0 in block 0, so the running max is finite from the first block on."""
    B = qt.shape[2]
    diag = torch.ones(B, B, dtype=torch.bool, device=qt.device).tril().logical_not()  # [B, B] future keys
    qt = qt * scale
    for b in range(kb.shape[0]):
        lo = max(0, b - first)  # tiles before block b's diagonal never see it
        z = torch.matmul(qt[lo:], kb[b].transpose(-1, -2)).float()  # [t, Hq, B, B]
        if b >= first:
            z[0].masked_fill_(diag, -torch.inf)  # tile lo is on the diagonal
        m_new = torch.maximum(m[lo:], z.amax(-1, keepdim=True))
        alpha = torch.exp(m[lo:] - m_new)
        p = torch.exp(z - m_new)  # [t, Hq, B, B]
        s[lo:].mul_(alpha).add_(p.sum(-1, keepdim=True))
        acc[lo:].mul_(alpha).add_(torch.matmul(p.to(vb.dtype), vb[b]).float())
        m[lo:] = m_new


def _window_blocks(qt, kb, vb, m, s, acc, first: int, scale: float, window: int, total: int) -> None:
    """The same with a sliding window: a row may see nothing in a block, or nothing yet (its
    running max still -inf), which the update handles as an exact no-op."""
    n_tiles, _, B, _ = qt.shape
    qi = (first * B + torch.arange(n_tiles * B, device=qt.device)).view(n_tiles, 1, B, 1)  # key index of a query
    for b in range(kb.shape[0]):
        lo = max(0, b - first)
        # tiles whose every query is past the window of this block
        hi = min(n_tiles, (b * B + B - 1 + window - 1) // B - first + 1)
        if lo >= hi:
            continue
        kj = (b * B + torch.arange(B, device=qt.device)).view(1, 1, 1, B)
        mask = _visible(qi[lo:hi], kj, window) & (kj < total)  # [t, 1, B, B]
        z = torch.matmul(qt[lo:hi], kb[b].transpose(-1, -2)).float() * scale  # [t, Hq, B, B]
        z = z.masked_fill(~mask, -torch.inf)
        m_old = m[lo:hi]
        m_new = torch.maximum(m_old, z.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows that saw nothing yet
        alpha = torch.exp(m_old - m_safe)
        p = torch.exp(z - m_safe)  # [t, Hq, B, B]
        s[lo:hi] = s[lo:hi] * alpha + p.sum(-1, keepdim=True)
        acc[lo:hi] = acc[lo:hi] * alpha + torch.matmul(p.to(vb.dtype), vb[b]).float()
        m[lo:hi] = m_new


def _open_blocks(qt, kb, vb, m, s, acc, first: int, scale: float, window: int | None, total: int) -> None:
    """``_window_blocks`` with no causal mask: every tile meets every key block (but those wholly
    past its window), the keys past ``total`` (padding) and, with a window, those with
    i - j >= window masked; a row that saw nothing yet is handled as an exact no-op there."""
    n_tiles, _, B, _ = qt.shape
    qi = (first * B + torch.arange(n_tiles * B, device=qt.device)).view(n_tiles, 1, B, 1)  # key index of a query
    for b in range(kb.shape[0]):
        hi = n_tiles if window is None else min(n_tiles, (b * B + B - 1 + window - 1) // B - first + 1)
        if hi <= 0:
            continue
        kj = (b * B + torch.arange(B, device=qt.device)).view(1, 1, 1, B)
        mask = kj < total
        if window is not None:
            mask = mask & (qi[:hi] - kj < window)  # [t, 1, B, B]
        z = torch.matmul(qt[:hi], kb[b].transpose(-1, -2)).float() * scale  # [t, Hq, B, B]
        z = z.masked_fill(~mask, -torch.inf)
        m_old = m[:hi]
        m_new = torch.maximum(m_old, z.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows that saw nothing yet
        alpha = torch.exp(m_old - m_safe)
        p = torch.exp(z - m_safe)  # [t, Hq, B, B]
        s[:hi] = s[:hi] * alpha + p.sum(-1, keepdim=True)
        acc[:hi] = acc[:hi] * alpha + torch.matmul(p.to(vb.dtype), vb[b]).float()
        m[:hi] = m_new
