"""Perplexity windows: which tokens each forward pass reads and which it scores. Pure functions.

A window ``Window(begin, end, score_begin)`` feeds tokens[begin:end] and scores the targets
tokens[score_begin:end], each predicted by the row before it (score_begin >= begin + 1).

Policy "sliding" (the Hugging Face perplexity guide), context C, stride S <= C:
windows start at 0, S, 2S, ...; each scores only the tokens the previous windows did not, so
every token after the first is scored exactly once, with up to C - S tokens of extra context.

    tokens  0 1 2 3 4 5 6 7 8 9            C = 4, S = 2, n = 10
    w0      [0 1 2 3]        scores 1..3   (token 0 has no context)
    w1          [2 3 4 5]    scores 4..5   (context 2 3)
    w2              [4 5 6 7]    scores 6..7
    w3                  [6 7 8 9] scores 8..9   -> stop: the window reached the end

A scored token always needs the token before it in its window. With S = C the guide's windows
would start exactly at their first scored token and silently skip it; here such a window starts
one token earlier instead (C + 1 tokens, of which C are fed: the last is only a target):

    tokens  0 1 2 3 4 5 6 7 8 9            C = 4, S = 4
    w0      [0 1 2 3]            scores 1..3
    w1            [3 4 5 6 7]    scores 4..7
    w2                    [7 8 9] scores 8..9

Policy "llama.cpp" (llama-perplexity): non-overlapping chunks of C tokens; a trailing partial
chunk is dropped; each chunk scores its second half, targets at offsets C//2 + 1 .. C-1 (the
row at offset C//2 is the first to predict), so each chunk scores C - C//2 - 1 tokens.

    tokens  0 1 2 3 4 5 6 7 8 9            C = 4, n = 10
    w0      [0 1 2 3]        scores 3
    w1              [4 5 6 7]    scores 7      (8, 9 dropped: not a whole chunk)

Policy "rolling" (lm-evaluation-harness's ``loglikelihood_rolling``): windows of C tokens
(C - 1 fed) whose scored tokens never overlap; every window but the first scores up to C - 1
new tokens and reaches back for a full window of context, the last one too:

    tokens  0 1 2 3 4 5 6 7 8 9            C = 4, n = 10
    w0      [0 1 2 3]            scores 1..3
    w1            [3 4 5 6]      scores 4..6
    w2                  [6 7 8 9] scores 7..9
    (lm-eval with max_length L uses C = L - 1: L - 2 fed tokens plus its one generated token)
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import LogprobeError

POLICIES = ("sliding", "llama.cpp", "rolling")


class Window(NamedTuple):
    begin: int
    end: int
    score_begin: int


def sliding_windows(n_tokens: int, context_length: int, stride: int) -> list[Window]:
    _check(n_tokens, context_length, stride)
    if stride > context_length:
        raise LogprobeError("stride", f"{stride} > context_length {context_length} would skip tokens",
                            "use stride <= context_length")
    windows, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + context_length, n_tokens)
        first = max(prev_end, 1)  # first token this window scores
        windows.append(Window(min(begin, first - 1), end, first))
        if end == n_tokens:
            return windows
        prev_end, begin = end, begin + stride


def llamacpp_windows(n_tokens: int, context_length: int) -> list[Window]:
    _check(n_tokens, context_length, context_length)
    if context_length < 4:
        raise LogprobeError("context_length", "must be >= 4 for the llama.cpp policy")
    if n_tokens < context_length:
        raise LogprobeError("text", f"has {n_tokens} tokens, fewer than one llama.cpp chunk of {context_length}",
                            "use a longer text, a smaller --context-length, or --policy sliding")
    first = context_length // 2
    return [Window(b, b + context_length, b + first + 1)
            for b in range(0, n_tokens - context_length + 1, context_length)]


def rolling_windows(n_tokens: int, context_length: int) -> list[Window]:
    _check(n_tokens, context_length, context_length)
    end = min(context_length, n_tokens)
    windows = [Window(0, end, 1)]
    while end < n_tokens:
        new_end = min(end + context_length - 1, n_tokens)
        windows.append(Window(max(0, new_end - context_length), new_end, end))
        end = new_end
    return windows


def make_windows(policy: str, n_tokens: int, context_length: int, stride: int | None = None) -> list[Window]:
    if policy == "sliding":
        return sliding_windows(n_tokens, context_length, context_length if stride is None else stride)
    if policy == "llama.cpp":
        return llamacpp_windows(n_tokens, context_length)
    if policy == "rolling":
        return rolling_windows(n_tokens, context_length)
    raise LogprobeError("policy", f"unknown window policy {policy!r}", f"use one of {', '.join(POLICIES)}")


def _check(n_tokens: int, context_length: int, stride: int) -> None:
    if not isinstance(context_length, int) or context_length < 2:
        raise LogprobeError("context_length", f"must be an integer >= 2, got {context_length!r}")
    if not isinstance(stride, int) or stride < 1:
        raise LogprobeError("stride", f"must be a positive integer, got {stride!r}")
    if n_tokens < 2:
        raise LogprobeError("text", f"has {n_tokens} token(s); perplexity needs at least 2 "
                            "(the first token has no context)", "give a longer text")
