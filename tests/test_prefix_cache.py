"""The prefix cache across requests (``engine.prefix_cache``, ``engine.prefix_run``).

Gold tables pin the radix tree's insert / match / evict. Then the engine: over a randomised
sequence of calls (shared and partly shared prefixes, long chunked requests under a small budget,
evictions under a tiny byte budget, new weights in the middle), every result with the cache equals
the result without it: bitwise in deterministic mode, within 1e-5 otherwise; on tiny Llama-family
models, the default GGUF model and a tiny hybrid Qwen3.5; and a float64 reference checks the
uncached run itself."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import ref_logprobs
from test_determinism import same

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.engine.prefix_cache import PrefixCache, unit_rows
from logprobe.engine.request import ScoreRequest
from logprobe.errors import LogprobeError
from logprobe.loading import load_model

# -- the radix tree, pure ---------------------------------------------------------------------------

# (inserts, then the layout: (depth, tokens) depth first)
INSERT_GOLD = [
    ([[1, 2, 3]], [(0, (1, 2, 3))]),
    ([[1, 2, 3], [1, 2, 3]], [(0, (1, 2, 3))]),
    ([[1, 2, 3], [1, 2]], [(0, (1, 2)), (1, (3,))]),
    ([[1, 2, 3], [1, 2, 3, 4]], [(0, (1, 2, 3)), (1, (4,))]),
    ([[1, 2, 3, 4], [1, 2, 5], [1, 6], [7]], [(0, (1,)), (1, (2,)), (2, (3, 4)), (2, (5,)), (1, (6,)), (0, (7,))]),
    ([[5, 5, 5], [5, 5, 6], [5, 5, 5, 5]], [(0, (5, 5)), (1, (5,)), (2, (5,)), (1, (6,))]),
]


@pytest.mark.parametrize("inserts,layout", INSERT_GOLD)
def test_insert_gold(inserts, layout):
    t = PrefixCache(10 ** 6)
    for seq in inserts:
        t.insert(seq, unit_rows)
    assert t.layout() == layout
    # every node's rows are its tokens' positions in the sequence
    for seq in inserts:
        h = t.match(seq, limit=len(seq))
        assert h.length == len(seq) and h.rows[0].flatten().tolist() == list(range(len(seq)))


# (inserted, query, limit, grid, expected length)
MATCH_GOLD = [
    ([[1, 2, 3, 4]], [1, 2, 3, 4, 5], 10, 1, 4),
    ([[1, 2, 3, 4]], [1, 2, 9], 10, 1, 2),
    ([[1, 2, 3, 4]], [1, 2, 3, 4, 5], 3, 1, 3),  # the limit (score_begin - 1)
    ([[1, 2, 3, 4]], [9, 2], 10, 1, 0),
    ([[1, 2, 3, 4], [1, 2, 5]], [1, 2, 5, 6], 10, 1, 3),
    ([[1, 2, 3, 4, 5]], [1, 2, 3, 4, 5], 10, 2, 4),  # on the grid
    ([[1, 2, 3, 4, 5]], [1, 2, 3, 9], 10, 2, 2),
    ([[1, 2, 3, 4, 5]], [1, 9], 10, 2, 0),
]


@pytest.mark.parametrize("inserted,query,limit,grid,length", MATCH_GOLD)
def test_match_gold(inserted, query, limit, grid, length):
    t = PrefixCache(10 ** 6, grid=grid)
    for seq in inserted:
        t.insert(seq, unit_rows)
    h = t.match(query, limit)
    assert h.length == length == t.peek(query, limit)
    if length:
        assert h.rows[0].flatten().tolist() == list(range(length))


def test_match_with_states_gold():
    """Hybrid: a match ends at a node end holding a state (grid points only)."""
    t = PrefixCache(10 ** 6, grid=2, need_state=True)
    t.insert([1, 2, 3, 4, 5, 6], unit_rows, state={"s": torch.ones(3)})
    t.insert([1, 2, 3, 4], unit_rows, state={"s": torch.zeros(3)})  # splits: a state at 4 too
    t.insert([1, 2, 7, 7], unit_rows)  # no state: splits at 2, which has none
    assert t.layout() == [(0, (1, 2)), (1, (3, 4)), (2, (5, 6)), (1, (7, 7))]
    assert [t.peek(q, 99) for q in ([1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 4, 5, 0], [1, 2, 7, 7, 0], [1, 2, 3])] \
        == [6, 4, 0, 0]
    h = t.match([1, 2, 3, 4, 5, 6, 0], 5)  # limit 5: back to the state at 4
    assert h.length == 4 and h.state["s"].sum() == 0
    with pytest.raises(LogprobeError, match="grid"):
        t.insert([1, 2, 3], unit_rows, state={"s": torch.ones(1)})


# (budget in rows of 8 bytes, sequence of ("i", tokens) / ("m", tokens), final layout)
EVICT_GOLD = [
    (4, [("i", [1, 2, 3]), ("i", [4, 5])], [(0, (4, 5))]),  # 5 rows > 4: the older leaf goes
    (5, [("i", [1, 2, 3]), ("i", [4, 5])], [(0, (1, 2, 3)), (0, (4, 5))]),
    (5, [("i", [1, 2, 3]), ("i", [4, 5]), ("m", [1, 2]), ("i", [6])], [(0, (1, 2, 3)), (0, (6,))]),
    (2, [("i", [1, 2, 3])], []),  # larger than the budget: not kept
]


@pytest.mark.parametrize("budget,ops,layout", EVICT_GOLD)
def test_evict_gold(budget, ops, layout):
    t = PrefixCache(budget * 8)
    for op, seq in ops:
        if op == "i":
            t.insert(seq, unit_rows)
        else:
            t.match(seq, len(seq))
    assert t.layout() == layout
    assert t.stats.bytes == 8 * sum(len(tok) for _, tok in layout) <= budget * 8


def test_evict_leaf_before_parent():
    t = PrefixCache(4 * 8)
    t.insert([1, 2, 3], unit_rows)
    t.insert([1, 2, 4], unit_rows)  # (1, 2) -> (3,), (4,): 4 rows
    assert t.layout() == [(0, (1, 2)), (1, (3,)), (1, (4,))]
    t.insert([9], unit_rows)  # 5 rows: the oldest leaf (3,) goes, not its parent
    assert t.layout() == [(0, (1, 2)), (1, (4,)), (0, (9,))]
    t.insert([8, 8], unit_rows)  # 6 rows: (4,), then (1, 2) once a leaf, are the oldest
    assert t.layout() == [(0, (8, 8)), (0, (9,))]
    assert t.stats.evicted_tokens == 4 and t.stats.nodes == 2


class SnapshotEviction(PrefixCache):
    """The reference order: every leaf of the tree in a heap by (last use, id) at each eviction,
    a parent joining it once its last child goes."""

    def evict(self, target: int) -> int:
        import heapq

        freed = 0
        heap = [(nd.used, id(nd), nd) for nd in self._nodes() if not nd.children]
        heapq.heapify(heap)
        while heap and self.stats.bytes > target:
            _, _, nd = heapq.heappop(heap)
            del nd.parent.children[nd.tokens[0]]
            self.stats.bytes -= nd.nbytes
            self.stats.nodes -= 1
            self.stats.evicted_tokens += len(nd.tokens)
            freed += nd.nbytes
            if nd.parent is not self.root and not nd.parent.children:
                heapq.heappush(heap, (nd.parent.used, id(nd.parent), nd.parent))
        return freed


@pytest.mark.parametrize("seed", range(6))
def test_eviction_kept_across_calls_matches_the_snapshot_order(seed):
    """The eviction heap kept across calls evicts what a heap of every leaf built at each eviction
    evicts, over random inserts and lookups (shared prefixes, splits, a small budget), and looks
    at the tree's nodes only to drop outdated entries now and then (not at every eviction)."""
    rng = random.Random(seed)
    budget = rng.choice([6, 12, 30]) * 8
    fast, ref = PrefixCache(budget), SnapshotEviction(budget)
    walks = []
    real = fast._nodes
    fast._nodes = lambda: walks.append(1) or real()  # type: ignore[method-assign]
    prompts = [[rng.randrange(5) for _ in range(rng.randint(1, 4))] for _ in range(4)]
    for _ in range(300):
        seq = rng.choice(prompts) + [rng.randrange(6) for _ in range(rng.randint(0, 4))]
        if not seq:
            continue
        if rng.random() < 0.7:
            assert fast.insert(seq, unit_rows) == ref.insert(seq, unit_rows)
        else:
            assert fast.match(seq, len(seq)).length == ref.match(seq, len(seq)).length
        assert fast.layout() == ref.layout() and fast.stats == ref.stats
    assert fast.stats.evicted_tokens > 100 and len(walks) < 30


def test_eviction_heap_stays_bounded_by_the_tree():
    """Lookups without evictions add entries; outdated ones are dropped once they outnumber the
    tree's nodes, and the evictions after that still follow the reference order."""
    fast, ref = PrefixCache(10 ** 6), SnapshotEviction(10 ** 6)
    rng = random.Random(3)
    seqs = [[rng.randrange(4) for _ in range(rng.randint(1, 5))] for _ in range(12)]
    for q in seqs:
        fast.insert(q, unit_rows), ref.insert(q, unit_rows)
    for _ in range(400):
        q = rng.choice(seqs)
        fast.match(q, len(q)), ref.match(q, len(q))
        assert len(fast._heap) <= 4 * fast.stats.nodes + 65
    for budget in (20, 9, 3, 0):
        assert fast.evict(budget * 8) == ref.evict(budget * 8)
        assert fast.layout() == ref.layout() and fast.stats == ref.stats


def test_stats_and_clear():
    t = PrefixCache(10 ** 6)
    t.insert([1, 2, 3, 4], unit_rows)
    t.match([1, 2, 3, 4, 5], 4)
    t.match([7, 7], 1)
    s = t.stats.as_dict()
    assert (s["lookups"], s["hits"], s["lookup_tokens"], s["cached_tokens"]) == (2, 1, 7, 4)
    assert s["hit_rate"] == 4 / 7 and s["bytes"] == 32
    t.clear()
    assert t.layout() == [] and t.stats.bytes == 0 and t.match([1, 2], 2).length == 0


# -- the engine: with and without the cache -------------------------------------------------------


def calls(seed: int, vocab: int, long: int = 150, steps: int = 9, ctx_max: int = 140) -> list[list[ScoreRequest]]:
    """A sequence of engine calls: RL-style groups sent one per call or together, multiple choice
    contexts, partly shared prefixes, exact repeats, a request that is a prefix of an earlier one,
    long requests, score windows from 1."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, vocab) for _ in range(n)]  # noqa: E731
    ctxs = [tok(rng.randint(20, ctx_max)) for _ in range(3)]
    out: list[list[ScoreRequest]] = []
    for step in range(steps):
        batch = []
        for _ in range(rng.randint(1, 3)):
            ctx = rng.choice(ctxs)
            kind = rng.random()
            if kind < 0.5:  # a continuation of a shared context
                t = ctx + tok(rng.randint(1, 25))
                sb = len(ctx) if rng.random() < 0.8 else rng.randint(1, len(t) - 1)
            elif kind < 0.7:  # partly shared
                t = ctx[:rng.randint(5, len(ctx))] + tok(rng.randint(2, 20))
                sb = rng.randint(1, len(t) - 1)
            elif kind < 0.85:  # long
                t = ctx + tok(long)
                sb = rng.randint(len(ctx), len(t) - 1)
            else:  # unrelated
                t = tok(rng.randint(2, 60))
                sb = rng.randint(1, len(t) - 1)
            batch.append(ScoreRequest(t, sb, temperature=rng.choice([1.0, 0.7]), top_k=rng.choice([0, 2]),
                                      entropy=rng.random() < 0.3))
        if step == min(4, steps - 1) and out:  # exact repeats and a prefix of an earlier request
            r = out[0][0]
            batch += [ScoreRequest(list(r.tokens), r.score_begin),
                      ScoreRequest(r.tokens[:max(2, len(r.tokens) - 3)], max(1, min(r.score_begin, len(r.tokens) - 4)))]
        out.append(batch)
    return out


def compare_runs(loaded, deterministic: bool, budget: int, cache_bytes: int, seed: int, vocab: int,
                 weights: dict | None = None, long: int = 150, expect_hits: bool = True, steps: int = 9,
                 ctx_max: int = 140) -> dict:
    """Run ``calls(seed)`` through a scorer without and one with the prefix cache (new weights
    after the 5th call when given); every result equal. Returns the cached scorer's stats."""
    cfg = EngineConfig(max_batch_tokens=budget, deterministic=deterministic)
    plain = Scorer(loaded, config=cfg)
    cached = Scorer(loaded, config=cfg, prefix_cache=cache_bytes)
    for step, batch in enumerate(calls(seed, vocab, long, steps, ctx_max)):
        if step == 5 and weights is not None:
            assert cached.prefix_cache.stats.bytes > 0
            cached.update_weights(weights)  # the same model object: the plain scorer sees them too
            assert cached.prefix_cache.stats.bytes == 0
        want = plain.engine.run(batch)
        got = cached.engine.run(batch)
        for w, g in zip(want, got):
            same(w, g, deterministic)
            assert w.cached_tokens == 0
    stats = cached.prefix_cache_stats()
    if expect_hits:
        assert stats["hits"] > 0 and stats["cached_tokens"] > 0
    return stats


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return {k: load_model(str(tiny_dirs[k][0]), "cpu", "float32") for k in ("llama", "mistral")}


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_tiny_models_equal_with_and_without(kind, deterministic, tiny):
    compare_runs(tiny[kind], deterministic, budget=100, cache_bytes=1 << 26, seed=len(kind), vocab=300)


def test_tiny_budget_evicts_and_stays_equal(tiny):
    stats = compare_runs(tiny["llama"], True, budget=64, cache_bytes=40_000, seed=3, vocab=300,
                         expect_hits=False)
    assert stats["evicted_tokens"] > 0 and stats["bytes"] <= 40_000


def test_weight_update_in_the_middle(tiny_dirs):
    """New weights clear the cache: what follows equals the uncached run on the new weights."""
    loaded = load_model(str(tiny_dirs["llama"][0]), "cpu", "float32")  # its own copy: the weights change
    g = torch.Generator().manual_seed(1)
    new = {k: (t * (1 + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype))).float()
           for k, t in tiny_dirs["llama"][1].state_dict().items()}
    stats = compare_runs(loaded, True, budget=100, cache_bytes=1 << 26, seed=5, vocab=300, weights=new)
    assert stats["lookups"] > 0


def test_cached_tokens_and_float64(tiny, tiny_dirs):
    """A hit reports its cached tokens; the cached run agrees with the float64 reference."""
    s = Scorer(tiny["llama"], deterministic=True, prefix_cache=True)
    ref = tiny_dirs["llama"][1]
    ctx = list(range(10, 90))
    a = s.engine.run([ScoreRequest(ctx + [5, 6, 7], len(ctx))])[0]
    b = s.engine.run([ScoreRequest(ctx + [8, 9], len(ctx))])[0]
    c = s.engine.run([ScoreRequest(ctx + [8, 9], 3)])[0]  # scored from 3: cached rows through the head
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, len(ctx), len(ctx))  # at least one row runs
    for t, sb, res in ((ctx + [8, 9], len(ctx), b), (ctx + [5, 6, 7], len(ctx), a), (ctx + [8, 9], 3, c)):
        lp = ref_logprobs(ref, t)[sb - 1:-1]
        want = lp.gather(1, torch.tensor(t[sb:])[:, None])[:, 0]
        assert len(res.logprobs) == len(want)
        assert (res.logprobs.double() - want).abs().max() < 1e-4


def test_uncacheable_requests_and_refusals(tiny):
    """Steered or captured requests never use it; a bad setting is refused, naming the key."""
    with pytest.raises(LogprobeError, match="prefix_cache"):
        Scorer(tiny["llama"], prefix_cache=-3)
    s = Scorer(tiny["llama"], prefix_cache=1 << 20)
    assert s.prefix_cache_stats()["max_bytes"] == 1 << 20
    assert Scorer(tiny["llama"]).prefix_cache_stats() is None


@pytest.mark.slow  # slow tier (pytest -m slow): deterministic mode on the real model's 49k vocabulary takes minutes on CPU
def test_default_model(default_scorer):
    """The real default GGUF model: deterministic bits and default mode within 1e-5."""
    compare_runs(default_scorer.loaded, True, budget=64, cache_bytes=1 << 28, seed=11, vocab=49152, long=70,
                 steps=5, ctx_max=70)


@pytest.mark.slow  # slow tier (pytest -m slow): 11 s of the real model
def test_default_model_default_mode(default_scorer):
    compare_runs(default_scorer.loaded, False, budget=64, cache_bytes=4_000_000, seed=12, vocab=49152, long=70,
                 steps=5, ctx_max=70, expect_hits=False)


# -- several resumed requests in one pass (engine.prefix_run.ResumePack) ----------------------------


def test_take_pack_and_layout_gold():
    """Three prefixes: A's 6 tokens, B's leading 4 of them (read from A's rows), C's own 3; the
    pass's segments, context spans and scored rows ([past + T] = the prefixes' rows, then the pass's)."""
    from collections import deque

    from logprobe.engine.prefix_run import ResumePack, take_pack

    t = PrefixCache(10 ** 6)
    t.insert([1, 2, 3, 4, 5, 6, 7], unit_rows)
    t.insert([8, 9, 10, 11], unit_rows)
    rs = [ScoreRequest([1, 2, 3, 4, 5, 6, 20, 21], 7),  # resumes at 6 (the limit: 7 inputs - 1)
          ScoreRequest([1, 2, 3, 4, 30, 31], 2),  # at 4, scored from 2: two tokens from cached rows
          ScoreRequest([8, 9, 10, 40, 41], 3)]  # at 3
    q = deque([0, 1, 2])
    assert take_pack(t, rs, q, budget=100, align=1) == ([0, 1, 2], None) and not q
    assert take_pack(t, rs, deque([0, 1, 2]), budget=9, align=1)[0] == [0, 1]  # 6 keys + 1 + 1 row; C: 3 + 1 more
    assert take_pack(t, rs, deque([0]), budget=100, align=64) == ([], 0)  # hybrids: alone
    rp = ResumePack(t, rs, [0, 1, 2], num_layers=0)
    assert rp.begin == rp.first == {0: 6, 1: 4, 2: 3} and rp.past == 9
    assert rp.spans == {0: [(0, 6, 0), (6, 7, 9)], 1: [(0, 4, 0), (4, 5, 10)], 2: [(0, 3, 6), (3, 4, 11)]}
    assert rp.context_hidden.flatten().tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    ids, pos, segs, rows, targets, _, owners = rp.layout()
    assert ids == [20, 30, 40] and pos == [6, 4, 3]
    assert [(g.start, g.end, g.context) for g in segs] == [(0, 1, ((0, 6),)), (1, 2, ((0, 4),)), (2, 3, ((6, 9),))]
    # A: token 7 from pass row 0 (9 + 0); B: tokens 2, 3 from cached rows 1, 2, token 4 from row 3,
    # token 5 from its pass row (9 + 1); C: token 3 from cached row 6 + 2, token 4 from pass row 9 + 2
    assert rows == [9, 1, 2, 3, 10, 8, 11] and targets == [21, 3, 4, 30, 31, 40, 41]
    assert owners == [(0, 1), (1, 4), (2, 2)]
    assert t.stats.lookups == 3 and t.stats.cached_tokens == 13


def test_pack_shares_rows_between_members():
    """Members sharing leading tokens beyond the cache read each other's rows: a conversation's
    turns (each the one before plus more) and two siblings; what each computes and where each
    input's row lies."""
    from logprobe.engine.prefix_run import ResumePack, take_pack

    t = PrefixCache(10 ** 6)
    t.insert([1, 2, 3, 4], unit_rows)
    turn2, turn3 = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]
    rs = [ScoreRequest(turn2 + [0], 4), ScoreRequest(turn3 + [0], 7), ScoreRequest(turn3 + [10, 11, 0], 9),
          ScoreRequest([1, 2, 3, 4, 5, 20, 0], 6)]
    from collections import deque

    # rows after the cache's 4 tokens: 3, then 2, 2 and 1 past what earlier members share; 4 keys
    assert take_pack(t, rs, deque([0, 1, 2, 3]), budget=12, align=1) == ([0, 1, 2, 3], None)
    assert take_pack(t, rs, deque([0, 1, 2, 3]), budget=11, align=1) == ([0, 1, 2], None)
    rp = ResumePack(t, rs, [0, 1, 2, 3], num_layers=0)
    assert rp.begin == {0: 4, 1: 4, 2: 4, 3: 4} and rp.first == {0: 4, 1: 7, 2: 9, 3: 5} and rp.past == 4
    assert rp.spans[2] == [(0, 4, 0), (4, 7, 4), (7, 9, 7), (9, 11, 9)]
    assert rp.spans[3] == [(0, 4, 0), (4, 5, 4), (5, 6, 11)]
    ids, pos, segs, rows, targets, _, _ = rp.layout()
    assert ids == [5, 6, 7, 8, 9, 10, 11, 20] and pos == [4, 5, 6, 7, 8, 9, 10, 5]
    assert [g.context for g in segs] == [((0, 4),), ((0, 4), (4, 7)), ((0, 4), (4, 7), (7, 9)), ((0, 4), (4, 5))]
    assert rows == [3, 4, 5, 6, 6, 7, 8, 8, 9, 10, 11]


def passes(scorer: Scorer) -> list[int]:
    """Rows of every forward pass the scorer's engine runs from now on."""
    box: list[int] = []
    scorer.engine.fault_hook = lambda rows, _tokens: box.append(rows)
    return box


def resumed_calls(seed: int, vocab: int = 300) -> tuple[list[ScoreRequest], list[ScoreRequest]]:
    """A first call caching three contexts (one a leading part of another), then one call whose
    requests resume from prefixes of different lengths (shared, nested, partly shared, scored
    from inside the cached part, an exact repeat)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, vocab) for _ in range(n)]  # noqa: E731
    c1, c2, c3 = tok(70), tok(25), tok(40)
    first = [ScoreRequest(c1 + tok(9), 70), ScoreRequest(c2 + tok(4), 3), ScoreRequest(c1[:30] + c3, 30)]
    second = [ScoreRequest(c1 + tok(12), 70, top_k=2),  # at 70 (or more: a token shared by chance)
              ScoreRequest(c1 + tok(5), 70, entropy=True, temperature=0.7),
              ScoreRequest(c1[:50] + tok(8), 20),  # at 50, tokens 20..50 from cached rows
              ScoreRequest(c2 + tok(6), 25),  # at 25
              ScoreRequest(c1[:30] + c3[:10] + tok(7), 35),  # at 40, in the third request's branch
              ScoreRequest(list(first[1].tokens), 3)]  # an exact repeat: all but the last input
    return first, second


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_packed_resume_one_pass_equal(kind, deterministic, tiny):
    """Resumed requests of different prefix lengths run in one pass, each equal to its uncached
    result (bitwise in deterministic mode); each reports its own cached tokens; a second round
    resumes from what the pack kept."""
    first, second = resumed_calls(seed=len(kind) + deterministic)
    cfg = EngineConfig(max_batch_tokens=1024, deterministic=deterministic)
    plain = Scorer(tiny[kind], config=cfg)
    cached = Scorer(tiny[kind], config=cfg, prefix_cache=1 << 26)
    cached.engine.run(first)
    rows = passes(cached)
    want = plain.engine.run(second)
    got = cached.engine.run(second)
    news = [r.num_inputs - g.cached_tokens for r, g in zip(second, got)]
    assert rows == [sum(news)]  # one pass, only the rows after each prefix
    assert [g.cached_tokens for g in got][2:] == [50, 25, 40, first[1].num_inputs - 1]
    assert min(g.cached_tokens for g in got[:2]) >= 70
    for w, g in zip(want, got):
        same(w, g, deterministic)
    rows.clear()
    again = cached.engine.run(second)  # now each resumes from its own kept inputs: one row each
    assert rows == [len(second)] and [g.cached_tokens for g in again] == [r.num_inputs - 1 for r in second]
    for w, g in zip(want, again):
        same(w, g, deterministic)


ROW_BYTES = 2 * (2 * 2 * 16) * 4 + 64 * 4  # tiny llama, a cached row: 2 layers x (k, v) x 2 kv heads x 16 dims, hidden 64; fp32


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_packed_resume_shares_rows_in_the_pass(kind, deterministic, tiny):
    """A conversation's turns and siblings resumed together: each input after the cached prefix is
    computed once in the pass (rows = the distinct uncached prefixes of the inputs), each request
    reads its shared rows from the member that computes them; equal to the uncached results
    (bitwise in deterministic mode), scored from inside the shared rows too."""
    rng = random.Random(11 + deterministic)
    tok = lambda n: [rng.randrange(2, 300) for _ in range(n)]  # noqa: E731
    ctx = tok(60)
    turn2 = ctx + tok(20)
    turn3 = turn2 + tok(15)
    turn4 = turn3 + tok(10)
    batch = [ScoreRequest(turn4 + [7], 62, top_k=2), ScoreRequest(turn2 + [7], 60), ScoreRequest(turn3 + [7], 81),
             ScoreRequest(turn2[:70] + tok(8), 65, entropy=True), ScoreRequest(ctx[:30] + tok(12), 20)]
    cfg = EngineConfig(max_batch_tokens=1024, deterministic=deterministic)
    plain = Scorer(tiny[kind], config=cfg)
    cached = Scorer(tiny[kind], config=cfg, prefix_cache=1 << 26)
    cached.engine.run([ScoreRequest(ctx + [3, 3], 60)])
    held = {tuple((ctx + [3])[:i]) for i in range(1, 62)}
    fresh = {tuple(r.inputs[:i]) for r in batch for i in range(1, r.num_inputs + 1)} - held
    rows = passes(cached)
    got = cached.engine.run(batch)
    assert rows == [len(fresh)]  # 35 + 8 + 12 + 0 + ... : each uncached prefix once
    assert [g.cached_tokens for g in got] == [60, 60, 60, 60, 30]
    for w, g in zip(plain.engine.run(batch), got):
        same(w, g, deterministic)


def pack_calls(seed: int, vocab: int = 300, steps: int = 6) -> list[list[ScoreRequest]]:
    """Calls of 4 to 8 requests drawn from a few contexts: RL-style samples, a conversation's
    turns, siblings, partly shared prefixes, repeats; most of them resume after the first call."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, vocab) for _ in range(n)]  # noqa: E731
    roots = [tok(rng.randint(10, 60)) for _ in range(3)]
    pool: list[list[int]] = []
    out = []
    for _ in range(steps):
        batch = []
        for _ in range(rng.randint(4, 8)):
            kind = rng.random()
            if pool and kind < 0.35:  # a later turn, or a sibling, of an earlier request
                base = rng.choice(pool)
                t = base[:rng.randint(2, len(base))] + tok(rng.randint(1, 30))
            elif pool and kind < 0.45:  # an exact repeat
                t = list(rng.choice(pool))
            else:
                t = rng.choice(roots) + tok(rng.randint(1, 40))
            sb = rng.randint(1, len(t) - 1)
            pool.append(t)
            batch.append(ScoreRequest(t, sb, temperature=rng.choice([1.0, 0.8]), top_k=rng.choice([0, 3]),
                                      entropy=rng.random() < 0.3))
        out.append(batch)
    return out


@pytest.mark.parametrize("budget, cache_rows", [(1024, 4000), (48, 4000), (200, 90)])
def test_packed_resume_random_calls_bitwise(budget, cache_rows, tiny):
    """Random calls of several requests each, most resumed: packs of many members (shared and
    chained rows, scores from inside cached rows), a budget that splits packs and chunks long
    requests, a byte budget that evicts inside packs. Bitwise equal to the uncached runs."""
    cfg = EngineConfig(max_batch_tokens=budget, deterministic=True)
    plain = Scorer(tiny["llama"], config=cfg)
    cached = Scorer(tiny["llama"], config=cfg, prefix_cache=cache_rows * ROW_BYTES)
    for batch in pack_calls(seed=budget + cache_rows):
        for w, g in zip(plain.engine.run(batch), cached.engine.run(batch)):
            same(w, g, True)
    stats = cached.prefix_cache_stats()
    assert stats["hits"] > (10 if cache_rows > 100 else 2) and stats["bytes"] <= cache_rows * ROW_BYTES
    if cache_rows < 100:
        assert stats["evicted_tokens"] > 0


def test_packed_resume_evicts_a_members_prefix(tiny):
    """Keeping the first request of a pack evicts the prefix the second one resumed from (a byte
    budget of 64 rows): the second's inputs are kept again from the pack's own KV cache, and a
    third call resuming from them is still bitwise equal."""
    rng = random.Random(9)
    tok = lambda n: [rng.randrange(2, 300) for _ in range(n)]  # noqa: E731
    ca, cb = [2] + tok(29), [3] + tok(24)  # ca sorts first: its request is kept first
    first = [ScoreRequest(ca + tok(4), 30), ScoreRequest(cb + tok(4), 25)]
    second = [ScoreRequest(ca + tok(11), 30), ScoreRequest(cb + tok(11), 25)]
    cfg = EngineConfig(max_batch_tokens=256, deterministic=True)
    plain = Scorer(tiny["llama"], config=cfg)
    cached = Scorer(tiny["llama"], config=cfg, prefix_cache=64 * ROW_BYTES)
    cache = cached.prefix_cache
    for batch in (first, second):
        rows = passes(cached)
        for w, g in zip(plain.engine.run(batch), cached.engine.run(batch)):
            same(w, g, True)
    assert rows == [20] and cache.stats.evicted_tokens > 0  # 10 + 10 rows after the prefixes
    b = second[1].inputs
    assert cache.peek(b, len(b)) == len(b) and cache.peek(first[1].inputs, 99) == 25  # kept whole again
    rows = passes(cached)
    got = cached.engine.run([second[1]])[0]
    assert rows == [1] and got.cached_tokens == len(b) - 1
    same(plain.engine.run([second[1]])[0], got, True)


def test_packed_resume_out_of_memory(tiny):
    """A pack that runs out of memory: each of its requests runs again alone (in chunks under the
    lowered budget), bitwise the same, each lookup counted once."""
    first, second = resumed_calls(seed=4)
    cfg = EngineConfig(max_batch_tokens=1024, deterministic=True)
    plain = Scorer(tiny["llama"], config=cfg)
    cached = Scorer(tiny["llama"], config=cfg, prefix_cache=1 << 26)
    cached.engine.run(first)
    lookups = cached.prefix_cache.stats.lookups
    seen: list[int] = []

    def hook(rows: int, _tokens: int) -> None:
        seen.append(rows)
        if len(seen) == 1:
            raise torch.OutOfMemoryError("no room for the pack")

    cached.engine.fault_hook = hook
    got = cached.engine.run(second)
    assert len(seen) > len(second) and seen[0] == sum(seen[1:]) and cached.engine.oom_count == 1
    assert cached.prefix_cache.stats.lookups == lookups + len(second)
    for w, g in zip(plain.engine.run(second), got):
        same(w, g, True)
        assert g.cached_tokens > 0


def test_packed_resume_under_budget_and_evictions(tiny):
    """A small row budget: the resumed requests split over several packs, one over the budget runs
    alone in chunks; a byte budget so small that keeping a pack's requests evicts other prefixes.
    Bitwise equal throughout, over several rounds."""
    first, second = resumed_calls(seed=7)
    rng = random.Random(8)
    long = ScoreRequest(first[0].tokens[:70] + [rng.randrange(2, 300) for _ in range(90)], 75)
    cfg = EngineConfig(max_batch_tokens=64, deterministic=True)
    plain = Scorer(tiny["llama"], config=cfg)
    cached = Scorer(tiny["llama"], config=cfg, prefix_cache=150 * ROW_BYTES)
    for step in range(3):
        batch = first if step == 0 else second + [long]
        rows = passes(cached)
        want, got = plain.engine.run(batch), cached.engine.run(batch)
        for w, g in zip(want, got):
            same(w, g, True)
        if step == 1:
            assert len(rows) > 2 and max(rows) <= 64
    stats = cached.prefix_cache_stats()
    assert stats["evicted_tokens"] > 0 and stats["bytes"] <= 150 * ROW_BYTES and stats["hits"] > 0


# -- the hybrid family: states on the 64-token grid ----------------------------------------------


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from helpers import byte_tokenizer
    from test_hybrid_engine import tiny_qwen35

    pytest.importorskip("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    path = tmp_path_factory.mktemp("pc-hybrid") / "qwen35"
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(tiny_qwen35()).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    byte_tokenizer()[0].save_pretrained(str(path))
    loaded = load_model(str(path), "cpu", "float32")
    if loaded.info.backend != "native":
        pytest.skip("the native hybrid model is not loaded for qwen3_5_text")
    return loaded


@pytest.mark.parametrize("deterministic", [True, False])
def test_hybrid_equal_with_and_without(hybrid, deterministic):
    stats = compare_runs(hybrid, deterministic, budget=100, cache_bytes=1 << 26, seed=21, vocab=300)
    assert stats["cached_tokens"] % 64 == 0


def test_hybrid_resumes_on_the_grid(hybrid):
    s = Scorer(hybrid, deterministic=True, prefix_cache=True)
    ctx = [random.Random(0).randrange(2, 300) for _ in range(150)]
    a = s.engine.run([ScoreRequest(ctx + [5, 6], 150)])[0]
    b = s.engine.run([ScoreRequest(ctx + [7, 8, 9], 150)])[0]
    c = s.engine.run([ScoreRequest(ctx[:100] + [7, 8, 9], 100)])[0]  # inside A's node: no state there
    d = s.engine.run([ScoreRequest(ctx[:100] + [1], 100)])[0]  # C left a state at 64
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens, d.cached_tokens) == (0, 128, 0, 64)


# -- the server: replies carry cached_tokens, /metrics the cache's counters ------------------------


def test_server_reports_cached_tokens(tiny_dirs):
    """The real stack (uvicorn + the app): OpenAI ``usage.prompt_tokens_details.cached_tokens`` and
    SGLang ``meta_info.cached_tokens``; the numbers equal the library's without a cache, bitwise;
    ``/metrics`` shows the hit rate and bytes; ``/flush_cache`` empties it."""
    import requests
    from server_util import serve

    from logprobe.server import create_app

    path = str(tiny_dirs["llama"][0])
    lib = Scorer(path, device="cpu", dtype="float32", deterministic=True, progress=False)
    app = create_app(Scorer(path, device="cpu", dtype="float32", deterministic=True, progress=False,
                            prefix_cache=1 << 24))
    ctx = list(range(20, 100))
    with serve(app) as url:
        def completion(ids):
            r = requests.post(url + "/v1/completions", json={"prompt": [ids], "max_tokens": 0, "echo": True,
                                                             "logprobs": 0}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        first = completion(ctx + [5, 6])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = completion(ctx + [5, 6])  # all but the last input resumed; echo's rows from the kept hidden states
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ctx)
        assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]

        def generate(ids, start):
            r = requests.post(url + "/generate", json={"input_ids": ids, "return_logprob": True,
                                                       "logprob_start_len": start}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["meta_info"]

        meta = generate(ctx + [7, 8, 9], len(ctx) - 1)  # scored from token len(ctx), resumed after ctx
        assert meta["cached_tokens"] == len(ctx)
        want = lib.engine.run([ScoreRequest(ctx + [7, 8, 9], len(ctx))])[0].logprobs.tolist()
        assert [e[0] for e in meta["input_token_logprobs"][1:]] == want
        metrics = requests.get(url + "/metrics", timeout=30).text
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("logprobe_prefix_cache_")}
        assert values["logprobe_prefix_cache_hits"] == 2 and values["logprobe_prefix_cache_bytes"] > 0
        assert 0 < values["logprobe_prefix_cache_hit_rate"] < 1
        assert requests.post(url + "/flush_cache", timeout=30).json()["success"]
        assert generate(ctx + [7, 8, 9], len(ctx) - 1)["cached_tokens"] == 0


# -- what a resumed request copies -------------------------------------------------------------------


class Written(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the non-view tensors the ops produce (copies, concatenations, gathers)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and not func.is_view:
            self.bytes += out.numel() * out.element_size()
        return out


def fake_slots(n: int, layers: int = 2) -> list[torch.Tensor]:
    """A pass's slots for n rows: keys, values per layer [n, 2, 4], then hidden rows [n, 8] (row i holds i)."""
    kv = [torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, 2, 4).contiguous() for _ in range(2 * layers)]
    return kv + [torch.arange(n, dtype=torch.float32)[:, None].expand(n, 8).contiguous()]


def test_tree_keeps_fetched_rows_and_reads_one_node_uncopied():
    """``insert`` keeps the fresh tensors ``fetch`` made (no second copy); a match within one node
    reads its rows as they are (a view, no concatenation); across two nodes it joins them."""
    t = PrefixCache(10 ** 6)
    made = []

    def fetch(a, b):
        made.append(unit_rows(a, b))
        return made[-1]

    t.insert([1, 2, 3, 4], fetch)
    stored = t.root.children[1].rows[0]
    assert stored is made[0][0]
    hit = t.match([1, 2, 3, 9], limit=10)
    assert hit.rows[0].data_ptr() == stored.data_ptr() and hit.rows[0].flatten().tolist() == [0, 1, 2]
    t.insert([1, 2, 5], unit_rows)  # splits (1, 2) off: two nodes on the path of [1, 2, 3]
    joined = t.match([1, 2, 3, 9], limit=10).rows[0]
    assert joined.flatten().tolist() == [0, 1, 2]


def test_block_copy_joins_slots_into_one_aligned_block():
    """Every slot of a node in one allocation: pieces joined row-wise, a slot without rows None,
    each slot starting at a multiple of ALIGN bytes, the values and dtypes those of the pieces."""
    from logprobe.engine.prefix_cache import ALIGN, block_copy
    a = torch.arange(15, dtype=torch.float32).view(5, 3)  # 12 bytes a row
    b = torch.arange(6, dtype=torch.int64).view(3, 2)
    c = torch.arange(4, dtype=torch.bfloat16).view(4, 1)
    x, none, y, z = block_copy([[a[:1], a[3:]], None, [b], [c[1:2], c[:1]]])
    assert x.tolist() == [[0, 1, 2], [9, 10, 11], [12, 13, 14]] and none is None
    assert y.tolist() == [[0, 1], [2, 3], [4, 5]] and z.flatten().tolist() == [1.0, 0.0]
    assert (x.dtype, y.dtype, z.dtype) == (torch.float32, torch.int64, torch.bfloat16)
    base = x.untyped_storage().data_ptr()
    assert y.untyped_storage().data_ptr() == z.untyped_storage().data_ptr() == base
    offsets = [t.data_ptr() - base for t in (x, y, z)]
    assert offsets == [0, 48, 96] and all(o % ALIGN == 0 for o in offsets)  # 36 -> 48, 48 + 48 = 96
    assert x.untyped_storage().nbytes() == 96 + 4  # no padding after the last slot
    assert block_copy([None, None]) == [None, None]


def test_engine_nodes_hold_one_block_each(tiny):
    """After real calls (inserts and splits), each node's rows share one storage and the tree's
    byte count is the sum of those storages: one allocation per node, counted whole."""
    s = Scorer(tiny["llama"], deterministic=True, prefix_cache=True)
    ctx = list(range(10, 60))
    for tail in ([5, 6, 7], [8, 9], [8, 11, 12]):
        s.engine.run([ScoreRequest(ctx + tail, len(ctx))])
    cache = s.engine.prefix_cache
    nodes = list(cache._nodes())
    assert len(nodes) >= 3  # the context split off the first request's node
    held = 0
    for nd in nodes:
        storages = {r.untyped_storage().data_ptr() for r in nd.rows if r is not None}
        assert len(storages) == 1, len(storages)
        held += next(r for r in nd.rows if r is not None).untyped_storage().nbytes()
    assert cache.stats.bytes == held


@pytest.mark.parametrize("overlap", [True, False])
def test_packs_are_read_one_pass_late(tiny, overlap):
    """Packs overlap like batches of trees: a pass's results are read after the next pass is
    launched (the GPU runs one while the host plans the next), so a call
    of three packs goes pass, pass, read, pass, read, read; with ``overlap_host`` off each pass is
    read at once.
    The numbers are those of the same requests run without the cache."""
    cfg = EngineConfig(max_batch_tokens=64, progress=False, overlap_host=overlap, deterministic=True)
    s = Scorer(tiny["llama"], config=cfg, prefix_cache=True)
    p1, p2 = list(range(10, 50)), list(range(60, 100))
    s.engine.run([ScoreRequest(p1 + [5, 6], len(p1)), ScoreRequest(p2 + [7, 8], len(p2))])
    reqs = [ScoreRequest(p1 + [1, 2, 3, 4], len(p1)), ScoreRequest(list(range(150, 180)), 5),
            ScoreRequest(p2 + [9, 9, 9], len(p2))]
    events = []
    s.engine.fault_hook = lambda rows, tokens: events.append(f"pass {rows}")
    got = s.engine.run(reqs, on_result=lambda i, r: events.append(f"read {i}"))
    # a call with a hit runs its cacheable requests as packs, in token order: request 0 (3 rows
    # past its 40 cached tokens), 2 (2 rows), then 1 (29 rows, nothing cached); one pack each
    # under the 64-token budget (a prefix's keys count in a pack's cost)
    if overlap:
        assert events == ["pass 3", "pass 2", "read 0", "pass 29", "read 2", "read 1"]
    else:
        assert events == ["pass 3", "read 0", "pass 2", "read 2", "pass 29", "read 1"]
    assert [r.cached_tokens for r in got] == [40, 0, 40]
    plain = Scorer(tiny["llama"], config=cfg).engine.run(reqs)
    for a, b in zip(got, plain):
        same(a, b, exact=True)


def resume_one(t: PrefixCache, r: ScoreRequest, layers: int = 2):
    """``r`` run alone as the engine runs a resumed request, the pass faked (row i holds i):
    (its ResumePack, the bytes ``keep`` wrote)."""
    from logprobe.engine.prefix_run import ResumePack

    rp = ResumePack(t, [r], [0], num_layers=layers)
    rows = rp.past + len(rp.layout()[0])  # the key source after the pass
    fresh = fake_slots(rows, layers)
    for layer in range(layers):
        rp.kv.extend(layer, fresh[2 * layer][rp.past:], fresh[2 * layer + 1][rp.past:])
    with Written() as w:
        rp.keep(fresh[-1])
    return rp, w.bytes


def test_resumed_request_copies_only_its_new_rows():
    """A request resumed from a one-node cached prefix: its pack's KV cache reads the tree's
    tensors (no copy), and keeping it writes exactly its new rows once per slot (a slice copied,
    no row index built, no second copy). Splitting a node (the first sibling) copies the node."""
    from logprobe.engine.prefix_run import keep_batch
    from logprobe.engine.scheduler import Tree
    from logprobe.layers.attention import KVCache

    t = PrefixCache(10 ** 9)
    first = ScoreRequest(list(range(1, 11)), 5)  # 9 inputs
    slots = fake_slots(first.num_inputs)
    per_row = sum(s[0].numel() * s.element_size() for s in slots)
    with Written() as w:
        keep_batch(t, [Tree((0,), 0)], [first], KVCache(slots[0:-1:2], slots[1:-1:2]), slots[-1])
    assert w.bytes == 9 * per_row  # one copy of the request's rows
    _, written = resume_one(t, ScoreRequest(list(range(1, 8)) + [60, 61, 62], 7))  # 7 cached, 2 new inputs
    assert written == (9 + 2) * per_row  # the node split at 7 (both halves copied), then the 2 new rows
    node = t.root.children[1]
    assert node.tokens == tuple(range(1, 8))
    third = ScoreRequest(list(range(1, 8)) + [50, 51, 52, 53], 7)  # 7 cached, 3 new inputs
    rp, written = resume_one(t, third)
    assert rp.past == 7 and rp.begin == {0: 7}
    assert written == 3 * per_row  # its 3 new rows, once
    # the pass read the node's tensors as they are: the key source's first 7 rows were those
    kept = t.match(third.inputs + [0], limit=100).rows
    assert kept[0][:, 0, 0].tolist() == list(range(10)) and kept[-1][:, 0].tolist() == list(range(10))


def test_resumed_pack_reads_the_tree_uncopied():
    from logprobe.engine.prefix_run import ResumePack

    t = PrefixCache(10 ** 9)
    t.insert(list(range(1, 10)), lambda a, b: fake_slots(b)[:])
    node = t.root.children[1]
    rp = ResumePack(t, [ScoreRequest(list(range(1, 8)) + [50, 51], 7)], [0], num_layers=2)
    assert rp.kv.keys[0].data_ptr() == node.rows[0].data_ptr() and rp.kv.keys[0].shape[0] == 7
    assert rp.kv.values[1].data_ptr() == node.rows[3].data_ptr()
    assert rp.context_hidden.data_ptr() == node.rows[-1].data_ptr()


def test_pack_of_two_prefixes_joins_them_once():
    """Two requests resumed from two cached prompts in one pack: building the pack copies nothing;
    each layer's first ``extend`` writes the key source (both prefixes and the pass's rows) once;
    ``with_context`` writes the hidden rows once; the rows are the right ones."""
    from logprobe.engine.prefix_run import ResumePack

    t = PrefixCache(10 ** 9)
    t.insert([1, 2, 3, 4, 5], lambda a, b: fake_slots(b))  # rows 0..4
    t.insert([7, 8, 9], lambda a, b: [x + 100 for x in fake_slots(b)])  # rows 100..102
    rs = [ScoreRequest([1, 2, 3, 4, 5, 6, 6], 5), ScoreRequest([7, 8, 9, 6, 6], 3)]
    with Written() as w:
        rp = ResumePack(t, rs, [0, 1], num_layers=2)
    assert w.bytes == 0 and rp.past == 8
    new = len(rp.layout()[0])  # 1 + 1 rows
    rows, hid = torch.full((new, 2, 4), -1.0), torch.full((new, 8), -1.0)
    with Written() as w:
        k, _ = rp.kv.extend(0, rows, rows)
    assert w.bytes == 2 * (rp.past + new) * 2 * 4 * 4  # keys and values, each written once
    assert k[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 100, 101, 102, -1, -1]
    with Written() as w:
        hidden = rp.with_context(hid)
    assert w.bytes == (rp.past + new) * 8 * 4 and hidden[:, 0].tolist() == k[:, 0, 0].tolist()


def test_chunked_request_resumes_from_the_trees_pieces():
    """A request resumed alone (chunks; hybrids, or over the budget) starts its KV cache as the
    tree's rows along its path, uncopied (two nodes: two pieces), which its first chunk's
    ``extend`` joins with its own keys in one copy; its kept hidden rows likewise."""
    from logprobe.engine.prefix_run import chunk_keeper
    from logprobe.layers.attention import KVCache

    t = PrefixCache(10 ** 9)
    t.insert([1, 2, 3, 4, 5], lambda a, b: fake_slots(b))
    t.insert([1, 2, 3, 9], lambda a, b: [x[a:b].clone() for x in fake_slots(b)])  # splits after 3
    head, tail = t.root.children[1], t.root.children[1].children[4]
    kv = KVCache.empty(2)
    keeper = chunk_keeper(t, ScoreRequest([1, 2, 3, 4, 5, 6, 7], 6), 1, kv, resume=True)
    assert keeper.begin == 5 and isinstance(kv.keys[0], list)
    assert [p.data_ptr() for p in kv.keys[0]] == [head.rows[0].data_ptr(), tail.rows[0].data_ptr()]
    assert [p.data_ptr() for p in keeper.hidden] == [head.rows[-1].data_ptr(), tail.rows[-1].data_ptr()]
    new = torch.full((1, 2, 4), -1.0)
    with Written() as w:
        k, _ = kv.extend(0, new, new)
    assert w.bytes == 2 * 6 * 2 * 4 * 4 and k[:, 0, 0].tolist() == [0, 1, 2, 3, 4, -1]
