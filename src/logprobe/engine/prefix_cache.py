"""A prefix cache across requests: a radix tree of token prefixes holding what the model computed
for them (the keys/values of the attention layers, the final hidden rows and, for the hybrid
families, the recurrent and convolution state at a node's end), within a byte budget, least
recently used leaves evicted first.

A request whose leading tokens are in the tree resumes from there: its remaining inputs run over a
``KVCache`` filled from the tree, exactly as the later chunks of a long request see the earlier
ones; several such requests share one pass, one cache holding each one's prefix rows
(``engine.prefix_run.ResumePack``; the hybrid families: one by one); tokens scored by cached rows
(an echoed prompt, a window starting inside the prefix) go through the head from the kept final
hidden rows. So a hit computes only the tokens after it.

Where a request may resume (``match``):

* never past ``limit``: the engine passes ``num_inputs - 1``, so at least one row runs;
* only at a multiple of ``grid`` tokens from the sequence start, ``ModelCaps.state_align``: 1 for
  attention-only models (any point), 64 for the hybrid families, whose chunked linear attention
  reproduces the uncut run's bits only at multiples of its 64-token chunk; a node stores a state only
  at such a point (``insert`` refuses others), and a hybrid match ends at a node end holding one.

Why deterministic mode keeps its bits, with the cache or without, whatever was cached before:
every op of that mode is batch-invariant (row-wise matmul tiles, attention in query tiles aligned
to key 0 of the sequence whatever the keys' origin, the head in fixed token and vocabulary chunks),
so the keys/values and hidden rows a request computed for its prefix are bitwise those any other
pass computes for the same tokens, and a resumed request is a chunked run cut at the hit, a cut the
engine already makes bit-exactly (``engine.scheduler.chunk_bounds``; on the 64-token grid for
hybrids, where the kept state is the uncut run's). Worked example, a hybrid model (grid 64),
nothing cached, then three requests:

    A = P + a (P: 150 shared tokens, a: 10), scored from 150: A runs [0, 128) + [128, 159), its
        chunks cut at 128 = 150 // 64 * 64; the tree gets A[:128] (keys/values and hidden rows of
        inputs 0..127, the state after input 127)
    B = P + b, scored from 150: match -> 128 (the deepest node end with a state); B runs
        [128, len B - 1) over the cache: its rows meet the same keys and the same state as in
        B's uncached run, which is the chunked run [0, 128) + [128, ...): the same bits
    C = P[:100] + c: match -> 0 (the node holding P[:100] ends at 128, past the common part): a
        full run, which leaves a state at 64; nothing depends on what A or B left

An attention-only model (grid 1) resumes B at 150 (all of P) and C at 100.

The tree, with unit rows (``Rows``), pinned by gold tables in ``tests/test_prefix_cache.py``:

    >>> t = PrefixCache(max_bytes=10 ** 6)
    >>> t.insert([1, 2, 3, 4], unit_rows), t.insert([1, 2, 5], unit_rows)
    (4, 1)
    >>> t.layout()
    [(0, (1, 2)), (1, (3, 4)), (1, (5,))]
    >>> h = t.match([1, 2, 3, 9], limit=10)
    >>> h.length, h.rows[0].flatten().tolist()
    (3, [0, 1, 2])
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass

import torch

from ..errors import LogprobeError

# rows of a token range [a, b) of the sequence being inserted: one tensor [b - a, ...] per slot
# (per layer keys, values; None for a layer that keeps no keys), made for the tree: storage of its
# own, never written again by anyone; the tree keeps it as it is (no second copy)
Fetch = Callable[[int, int], list]


ALIGN = 16  # each slot of a node's block starts at a multiple (the alignment kernels specialise on)


def block_copy(pieces: list[list[torch.Tensor] | None]) -> list[torch.Tensor | None]:
    """Each slot's pieces joined row-wise into **one** allocation for all slots (views of a byte
    block, each slot at a multiple of ``ALIGN``), None where a slot has none.

    A node of llama-8b holds 65 slots (keys and values of 32 layers, the hidden rows): as a tensor
    each they were 65 allocations, and rows the cache keeps are blocks PyTorch's caching allocator
    does not get back soon, so most were fresh ``cudaMalloc`` calls (~290 a 16-request call, ~45 ms
    of it on an H100); one block per node is one.

    >>> a, b = torch.arange(6.).view(3, 2), torch.arange(4, dtype=torch.int64).view(2, 2)
    >>> x, none, y = block_copy([[a[:1], a[2:]], None, [b]])
    >>> x.tolist(), none, y.tolist(), x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    ([[0.0, 1.0], [4.0, 5.0]], None, [[0, 1], [2, 3]], True)
    """
    placed, total, first = [], 0, None
    for ps in pieces:
        if ps is None:
            placed.append(None)
            continue
        first = ps[0]
        shape = (sum(p.shape[0] for p in ps), *first.shape[1:])
        at = -(-total // ALIGN) * ALIGN
        placed.append((at, shape, first.dtype))
        total = at + math.prod(shape) * first.element_size()
    if first is None:
        return [None] * len(pieces)
    block = torch.empty(total, dtype=torch.uint8, device=first.device)
    out, dsts, srcs = [], [], []
    for ps, where in zip(pieces, placed):
        if where is None:
            out.append(None)
            continue
        at, shape, dtype = where
        slot = block[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        out.append(slot)
        row = 0
        for p in ps:
            dsts.append(slot[row:row + p.shape[0]])
            srcs.append(p)
            row += p.shape[0]
    torch._foreach_copy_(dsts, srcs)  # one launch per few slots, not one per piece
    return out


def unit_rows(a: int, b: int) -> list[torch.Tensor]:
    """Rows whose value is the token index (for examples and tests): one slot of [b - a, 1] int64."""
    return [torch.arange(a, b).view(-1, 1)]


@dataclass(slots=True)
class Hit:
    """``length`` leading tokens found (0: a miss); ``rows``: each slot's rows [length, ...] over
    the path, joined; ``state``: what the node at ``length`` carries (hybrid families), else None."""

    length: int
    rows: list = field(default_factory=list)
    state: object = None


@dataclass(slots=True)
class CacheStats:
    lookups: int = 0  # requests looked up
    hits: int = 0  # of them, resumed from a cached prefix
    lookup_tokens: int = 0  # input tokens of the requests looked up
    cached_tokens: int = 0  # of them, read from the cache instead of computed
    inserted_tokens: int = 0
    evicted_tokens: int = 0
    bytes: int = 0  # held now
    max_bytes: int = 0
    nodes: int = 0

    @property
    def hit_rate(self) -> float:
        """Input tokens served from the cache / input tokens looked up (0 before any lookup)."""
        return self.cached_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["hit_rate"] = self.hit_rate
        return out


class _Node:
    __slots__ = ("tokens", "rows", "state", "children", "parent", "used", "nbytes")

    def __init__(self, tokens: tuple, rows: list, state, parent: _Node | None) -> None:
        self.tokens, self.rows, self.state, self.parent = tokens, rows, state, parent
        self.children: dict[int, _Node] = {}
        self.used = 0
        self.nbytes = _held(rows) + _nbytes(state)


class PrefixCache:
    """The radix tree (see the module docstring). ``grid``: resume and state points are multiples
    of it; ``need_state``: a match must end at a node holding a state (the hybrid families)."""

    def __init__(self, max_bytes: int, grid: int = 1, need_state: bool = False) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise LogprobeError("prefix_cache", f"must be a number of bytes >= 0, got {max_bytes!r}",
                                "e.g. prefix_cache=2**30, True for the default, False for none")
        self.max_bytes, self.grid, self.need_state = max_bytes, max(1, grid), need_state
        self.root = _Node((), [], None, None)
        self.stats = CacheStats(max_bytes=max_bytes)
        self._tick = 0
        # eviction candidates, kept across calls (not rebuilt from every node per eviction):
        # (used, id, node) pushed whenever a node is marked used or becomes a leaf; an entry is
        # current while its node is in the tree, a leaf, and still marked ``used`` then
        self._heap: list[tuple[int, int, _Node]] = []

    # -- lookups ----------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], limit: int, record: bool = True, rows: bool = True) -> Hit:
        """The longest usable cached prefix of ``tokens``, at most ``limit`` tokens, on the grid
        (see the module docstring). ``record``: count it in ``stats`` and mark its nodes used;
        ``rows``: join its rows (False: ``Hit.rows`` is empty, ``pieces`` reads them later)."""
        path, length, state = self._find(tokens, limit)
        if record:
            self._tick += 1
            for nd, _ in path:
                self._mark(nd)
            self.record(len(tokens), length)
        if not length:
            return Hit(0)
        return Hit(length, _join(path, length) if rows else [], state)

    def pieces(self, tokens: Sequence[int], length: int) -> list[list]:
        """Each slot's rows of ``tokens[:length]`` as the tree holds them: a list of views per slot
        (None for a slot without rows), in token order, to be joined once with other prefixes'
        pieces (``engine.prefix_run.ResumePack``). The tokens must be cached that far.

        >>> t = PrefixCache(max_bytes=10 ** 6)
        >>> t.insert([1, 2, 3], unit_rows), t.insert([1, 2, 4], unit_rows)
        (3, 1)
        >>> [p.flatten().tolist() for p in t.pieces([1, 2, 4, 7], 3)[0]]
        [[0, 1], [2]]
        """
        path, _, _ = self._find(tokens, length)
        found = sum(n for _, n in path)
        if found < length:
            raise LogprobeError("prefix_cache", f"{length} tokens asked, {found} cached",
                                "report this: rows were read from the prefix cache past what it holds")
        return _pieces(path, length)

    def peek(self, tokens: Sequence[int], limit: int) -> int:
        """``match(tokens, limit).length``, without counting it, marking nodes or joining rows."""
        return self._find(tokens, limit)[1]

    def _find(self, tokens: Sequence[int], limit: int) -> tuple[list[tuple[_Node, int]], int, object]:
        limit = min(limit, len(tokens))
        path: list[tuple[_Node, int]] = []  # (node, tokens of it matched)
        node, at = self.root, 0
        while at < limit and (child := node.children.get(tokens[at])) is not None:
            n = _common(child.tokens, tokens, at, limit)
            path.append((child, n))
            at += n
            if n < len(child.tokens):
                break
            node = child
        length, state = at - at % self.grid, None
        if self.need_state:
            ends, length = 0, 0
            for nd, n in path:
                ends += n
                if n == len(nd.tokens) and nd.state is not None:
                    length, state = ends, nd.state
        return path, length, state

    def record(self, tokens: int, cached: int) -> None:
        """Count one lookup of ``tokens`` input tokens, ``cached`` of them served."""
        s = self.stats
        s.lookups += 1
        s.hits += cached > 0
        s.lookup_tokens += tokens
        s.cached_tokens += cached

    # -- insertion and eviction -------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], fetch: Fetch, state: object = None) -> int:
        """Add ``tokens`` (the part not cached yet: ``fetch(a, b)`` gives its rows), with ``state``
        at its end (only at a multiple of the grid), then evict down to the budget. Returns the
        tokens added."""
        n = len(tokens)
        if state is not None and n % self.grid:
            raise LogprobeError("prefix_cache", f"a state at {n} tokens is off the {self.grid}-token grid",
                                "insert states only at multiples of ModelCaps.state_align")
        self._tick += 1
        node, at, added = self.root, 0, 0
        while at < n:
            child = node.children.get(tokens[at])
            if child is None:
                rows = fetch(at, n)  # fresh tensors: kept as they are
                child = _Node(tuple(tokens[at:]), rows, None, node)
                node.children[tokens[at]] = child
                added, at = n - at, n
                self.stats.nodes += 1
                self.stats.bytes += child.nbytes
            else:
                common = _common(child.tokens, tokens, at, n)
                if common < len(child.tokens):
                    child = self._split(child, common)
                at += common
            self._mark(child)
            node = child
        if state is not None and node is not self.root and node.state is None:
            node.state = state
            grown = _nbytes(state)
            node.nbytes += grown
            self.stats.bytes += grown
        self.stats.inserted_tokens += added
        self.evict(self.max_bytes)
        return added

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after its first ``k`` tokens: a new parent holds them, ``node`` the rest
        (and keeps its state, which is at its end)."""
        head = _Node(node.tokens[:k], block_copy([None if r is None else [r[:k]] for r in node.rows]), None,
                     node.parent)
        head.used = node.used
        node.parent.children[node.tokens[0]] = head
        before = node.nbytes
        node.tokens, node.rows = node.tokens[k:], block_copy([None if r is None else [r[k:]] for r in node.rows])
        node.nbytes = _held(node.rows) + _nbytes(node.state)
        node.parent = head
        head.children[node.tokens[0]] = node
        self.stats.nodes += 1
        self.stats.bytes += head.nbytes + node.nbytes - before
        return head

    def _mark(self, nd: _Node) -> None:
        nd.used = self._tick
        heapq.heappush(self._heap, (nd.used, id(nd), nd))
        if len(self._heap) > 4 * self.stats.nodes + 64:  # mostly outdated entries: keep the leaves'
            self._heap = [(n.used, id(n), n) for n in self._nodes() if not n.children]
            heapq.heapify(self._heap)

    def evict(self, target: int) -> int:
        """Drop least recently used leaves until at most ``target`` bytes are held; returns bytes
        freed. Work per call: the entries popped, not every node of the tree."""
        freed = 0
        heap = self._heap
        while heap and self.stats.bytes > target:
            used, _, nd = heapq.heappop(heap)
            if nd.parent is None or nd.children or nd.used != used:
                continue  # evicted already, not a leaf now, or marked used since
            parent = nd.parent
            del parent.children[nd.tokens[0]]
            nd.parent, nd.rows, nd.state = None, [], None  # its tensors freed whatever entries remain
            self.stats.bytes -= nd.nbytes
            self.stats.nodes -= 1
            self.stats.evicted_tokens += len(nd.tokens)
            freed += nd.nbytes
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.used, id(parent), parent))
        return freed

    def clear(self) -> None:
        """Forget everything (new weights): every byte freed, the counters kept."""
        self.root = _Node((), [], None, None)
        self._heap = []
        self.stats.bytes = 0
        self.stats.nodes = 0

    # -- inspection -------------------------------------------------------------------------------

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            nd = stack.pop()
            yield nd
            stack.extend(nd.children.values())

    def layout(self) -> list[tuple[int, tuple]]:
        """(depth, tokens) of every node, depth first, children by first token (for tests)."""
        out: list[tuple[int, tuple]] = []

        def walk(nd: _Node, depth: int) -> None:
            for key in sorted(nd.children):
                child = nd.children[key]
                out.append((depth, child.tokens))
                walk(child, depth + 1)

        walk(self.root, 0)
        return out


def _common(node_tokens: tuple, tokens: Sequence[int], at: int, end: int) -> int:
    """How many of ``node_tokens`` equal ``tokens[at:end]`` from the start."""
    n = 0
    for x, y in zip(node_tokens, tokens[at:end]):
        if x != y:
            break
        n += 1
    return n


def _pieces(path: list[tuple[_Node, int]], length: int) -> list[list]:
    """Each slot's rows of the first ``length`` tokens along ``path``: a list of views per slot
    (None for a slot the nodes hold no rows of)."""
    pieces: list[list] = []
    left = length
    for nd, n in path:
        take = min(n, left)
        if take <= 0:
            break
        pieces.append([None if r is None else r[:take] for r in nd.rows])
        left -= take
    return [None if pieces[0][s] is None else [p[s] for p in pieces] for s in range(len(pieces[0]))]


def _join(path: list[tuple[_Node, int]], length: int) -> list:
    """Each slot's rows of the first ``length`` tokens along ``path``, concatenated (one node: its
    rows as they are, a view; readers never write to them)."""
    return [None if p is None else p[0] if len(p) == 1 else torch.cat(p) for p in _pieces(path, length)]


def _held(rows: list) -> int:
    """Bytes of the storages under a node's rows, each counted once (``block_copy``: one for all)."""
    seen: dict[int, int] = {}
    for r in rows:
        if r is not None:
            st = r.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _nbytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (tensors, lists, tuples, dicts, dataclasses)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    if is_dataclass(obj):
        return sum(_nbytes(getattr(obj, f.name)) for f in fields(obj))
    return 0


def default_bytes(device: torch.device) -> int:
    """The default budget: a quarter of the free memory on CUDA (after the weights are loaded),
    512 MiB on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free) // 4
    return 512 * 2 ** 20


def resolve_budget(setting: bool | int | None, device: torch.device) -> int | None:
    """``Scorer(prefix_cache=...)`` as bytes: None/False/0 -> None (off), True -> ``default_bytes``,
    an int -> that many bytes.

    >>> resolve_budget(True, torch.device("cpu")), resolve_budget(1000, torch.device("cpu")), resolve_budget(False, torch.device("cpu"))
    (536870912, 1000, None)
    """
    if setting is None or setting is False or setting == 0:
        return None
    if setting is True:
        return default_bytes(device)
    if isinstance(setting, int) and setting > 0:
        return setting
    raise LogprobeError("prefix_cache", f"must be True, False or a number of bytes, got {setting!r}",
                        "e.g. prefix_cache=True (default budget) or prefix_cache=2**30")
