"""How the engine uses its prefix cache (``engine.prefix_cache``) over one run.

* A request that steers, captures or reads/forces routed experts is never cached (its rows differ
  from a plain pass's, or it needs every row): ``cacheable``.
* Attention-only models: a request with a cached prefix now runs alone, resumed from it
  (``resumable``); the others run in the usual batches of prefix trees, their keys/values recorded
  (``keep_batch``), so the next run finds them.
* Hybrid models (``ModelCaps.state_align`` > 1): every cacheable request runs alone, resumed from
  its longest prefix ending at a stored state, its chunks ending also at the grid points where the
  states are stored (``ChunkKeeper``): only there does the state exist and match the uncut run.

Kept prefixes: the whole inputs (attention-only); for hybrids, up to the last grid point before
the first scored token (what a request sharing the prompt can resume from) and the last grid point
of the inputs (what a longer conversation repeating this one can resume from).
"""

from __future__ import annotations

import torch

from ..errors import LogprobeError
from ..layers.attention import KVCache
from ..models.caps import ModelCaps
from .prefix_cache import PrefixCache, resolve_budget
from .request import ScoreRequest
from .scheduler import Tree


def cacheable(r: ScoreRequest) -> bool:
    return not (r.steer or r.capture or r.route or r.force_experts is not None)


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
    """The requests to run alone from the cache (see the module docstring), neighbours by token ids
    (so one that shares a prompt with the one before it finds it cached). The others are counted
    as lookups that found nothing."""
    out = []
    for i, r in enumerate(requests):
        if not cacheable(r):
            continue
        if align > 1 or cache.peek(r.inputs, r.num_inputs - 1):
            out.append(i)
        else:
            cache.record(r.num_inputs, 0)
    return sorted(out, key=lambda i: (requests[i].inputs, i))


def _slots(kv: KVCache, hidden: torch.Tensor | None) -> list:
    """The tree's slots: keys and values of layer 0, then 1, ..., then the final hidden rows."""
    return [t for k, v in zip(kv.keys, kv.values) for t in (k, v)] + [hidden]


class ChunkKeeper:
    """One chunked request's part in the cache: ``begin`` (rows resumed from it), where chunks must
    end (``end``) and what is kept after each (``keep``)."""

    def __init__(self, cache: PrefixCache, r: ScoreRequest, align: int, kv: KVCache, resume: bool) -> None:
        self.cache, self.tokens, self.kv = cache, r.inputs, kv
        n = r.num_inputs
        self.begin = 0
        self.hidden: list[torch.Tensor] = []  # final hidden rows 0 .. (rows run so far), in pieces
        if resume:
            hit = cache.match(self.tokens, n - 1)  # at least one row runs
            if hit.length:
                kv.keys[:] = hit.rows[0:-1:2]
                kv.values[:] = hit.rows[1:-1:2]
                kv.states.update(hit.state or {})
                self.hidden.append(hit.rows[-1])
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
        self.cache.insert(self.tokens[:e], lambda a, b: [None if t is None else t[a:b] for t in slots],
                          dict(self.kv.states) if self.with_state else None)


def chunk_keeper(cache: PrefixCache, r: ScoreRequest, align: int, kv: KVCache, resume: bool) -> ChunkKeeper:
    return ChunkKeeper(cache, r, align, kv, resume)


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
    device = next((t.device for t in slots if t is not None), None)
    if device is None:
        return
    for m, (prefix, shared, branch) in batch_rows(unit, requests).items():
        r = requests[m]
        if not cacheable(r):
            continue

        def fetch(a: int, b: int, prefix=prefix, shared=shared, branch=branch) -> list:
            rows = [prefix + j if j < shared else branch + j - shared for j in range(a, b)]
            idx = torch.tensor(rows, dtype=torch.long, device=device)
            return [None if t is None else t.index_select(0, idx) for t in slots]

        cache.insert(r.inputs, fetch)
