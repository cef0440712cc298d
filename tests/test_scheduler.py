from __future__ import annotations

import pytest
import torch

from logprobe.engine.request import ScoreRequest
from logprobe.engine.runner import pack
from logprobe.engine.scheduler import Tree, plan_batches


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
