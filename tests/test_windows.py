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
