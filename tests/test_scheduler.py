from __future__ import annotations

import pytest
import torch

from logprobe.engine.request import ScoreRequest
from logprobe.engine.runner import pack
from logprobe.engine.scheduler import Chunk, Tree, aligned_trees, chunk_bounds, plan_batches, plan_work


@pytest.mark.parametrize("lengths, budget, gold", [
    ([3, 9, 4, 2, 5], 10, [[1], [4, 2], [0, 3]]),
    ([5, 5, 5], 10, [[0, 1], [2]]),
    ([20, 1], 10, [[0], [1]]),  # longer than the budget: alone
    ([1, 1, 1, 1], 100, [[0, 1, 2, 3]]),
    ([], 10, []),
])
def test_plan_gold(lengths, budget, gold):
    assert plan_batches(lengths, budget) == gold


def test_pack_alignment_gold():
    # two requests: [10 11 12 13] scoring from index 2, [20 21 22] scoring from index 1
    reqs = [ScoreRequest([10, 11, 12, 13], 2), ScoreRequest([20, 21, 22], 1, temperature=0.5)]
    b = pack([Tree((0,)), Tree((1,))], reqs, torch.device("cpu"))
    assert b.input_ids.tolist() == [10, 11, 12, 20, 21]  # the last token of each is never fed
    assert b.positions.tolist() == [0, 1, 2, 0, 1]
    assert [(s.start, s.end, s.context) for s in b.meta.segments] == [(0, 3, ()), (3, 5, ())]
    assert b.score_rows.tolist() == [1, 2, 3, 4]  # row 1 (token 11) predicts 12, ...
    assert b.targets.tolist() == [12, 13, 21, 22]
    assert b.temperature.tolist() == [1.0, 1.0, 0.5, 0.5]


@pytest.mark.parametrize("length, size, align, gold", [
    (300, 100, 64, [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]),
    (300, 128, 64, [(0, 128), (128, 256), (256, 300)]),
    (130, 10, 64, [(0, 64), (64, 128), (128, 130)]),  # a budget under the alignment: one aligned block
    (7, 6, 1, [(0, 6), (6, 7)]),
    (64, 64, 64, [(0, 64)]),
])
def test_chunk_bounds_gold(length, size, align, gold):
    assert chunk_bounds(length, size, align) == gold


@pytest.mark.parametrize("trees, align, min_shared, gold", [
    ([Tree((0, 1), 150)], 64, 16, [Tree((0, 1), 128)]),
    ([Tree((0, 1), 64)], 64, 16, [Tree((0, 1), 64)]),
    ([Tree((0, 1, 2), 63)], 64, 16, [Tree((0,)), Tree((1,)), Tree((2,))]),  # below one block: unshared
    ([Tree((0, 1), 130)], 64, 129, [Tree((0,)), Tree((1,))]),  # 128 < min_shared
    ([Tree((3,)), Tree((0, 5), 20)], 4, 16, [Tree((3,)), Tree((0, 5), 20)]),
])
def test_aligned_trees_gold(trees, align, min_shared, gold):
    assert aligned_trees(trees, align, min_shared) == gold


def test_plan_work_aligned_gold():
    # two requests sharing 70 tokens and a long one: the prefix is cut to 64, chunks fall on 64s
    a, b = [1] * 70 + [2, 3], [1] * 70 + [4]
    plan = plan_work([a, b, [5] * 150], 100, min_shared=16, align=64)
    assert plan == [[Tree((0, 1), 64)], [Chunk(2, 0, 64)], [Chunk(2, 64, 128)], [Chunk(2, 128, 150)]]
    assert plan_work([a, b, [5] * 150], 100, min_shared=16) == [
        [Tree((0, 1), 70)], [Chunk(2, 0, 100)], [Chunk(2, 100, 150)]]


def test_common_prefix_blocks_equal_token_by_token():
    """The block-wise comparison gives what a token-by-token walk gives, at every block size,
    whether the lists part inside a block, at its edge, or never."""
    import random

    from logprobe.engine.scheduler import common_prefix

    def walk(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    rng = random.Random(3)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(10))]
        for block in (1, 2, 7, 256):
            assert common_prefix(a, b, block) == walk(a, b) == common_prefix(b, a, block)
