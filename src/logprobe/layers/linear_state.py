"""Carried state for linear-attention layers over a packed batch described by ``AttentionMeta``.

A full-attention layer sees a segment's context through keys (``layers.attention``); a
linear-attention layer (``layers.gated_delta``) sees it only through the *state* reached at the
end of that context: the recurrent state and the short convolution's last inputs. The same
``AttentionMeta`` says where each segment's state comes from (``route_states``):

* no context: a fresh (zero) state: the segment starts its sequence;
* context ``((0, past),)`` with a chunk cache: the state the earlier chunks of its sequence left in
  ``meta.cache.states[layer]``;
* context exactly the rows of an earlier segment of this batch (a shared prefix): that segment's
  final state.

Segments that read another segment's state run after it: ``route_states`` groups them in *levels*
(level 0 reads no segment of this batch; a prefix tree has two levels). Within a level every
segment is computed independently of the others (``cu_seqlens``), so a segment's numbers do not
depend on what else is packed.

Worked example, a prefix tree of a 3-row prefix and two branches, packed at rows 0..2, 3..4, 5::

    >>> from .attention import AttentionMeta, Segment
    >>> meta = AttentionMeta([Segment(0, 3), Segment(3, 5, ((0, 3),)), Segment(5, 6, ((0, 3),))])
    >>> route_states(meta)
    StateRoute(sources=(None, 0, 0), levels=((0,), (1, 2)))

Where a sequence may be cut (chunks, prefixes) so that the cut changes no bit is the kernel's
business: the chunked rule reproduces the whole run's bits only at multiples of its chunk size
counted from the sequence start (``layers.gated_delta``); the engine's planner cuts there
(``engine.scheduler.plan_work(align=...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..errors import LogprobeError
from ..kernels import host_values_to
from .attention import AttentionMeta, GraphCut
from .gated_delta import GatedDeltaState, causal_conv1d, decay_and_beta, gated_delta_rule_chunked

CACHE = -1  # ``StateRoute.sources``: the segment continues the chunk cache's state


@dataclass(frozen=True, slots=True)
class StateRoute:
    """``sources[s]``: None (fresh state), ``CACHE`` or the index of the segment whose final state
    segment s starts from. ``levels``: segment indices in the order they can run."""

    sources: tuple[int | None, ...]
    levels: tuple[tuple[int, ...], ...]


def route_states(meta: AttentionMeta) -> StateRoute:
    """Where each segment's initial linear-attention state comes from (see the module docstring).
    Refuses a context that is neither the cache nor exactly one earlier segment."""
    past = meta.past
    by_rows = {(past + s.start, past + s.end): i for i, s in enumerate(meta.segments)}
    sources: list[int | None] = []
    for i, seg in enumerate(meta.segments):
        if not seg.context:
            sources.append(None)
        elif seg.context == ((0, past),) and past and meta.cache is not None:
            sources.append(CACHE)
        elif len(seg.context) == 1 and by_rows.get(seg.context[0], i) < i:
            sources.append(by_rows[seg.context[0]])
        else:
            raise LogprobeError("context", f"segment {i}'s context {seg.context} is neither the chunk cache nor "
                                "one earlier segment: a linear-attention layer cannot resume from it")
    level = [0] * len(sources)
    for i, src in enumerate(sources):
        if src is not None and src != CACHE:
            level[i] = level[src] + 1
    levels = tuple(tuple(i for i in range(len(sources)) if level[i] == lv) for lv in range(max(level, default=-1) + 1))
    return StateRoute(tuple(sources), levels)


Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # gated_delta_rule_chunked's signature
Conv = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # causal_conv1d's signature


@dataclass(slots=True)
class DeltaInputs:
    """One layer's per-token inputs to the mixer core, all rows of the batch: ``mixed`` [T, C] the
    conv's input (``[q | k | v]`` channels), ``a``, ``b`` [T, Hv] the decay and write-strength
    logits; and its parameters: ``conv_weight`` [C, K], ``A_log``, ``dt_bias`` [Hv]."""

    mixed: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    conv_weight: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    key_dim: int  # Hk * Dk on this rank
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int


def _core_rows(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: AttentionMeta, x: DeltaInputs,
               layer: int, rule: Rule, conv: Conv, decay: Callable | None) -> torch.Tensor:
    """``packed_gated_delta`` on these rows (a replayed graph's cut: ``engine.graphs``)."""
    return packed_gated_delta(replace(x, mixed=mixed, a=a, b=b), meta, layer, rule, conv, decay)


def packed_gated_delta(x: DeltaInputs, meta: AttentionMeta, layer: int, rule: Rule = gated_delta_rule_chunked,
                       conv: Conv = causal_conv1d, decay: Callable | None = None) -> torch.Tensor:
    """The mixer core over a packed batch: conv + SiLU, the gated delta rule, each segment from the
    state ``route_states`` names. Returns ``o [T, Hv, Dv]`` (before the gated norm). A pass with a
    chunk cache leaves its one segment's final state in ``meta.cache.pending[layer]``.

    ``decay(a, b, A_log, dt_bias) -> (g, beta)`` defaults to ``gated_delta.decay_and_beta``."""
    if meta.graph_cut is not None:  # a CUDA graph is being captured: the core runs between replays
        return meta.graph_cut(GraphCut(_core_rows, (x, layer, rule, conv, decay)), x.mixed, x.a, x.b)
    if meta.state_route is None:  # once per batch, not per layer
        meta.state_route = route_states(meta)
    route = meta.state_route
    g, beta = (decay or decay_and_beta)(x.a, x.b, x.A_log, x.dt_bias)
    T = x.mixed.shape[0]
    out = x.mixed.new_empty((T, x.num_v_heads, x.head_v_dim))
    finals: dict[int, GatedDeltaState] = {}
    segs = meta.segments
    for level in route.levels:
        idx = [s for s in level if segs[s].end > segs[s].start]
        if not idx:
            continue
        lengths = [segs[s].end - segs[s].start for s in idx]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        lo = segs[idx[0]].start
        span = all(segs[s].start == lo + cu[j] for j, s in enumerate(idx))  # one row range: views, no gather
        rows = (slice(lo, lo + cu[-1]) if span else  # else the rows' indices, copied without a host sync
                host_values_to(torch.cat([torch.arange(segs[s].start, segs[s].end) for s in idx]), torch.long,
                               x.mixed.device))
        def pick(t: torch.Tensor, rows: slice | torch.Tensor = rows) -> torch.Tensor:
            return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)

        conv0, rec0 = _initial(route, idx, finals, meta, layer)
        y, conv_fin = conv(pick(x.mixed), x.conv_weight, cu, conv0)
        T_l = y.shape[0]
        q, k, v = y.split([x.key_dim, x.key_dim, y.shape[1] - 2 * x.key_dim], dim=-1)
        q = q.reshape(T_l, x.num_k_heads, x.head_k_dim)  # [T_l, Hk * Dk] -> [T_l, Hk, Dk]
        k = k.reshape(T_l, x.num_k_heads, x.head_k_dim)
        v = v.reshape(T_l, x.num_v_heads, x.head_v_dim)  # [T_l, Hv * Dv] -> [T_l, Hv, Dv]
        o, rec_fin = rule(q, k, v, pick(g), pick(beta), cu, rec0)
        if span and cu[-1] == T:
            out = o  # the level is every row
        else:
            out[rows] = o
        for j, s in enumerate(idx):
            finals[s] = GatedDeltaState(conv_fin[j], rec_fin[j])
    if meta.cache is not None and meta.segments:
        last = len(meta.segments) - 1
        if last in finals:
            f = finals[last]
            meta.cache.pending[layer] = GatedDeltaState(f.conv[None], f.recurrent[None])
    return out


def _initial(route: StateRoute, idx: list[int], finals: dict[int, GatedDeltaState], meta: AttentionMeta,
             layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Stacked initial conv / recurrent states of segments ``idx`` (None where all are fresh)."""
    srcs = [route.sources[s] for s in idx]
    if all(src is None for src in srcs):
        return None, None
    conv, rec = [], []
    for s, src in zip(idx, srcs):
        if src == CACHE:
            st = meta.cache.states.get(layer) if meta.cache is not None else None
            if st is None:
                raise LogprobeError("context", f"segment {s} continues a chunk cache with no state for layer {layer}")
            conv.append(st.conv[0])
            rec.append(st.recurrent[0])
        elif src is not None:
            conv.append(finals[src].conv)
            rec.append(finals[src].recurrent)
        else:
            conv.append(None)
            rec.append(None)
    like_c = next(c for c in conv if c is not None)
    like_r = next(r for r in rec if r is not None)
    conv = [torch.zeros_like(like_c) if c is None else c for c in conv]
    rec = [torch.zeros_like(like_r) if r is None else r for r in rec]
    return torch.stack(conv), torch.stack(rec)
