"""How the engine uses its prefix cache (``engine.prefix_cache``) over one run.

* A request that steers, captures or reads/forces routed experts is never cached (its rows differ
  from a plain pass's, or it needs every row): ``cacheable``.
* A request with images is kept and found by its inputs with each image's tokens standing for
  the image's content (``engine.images.planned_ids``), so a prefix holding an image
  is resumed only by requests with that same image there. Such a request runs alone (chunks).
* Attention-only models: once a request of a call has a cached prefix, the call's cacheable
  requests (``resumable``) run after the others (those that may not be cached),
  packed several to a pass (``take_pack``, ``ResumePack``: one KV cache holding each distinct
  cached prefix once, each request's segment seeing its own prefix as its context span, and the
  rows of an earlier member where it shares more with that member than with the cache), a request
  whose new rows exceed the budget alone in chunks; the others run in the usual batches of prefix
  trees, their keys/values recorded (``keep_batch``), so the next run finds them.
* Hybrid models (``ModelCaps.state_align`` > 1): every cacheable request runs alone, resumed from
  its longest prefix ending at a stored state, its chunks ending also at the grid points where the
  states are stored (``ChunkKeeper``): only there does the state exist and match the uncut run.

Kept prefixes: the whole inputs (attention-only); for hybrids, up to the last grid point before
the first scored token (what a request sharing the prompt can resume from) and the last grid point
of the inputs (what a longer conversation repeating this one can resume from).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from ..errors import LogprobeError
from ..layers.attention import KVCache, Segment
from ..models.caps import ModelCaps
from .images import planned_ids
from .prefix_cache import PrefixCache, block_copy, resolve_budget
from .request import ScoreRequest
from .scheduler import Tree, common_prefix


def cacheable(r: ScoreRequest) -> bool:
    """Kept in and resumed from the cache: not a request with hooks."""
    return not r.hooked


def prefix_cache_for(model, setting: bool | int | None, device: torch.device) -> PrefixCache | None:
    """The cache ``Scorer(prefix_cache=setting)`` gives ``model`` (None: off); refused for a model
    that cannot resume a sequence from cached keys."""
    budget = resolve_budget(setting, device)
    if budget is None:
        return None
    caps = ModelCaps.of(model)
    if not caps.context:
        raise LogprobeError("prefix_cache", f"{type(model).__name__} cannot resume a sequence from cached keys",
                            "use a native model (GGUF or a Llama-family directory), or turn the prefix cache off")
    return PrefixCache(budget, grid=caps.state_align, need_state=caps.state_align > 1)


def resumable(cache: PrefixCache, requests: list[ScoreRequest], align: int) -> list[int]:
    """The requests to resume from the cache (see the module docstring), neighbours by token ids
    (so requests sharing a prompt land in one pack, which holds a cached prompt's rows once and
    computes an uncached one once, chained member to member; one run alone after its neighbour
    also finds the neighbour's inputs cached).

    Attention-only models: once any cacheable request of the call finds a cached prefix, all of
    them run as packs, those that found nothing from their first token (a pack shares their
    prompts as a batch's prefix trees do). Kept apart, a call mixing both (a server step of an RL
    group's samples, some of whose prompts an earlier step cached) ran as tree batches and then
    packs: two passes where one holds it. When none finds anything, none is resumed (the usual
    batches run them) and each is counted as a lookup that found nothing.

        >>> from .prefix_cache import unit_rows
        >>> from .request import ScoreRequest as R
        >>> c = PrefixCache(10 ** 6)
        >>> rs = [R([5, 6, 7, 8], 2), R([1, 2, 3, 4], 2), R([1, 2, 3, 9], 2)]
        >>> resumable(c, rs, align=1)      # nothing cached yet
        []
        >>> _ = c.insert([1, 2, 3], unit_rows)
        >>> resumable(c, rs, align=1)      # one hit: all three, by token ids
        [1, 2, 0]
    """
    candidates = [i for i, r in enumerate(requests) if cacheable(r)]
    if align == 1 and not any(cache.peek(planned_ids(requests[i]), requests[i].num_inputs - 1) for i in candidates):
        for i in candidates:
            cache.record(requests[i].num_inputs, 0)
        return []
    return sorted(candidates, key=lambda i: (planned_ids(requests[i]), i))


def _slots(kv: KVCache, hidden: torch.Tensor | None) -> list:
    """The tree's slots: keys and values of layer 0, then 1, ..., then the final hidden rows."""
    return [t for k, v in zip(kv.keys, kv.values) for t in (k, v)] + [hidden]


class ChunkKeeper:
    """One chunked request's part in the cache: ``begin`` (rows resumed from it), where chunks must
    end (``end``) and what is kept after each (``keep``)."""

    def __init__(self, cache: PrefixCache, r: ScoreRequest, align: int, kv: KVCache, resume: bool,
                 record: bool = True) -> None:
        self.cache, self.tokens, self.kv = cache, planned_ids(r), kv
        n = r.num_inputs
        self.begin = 0
        self.hidden: list[torch.Tensor] = []  # final hidden rows 0 .. (rows run so far), in pieces
        if resume:
            hit = cache.match(self.tokens, n - 1, record, rows=False)  # at least one row runs
            if hit.length:
                # the tree's rows as they are (pieces along the path): the first chunk's
                # ``KVCache.extend`` joins them with its own keys in one copy
                pieces = cache.pieces(self.tokens, hit.length)
                slots = [None if p is None else p[0] if len(p) == 1 else list(p) for p in pieces]
                kv.keys[:] = slots[0:-1:2]
                kv.values[:] = slots[1:-1:2]
                kv.states.update(hit.state or {})
                self.hidden.extend(pieces[-1])
                self.begin = hit.length
        if align > 1:
            self.points = sorted({p for p in (r.score_begin // align * align, n // align * align)
                                  if p > self.begin})
        else:
            self.points = [n] if n > self.begin else []
        self.with_state = align > 1

    def end(self, b: int, e: int) -> int:
        """The end of the chunk from row ``b``: ``e``, or a keep point before it."""
        return min([e] + [p for p in self.points if b < p < e])

    def hidden_rows(self, a: int, b: int) -> torch.Tensor:
        """The final hidden rows of inputs ``a .. b - 1`` (run or resumed so far)."""
        return torch.cat(self.hidden)[a:b]

    def keep(self, e: int, hidden: torch.Tensor | None) -> None:
        """Rows up to ``e`` are in the KV cache (and its states are those after row e - 1);
        ``hidden``: the final hidden rows of the chunk that ended at ``e``."""
        if hidden is not None:
            self.hidden.append(hidden)
        if e not in self.points:
            return
        joined = torch.cat(self.hidden)
        self.hidden = [joined]
        if joined.shape[0] != e:
            raise LogprobeError("prefix_cache", f"{joined.shape[0]} hidden rows kept for {e} inputs",
                                "report this: the prefix cache lost track of a chunk")
        slots = _slots(self.kv, joined)
        self.cache.insert(self.tokens[:e], _fetcher(slots, lambda a, b: [(a, b - a)]),
                          dict(self.kv.states) if self.with_state else None)


def chunk_keeper(cache: PrefixCache, r: ScoreRequest, align: int, kv: KVCache, resume: bool,
                 record: bool = True) -> ChunkKeeper:
    """``record``: count the lookup in the cache's stats (False: a pack that counted it failed)."""
    return ChunkKeeper(cache, r, align, kv, resume, record)


def batch_rows(unit: list[Tree], requests: list[ScoreRequest]) -> dict[int, tuple[int, int, int]]:
    """Where ``runner.pack`` lays each member's inputs: (prefix start, shared rows, branch start).

    >>> from .request import ScoreRequest as R
    >>> rs = [R([1, 2, 3, 4], 1), R([1, 2, 3, 5, 6], 1), R([7, 8], 1)]
    >>> batch_rows([Tree((0, 1), 3), Tree((2,))], rs)
    {0: (0, 3, 3), 1: (0, 3, 3), 2: (4, 0, 4)}
    """
    out, at = {}, 0
    for t in unit:
        start = at
        at += t.shared
        for m in t.members:
            out[m] = (start, t.shared, at)
            at += requests[m].num_inputs - t.shared
    return out


def keep_batch(cache: PrefixCache, unit: list[Tree], requests: list[ScoreRequest], record: KVCache,
               hidden: torch.Tensor | None) -> None:
    """Keep each cacheable member's inputs from a pass whose keys/values ``record`` holds and
    whose final hidden rows are ``hidden`` [T, H]."""
    if hidden is None:
        return
    slots = _slots(record, hidden)
    for m, (prefix, shared, branch) in batch_rows(unit, requests).items():
        if cacheable(requests[m]):
            spans = [(0, shared, prefix), (shared, requests[m].num_inputs, branch)]
            cache.insert(planned_ids(requests[m]), _fetcher(slots, lambda a, b, spans=spans: _runs(spans, a, b)))


Runs = Callable[[int, int], list[tuple[int, int]]]  # inputs [a, b) -> (first row, rows) runs, in order


def _runs(spans: list[tuple[int, int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """Inputs ``a .. b - 1`` of a sequence laid in (first input, end input, first row) spans, as
    runs of consecutive rows (first row, rows); runs that follow each other are merged.

    >>> _runs([(0, 3, 10), (3, 6, 13), (6, 9, 40)], 1, 8)
    [(11, 5), (40, 2)]
    """
    out: list[tuple[int, int]] = []
    for s, e, row in spans:
        lo, hi = max(a, s), min(b, e)
        if lo >= hi:
            continue
        first = row + lo - s
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + hi - lo)
        else:
            out.append((first, hi - lo))
    return out


def _fetcher(slots: list, runs: Runs) -> Callable[[int, int], list]:
    """``PrefixCache.insert``'s fetch for a sequence whose inputs ``a .. b - 1`` lie in the rows
    ``runs(a, b)`` of every slot (keys and values per layer, then the final hidden rows): one copy
    of those rows in one block for all slots (``block_copy``), the tree's own (slices, so no row
    index is built on the host or sent to the device)."""

    def fetch(a: int, b: int) -> list:
        rr = runs(a, b)
        if sum(n for _, n in rr) != b - a:
            raise LogprobeError("prefix_cache", f"inputs {a}..{b - 1} have no rows in the pass",
                                "report this: the prefix cache lost track of a pass's rows")
        return block_copy([None if t is None else [t[r0:r0 + n] for r0, n in rr] for t in slots])

    return fetch


def _shared_with(inputs: list[int], begin: int, before: list[int] | None) -> tuple[int, bool]:
    """Where a request joining a pack starts computing: past its cached ``begin`` tokens, or past
    what it shares with the inputs of the member before it (whose rows the pass computes anyway),
    leaving at least one row; and whether it reads that member's rows. Members come in token order
    (``resumable`` sorts them), so of the earlier members the one before shares the most."""
    c = min(common_prefix(inputs, before), len(inputs) - 1) if before is not None else 0
    return (c, True) if c > begin else (begin, False)


def take_pack(cache: PrefixCache, requests: list[ScoreRequest], queue: deque[int], budget: int,
              align: int) -> tuple[list[int], int | None]:
    """The next unit of the resumed requests in ``queue`` (taken from its front): request indices
    to run together in one pass (``ResumePack``), or one request to run alone (its rows over
    ``budget``, or a hybrid model: ``align`` > 1), as ``([], index)``.

    A pack holds at most ``budget`` rows and cached context keys together (each distinct cached
    prefix counted once; a request counts only the rows past what it shares with the cache or
    with an earlier member), and at least one request.

    >>> from .prefix_cache import unit_rows
    >>> from .request import ScoreRequest as R
    >>> c = PrefixCache(10 ** 6)
    >>> _ = c.insert([1, 2, 3, 4, 5, 6], unit_rows)
    >>> rs = [R([1, 2, 3, 4, 5, 6, 7, 8], 6), R([1, 2, 3, 4, 5, 6, 9, 9], 6), R([1, 2, 3, 9] + [5] * 20, 3)]
    >>> q = deque([0, 1, 2])
    >>> take_pack(c, rs, q, budget=12, align=1), q    # 6 keys + 1 row + 1 row; then 3 keys + 21 rows
    (([0, 1], None), deque([2]))
    >>> take_pack(c, rs, q, budget=12, align=1)      # 21 rows over 12: alone, in chunks
    ([], 2)
    """
    members: list[int] = []
    cost = 0
    seen: list[list[int]] = []  # the distinct cached prefixes taken so far
    while queue:
        r = requests[queue[0]]
        if r.images is not None:  # its rows take its own positions and embeddings: alone, in chunks
            if members:
                break
            return [], queue.popleft()
        h = cache.peek(r.inputs, r.num_inputs - 1)
        if not members and (align > 1 or r.num_inputs - h > budget):
            return [], queue.popleft()
        first, chained = _shared_with(r.inputs, h, requests[members[-1]].inputs if members else None)
        prefix = r.inputs[:h]
        laid = chained or any(len(p) >= h and p[:h] == prefix for p in seen)
        extra = r.num_inputs - first + (0 if laid else h)
        if members and cost + extra > budget:
            break
        members.append(queue.popleft())
        cost += extra
        if not laid and h:
            seen.append(prefix)
    return members, None


class ResumePack:
    """Requests resumed from their cached prefixes, run together in one forward pass (attention-only
    models). One ``KVCache`` (``kv``) holds each distinct cached prefix once, one after another
    (``past`` rows), and this pass's keys after them. Each request computes its inputs from
    ``first[m]`` on (rows ``past + start[m]`` ..) and reads those before it from ``spans[m]``:
    (first token, end token, key-source row of the first) pieces, in token order, which its
    segment sees as its context spans (``layers.attention``: a context span is any key-source rows,
    so several sequences share one key source). A piece is a cached prefix, or the rows of the
    member before it (members in token order) where they share leading tokens beyond what the
    cache holds (its rows of the same tokens, computed in this pass or read by it: a shared
    prefix, as in a batch's prefix trees).
    ``context_hidden`` [past, H]: the final hidden rows of the cached prefixes; the pass's hidden
    rows follow them in the rows that ``layout``'s scored rows and ``keep`` index ([past + T, H],
    ``with_context``). The cached rows are read where the tree holds them: ``kv`` starts as each
    layer's pieces, which the pass's first ``KVCache.extend`` joins with its own keys in one copy.

    Each request's bits are those of its own uncached run in deterministic mode: every op is
    row-wise batch-invariant, and attention sees exactly the keys of its own tokens, whichever
    pass or cache computed them (``engine.prefix_cache``).

    Worked example: prompt P (300 tokens) cached with sample A's 40 tokens; samples B = P + b (30)
    and C = P + c (50) resumed: ``begin`` (cached tokens) = {B: 300, C: 300}, ``past`` = 300; the
    pass runs 80 rows, segments (0, 30, ((0, 300),)) and (30, 80, ((0, 300),)); B's scores come
    from key-source row 299 (the prompt's last hidden row) then 300 .. 329. Had C been B + c, C
    would run from B's end: spans [(0, 300, 0), (300, 330, 300)], its own rows from 330.
    """

    def __init__(self, cache: PrefixCache, requests: list[ScoreRequest], members: list[int], num_layers: int) -> None:
        self.cache, self.requests, self.members = cache, requests, members
        # one lookup each, counted; rows read once per distinct prefix below
        self.begin = {m: cache.match(requests[m].inputs, requests[m].num_inputs - 1, rows=False).length
                      for m in members}
        self.first: dict[int, int] = {}
        source: dict[int, int] = {}  # member -> the earlier member whose rows it reads
        for k, m in enumerate(members):
            before = requests[members[k - 1]].inputs if k else None
            self.first[m], chained = _shared_with(requests[m].inputs, self.begin[m], before)
            if chained:
                source[m] = members[k - 1]
        at, pieces = self._lay_prefixes([m for m in members if m not in source])
        start, self.spans = 0, {}
        for m in members:
            if m in source:
                spans = [(a, min(b, self.first[m]), row) for a, b, row in self.spans[source[m]] if a < self.first[m]]
            else:
                spans = [(0, self.begin[m], at[m])] if self.begin[m] else []
            self.spans[m] = spans + [(self.first[m], requests[m].num_inputs, self.past + start)]
            start += requests[m].num_inputs - self.first[m]
        if pieces is None:
            self.kv, self._hidden_parts = KVCache.empty(num_layers), []
        else:
            # the tree's rows as they are, not copied: ``KVCache.extend`` reads them into a new key
            # source (one copy for the prefixes and the pass's rows), so nothing writes to them
            slots = [None if p is None else p[0] if len(p) == 1 else list(p) for p in pieces]
            self.kv = KVCache(slots[0:-1:2], slots[1:-1:2])
            self._hidden_parts = pieces[-1]

    @property
    def context_hidden(self) -> torch.Tensor | None:
        """The cached prefixes' final hidden rows [past, H] (None: no prefix)."""
        p = self._hidden_parts
        return None if not p else p[0] if len(p) == 1 else torch.cat(p)

    def with_context(self, hidden: torch.Tensor) -> torch.Tensor:
        """The pass's final hidden rows [T, H] -> the rows ``layout`` and ``keep`` index: the cached
        prefixes' then the pass's [past + T, H] (one copy)."""
        return torch.cat([*self._hidden_parts, hidden]) if self._hidden_parts else hidden

    def _lay_prefixes(self, members: list[int]) -> tuple[dict[int, int], list | None]:
        """Each member's cached prefix in the key source (its first row), longest first: a prefix
        that is a leading part of one laid out reads its rows; sets ``past``. Returns the rows per
        slot (pieces to join; None: no prefix)."""
        at: dict[int, int] = {}
        laid: list[tuple[list[int], int]] = []  # (prefix tokens, first key-source row)
        pieces: list | None = None
        self.past = 0
        for m in sorted(members, key=lambda m: -self.begin[m]):
            h, tokens = self.begin[m], self.requests[m].inputs
            where = next((a for p, a in laid if len(p) >= h and p[:h] == tokens[:h]), None) if h else 0
            if where is None:
                where = self.past
                laid.append((tokens[:h], where))
                got = self.cache.pieces(tokens, h)
                pieces = got if pieces is None else [None if a is None else a + b for a, b in zip(pieces, got)]
                self.past += h
            at[m] = where
        return at, pieces

    def rows(self, m: int, lo: int, hi: int) -> list[int]:
        """The key-source (and hidden) rows of member ``m``'s inputs ``lo .. hi - 1``: a range per
        span of ``spans[m]`` (pieces in token order), not a lookup per input."""
        out: list[int] = []
        for a, b, row in self.spans[m]:
            if max(a, lo) < min(b, hi):
                out.extend(range(row + max(a, lo) - a, row + min(b, hi) - a))
        if len(out) != max(0, hi - lo):
            raise LogprobeError("prefix_cache", f"inputs {lo}..{hi - 1} of request {m} are not all in its pack",
                                "report this: a resumed pack lost track of its rows")
        return out

    def layout(self) -> tuple[list[int], list[int], list[Segment], list[int], list[int], list[float],
                              list[tuple[int, int]]]:
        """The pass: input ids, positions, segments, and per scored token (request by request) its
        row in ``context_hidden`` + the pass's hidden rows ([past + T, H]), target and temperature;
        owners (request, scored tokens)."""
        ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        rows: list[int] = []
        targets: list[int] = []
        temps: list[float] = []
        owners: list[tuple[int, int]] = []
        for m in self.members:
            r, f = self.requests[m], self.first[m]
            start = len(ids)
            ids.extend(r.inputs[f:])
            positions.extend(range(f, r.num_inputs))
            segments.append(Segment(start, len(ids), tuple((row, row + b - a) for a, b, row in self.spans[m][:-1])))
            n = r.num_inputs + 1 - r.score_begin  # tokens score_begin ..: token j predicted by input j - 1
            rows.extend(self.rows(m, r.score_begin - 1, r.num_inputs))
            targets.extend(r.tokens[r.score_begin:r.num_inputs + 1])
            temps.extend([r.temperature] * n)
            owners.append((m, n))
        return ids, positions, segments, rows, targets, temps, owners

    def keep(self, hidden: torch.Tensor) -> None:
        """After the pass (``kv`` holds the prefixes' then the pass's keys/values, ``hidden`` the
        matching final hidden rows [past + T, H]): keep each request's inputs in the cache."""
        slots = _slots(self.kv, hidden)
        for m in self.members:
            self.cache.insert(self.requests[m].inputs, _fetcher(slots, lambda a, b, m=m: _runs(self.spans[m], a, b)))
