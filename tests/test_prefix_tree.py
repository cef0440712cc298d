"""Shared-prefix trees: the planning and packing functions (gold tables), the attention metadata,
and tree-packed scores against each request alone and against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from helpers import ref_logprobs

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.engine.runner import pack
from logprobe.engine.scheduler import Chunk, Tree, plan_work, share_prefixes
from logprobe.layers.attention import AttentionMeta, Segment
from logprobe.loading import load_model

CPU = torch.device("cpu")


@pytest.mark.parametrize("inputs, min_shared, gold", [
    # two continuations of one context + an unrelated request
    ([[1, 2, 3, 4], [9, 9], [1, 2, 3, 5, 6]], 2, [Tree((0, 2), 3), Tree((1,), 0)]),
    # below min_shared: no sharing
    ([[1, 2, 3, 4], [1, 2, 5]], 3, [Tree((0,), 0), Tree((1,), 0)]),
    # identical requests and one that is a prefix of the others (its branch is empty)
    ([[7, 7, 7, 1], [7, 7, 7], [7, 7, 7, 1]], 2, [Tree((0, 1, 2), 3)]),
    # a third member with a shorter common prefix would lose more than it saves: own group
    ([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 8]], 2, [Tree((0, 1), 5), Tree((2,), 0)]),
    # ... but joins when the group is large enough that sharing 2 tokens with it pays
    ([[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 7], [1, 2, 6]], 2, [Tree((0, 1, 2, 3), 2)]),
    # two groups, listed by first member
    ([[5, 5, 1], [3, 3, 1], [5, 5, 2], [3, 3, 2]], 2, [Tree((0, 2), 2), Tree((1, 3), 2)]),
    ([], 2, []),
])
def test_share_prefixes_gold(inputs, min_shared, gold):
    assert share_prefixes(inputs, min_shared) == gold


@pytest.mark.parametrize("inputs, budget, share, chunk, gold", [
    # a tree fits: one batch (cost 2 + 1 + 1 = 4 rows instead of 6)
    ([[1, 2, 3], [1, 2, 4]], 4, True, True, [[Tree((0, 1), 2)]]),
    # without sharing the same requests need 6 rows: two batches
    ([[1, 2, 3], [1, 2, 4]], 4, False, True, [[Tree((0,))], [Tree((1,))]]),
    # a tree over the budget splits into sub-trees that each repeat the prefix
    ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6, 6]], 6, True, True,
     [[Tree((0, 1), 3)], [Tree((2,))]]),
    # a long request is chunked, one chunk per batch, after the ordinary batches
    ([[5] * 10, [1, 2]], 4, True, True,
     [[Tree((1,))], [Chunk(0, 0, 4)], [Chunk(0, 4, 8)], [Chunk(0, 8, 10)]]),
    # a model without KV-cache support: the long request runs whole, alone
    ([[5] * 10, [1, 2]], 4, False, False, [[Tree((0,))], [Tree((1,))]]),
    # a tree member longer than the budget leaves the tree and is chunked
    ([[1, 2, 3], [1, 2, 3, 4, 5, 6, 7]], 4, True, True,
     [[Tree((0,))], [Chunk(1, 0, 4)], [Chunk(1, 4, 7)]]),
])
def test_plan_work_gold(inputs, budget, share, chunk, gold):
    assert plan_work(inputs, budget, share=share, min_shared=2, chunk=chunk) == gold


def test_pack_tree_gold():
    """Which row predicts which token in a tree (the drawing in docs/contract.md).

    prefix rows 0..2 = [10 11 12]; A's branch row 3 = [13]; B's rows 4, 5 = [20 21]; C's branch
    is empty (its inputs are the prefix). Row 2 scores A's 13, B's 20 and C's 13: the row that
    predicts each branch's first token is the prefix's last row, with each branch's own target.
    """
    reqs = [ScoreRequest([10, 11, 12, 13, 14], 3), ScoreRequest([10, 11, 12, 20, 21, 22], 3, temperature=0.5),
            ScoreRequest([10, 11, 12, 13], 1)]
    plan = plan_work([r.tokens[:-1] for r in reqs], 100, min_shared=2)
    assert plan == [[Tree((0, 1, 2), 3)]]
    b = pack(plan[0], reqs, CPU)
    assert b.input_ids.tolist() == [10, 11, 12, 13, 20, 21]
    assert b.positions.tolist() == [0, 1, 2, 3, 3, 4]  # positions continue from the prefix
    assert b.meta.segments == [Segment(0, 3), Segment(3, 4, ((0, 3),)), Segment(4, 6, ((0, 3),))]
    assert b.score_rows.tolist() == [2, 3, 2, 4, 5, 0, 1, 2]
    assert b.targets.tolist() == [13, 14, 20, 21, 22, 11, 12, 13]
    assert b.temperature.tolist() == [1, 1, 0.5, 0.5, 0.5, 1, 1, 1]
    assert b.owners == [(0, 2), (1, 3), (2, 3)]
    # the same mask as a varlen kernel would take it: gathered keys per segment, causal bottom-right
    assert b.meta.varlen() == ([0, 3, 4, 6], [0, 3, 7, 12], [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 4, 5])


def test_pack_chunk_gold():
    """The middle chunk (inputs 2..3) of a request: keys 0..1 come from the cache."""
    reqs = [ScoreRequest([10, 11, 12, 13, 14, 15], 1)]
    b = pack([Chunk(0, 2, 4)], reqs, CPU)
    assert b.input_ids.tolist() == [12, 13] and b.positions.tolist() == [2, 3]
    assert b.meta.segments == [Segment(0, 2, ((0, 2),))] and b.meta.past == 2
    assert b.score_rows.tolist() == [0, 1] and b.targets.tolist() == [13, 14]  # input 2 predicts token 3
    assert b.meta.varlen() == ([0, 2], [0, 4], [0, 1, 2, 3])
    assert AttentionMeta.packed([3, 2]).segments == [Segment(0, 3), Segment(3, 5)]


# -- on models --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return {k: load_model(str(tiny_dirs[k][0]), "cpu", "float32") for k in ("llama", "mistral", "qwen3")}


def mc_requests(seed: int, context: int = 40, n: int = 4) -> list[ScoreRequest]:
    """Multiple choice: one context, n continuations; the first continuation token is scored
    by the context's last row (score_begin == context length == the shared prefix)."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(2, 300, (context,), generator=g).tolist()
    reqs = []
    for i in range(n):
        cont = torch.randint(2, 300, (3 + 5 * i,), generator=g).tolist()
        reqs.append(ScoreRequest(ctx + cont, context))
    reqs.append(ScoreRequest(ctx + reqs[0].tokens[context:context + 1], 5))  # a branch with no own rows
    return reqs


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_tree_matches_alone_and_reference(kind, deterministic, loaded, tiny_dirs):
    reqs = mc_requests(1)
    tree = Scorer(loaded[kind], config=EngineConfig(deterministic=deterministic))
    flat = Scorer(loaded[kind], config=EngineConfig(deterministic=deterministic, share_prefixes=False))
    plan = plan_work([r.tokens[:-1] for r in reqs], 8192)
    assert plan == [[Tree((0, 1, 2, 3, 4), 40)]]  # the prefix runs once
    shared = tree.engine.run(reqs)
    alone = [flat.engine.run([r])[0] for r in reqs]
    ref = tiny_dirs[kind][1]
    for r, a, s in zip(reqs, alone, shared):
        lp = ref_logprobs(ref, r.tokens)[r.score_begin - 1:-1]
        want = lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0]
        assert (s.logprobs.double() - want).abs().max() < 1e-4
        if deterministic:
            assert torch.equal(s.logprobs.view(torch.int32), a.logprobs.view(torch.int32))
        else:
            assert (s.logprobs - a.logprobs).abs().max() < 1e-5


def test_transformers_backend_does_not_share(tiny_dirs):
    """gpt2 runs through transformers: no trees, same numbers, and a tree batch is refused."""
    from logprobe.errors import LogprobeError

    lm = load_model(str(tiny_dirs["gpt2"][0]), "cpu", "float32")
    scorer = Scorer(lm, progress=False)
    reqs = mc_requests(2)
    out = scorer.engine.run(reqs)
    ref = tiny_dirs["gpt2"][1]
    for r, s in zip(reqs, out):
        lp = ref_logprobs(ref, r.tokens)[r.score_begin - 1:-1]
        want = lp.gather(1, torch.tensor(r.tokens[r.score_begin:])[:, None])[:, 0]
        assert (s.logprobs.double() - want).abs().max() < 1e-4
    b = pack([Tree((0, 1), 40)], reqs, CPU)
    with pytest.raises(LogprobeError, match="cannot run shared-prefix"):
        lm.model(b.input_ids, b.positions, b.meta)
    det = Scorer(lm, deterministic=True).engine.run(reqs)  # each request alone in its own forward
    for s, d in zip(out, det):
        assert (s.logprobs - d.logprobs).abs().max() < 1e-5
