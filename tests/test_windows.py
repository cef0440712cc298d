"""Window arithmetic pinned by literal gold tables."""

from __future__ import annotations

import pytest

from logprobe.errors import LogprobeError
from logprobe.scoring.windows import Window, llamacpp_windows, make_windows, sliding_windows

W = Window


def scored(windows):
    return [j for w in windows for j in range(w.score_begin, w.end)]


@pytest.mark.parametrize("n, ctx, stride, gold", [
    # the docstring example
    (10, 4, 2, [W(0, 4, 1), W(2, 6, 4), W(4, 8, 6), W(6, 10, 8)]),
    # stride = context: one token of context carried over (the HF guide would skip tokens 4, 8)
    (10, 4, 4, [W(0, 4, 1), W(3, 8, 4), W(7, 10, 8)]),
    # last window shorter than the stride
    (5, 4, 2, [W(0, 4, 1), W(2, 5, 4)]),
    # text shorter than one window
    (3, 8, 2, [W(0, 3, 1)]),
    # text exactly one window
    (4, 4, 1, [W(0, 4, 1)]),
    # stride 1: one new token per window
    (6, 4, 1, [W(0, 4, 1), W(1, 5, 4), W(2, 6, 5)]),
    (2, 2, 1, [W(0, 2, 1)]),
])
def test_sliding_gold(n, ctx, stride, gold):
    got = sliding_windows(n, ctx, stride)
    assert got == gold
    assert scored(got) == list(range(1, n))  # every token after the first, exactly once
    assert all(w.end - w.begin - 1 <= ctx for w in got)  # fed tokens never exceed the context


@pytest.mark.parametrize("n, ctx, gold", [
    (10, 4, [W(0, 4, 3), W(4, 8, 7)]),
    (8, 4, [W(0, 4, 3), W(4, 8, 7)]),
    (12, 6, [W(0, 6, 4), W(6, 12, 10)]),
    (1024, 512, [W(0, 512, 257), W(512, 1024, 769)]),
    (5, 5, [W(0, 5, 3)]),
])
def test_llamacpp_gold(n, ctx, gold):
    assert llamacpp_windows(n, ctx) == gold


def test_llamacpp_scores_second_half():
    ws = llamacpp_windows(2048, 512)
    assert [w.end - w.score_begin for w in ws] == [255] * 4  # n_ctx - n_ctx/2 - 1 per chunk


def test_window_errors():
    with pytest.raises(LogprobeError, match="stride"):
        sliding_windows(10, 4, 5)
    with pytest.raises(LogprobeError, match="stride"):
        sliding_windows(10, 4, 0)
    with pytest.raises(LogprobeError, match="context_length"):
        sliding_windows(10, 1, 1)
    with pytest.raises(LogprobeError, match="text"):
        sliding_windows(1, 4, 2)
    with pytest.raises(LogprobeError, match="text"):
        llamacpp_windows(3, 4)
    with pytest.raises(LogprobeError, match="policy"):
        make_windows("nope", 10, 4, 2)


@pytest.mark.parametrize("n,ctx,gold", [
    (10, 4, [Window(0, 4, 1), Window(3, 7, 4), Window(6, 10, 7)]),
    (11, 4, [Window(0, 4, 1), Window(3, 7, 4), Window(6, 10, 7), Window(7, 11, 10)]),
    (5, 4, [Window(0, 4, 1), Window(1, 5, 4)]),
    (3, 4, [Window(0, 3, 1)]),
    (2, 2, [Window(0, 2, 1)]),
    (4, 2, [Window(0, 2, 1), Window(1, 3, 2), Window(2, 4, 3)]),
])
def test_rolling_gold(n, ctx, gold):
    assert make_windows("rolling", n, ctx) == gold


@pytest.mark.parametrize("n,ctx", [(10, 4), (11, 4), (100, 7), (2, 2), (33, 33), (34, 33), (500, 64)])
def test_rolling_equals_lm_eval(n, ctx):
    """Same (fed tokens, scored tokens) as lm-eval's get_rolling_token_windows + make_disjoint_window
    with max_seq_len = ctx - 1 over the stream [prefix] + tokens."""
    utils = pytest.importorskip("lm_eval.utils")
    stream = list(range(n))  # stream[0] is the prefix token
    theirs = [utils.make_disjoint_window(w) for w in
              utils.get_rolling_token_windows(stream[1:], stream[0], max_seq_len=ctx - 1, context_len=1)]
    ours = [(stream[w.begin:w.end - 1], stream[w.score_begin:w.end]) for w in make_windows("rolling", n, ctx)]
    # lm-eval feeds context + continuation[:-1]; ours feeds tokens[begin:end-1] and scores [score_begin:end]
    assert [(ctx_ + cont[:-1], cont) for ctx_, cont in theirs] == ours
