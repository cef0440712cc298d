"""What a page shows: tokens, and for each scored one its numbers. Pure functions, no model.

A ``Segment`` is one block of text on the page (a continuation after its prompt, or a whole
document); its ``tokens`` are shown in order, a ``Token`` with ``logprob`` None as unscored
context (grey), the others coloured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import LogprobeError


@dataclass(slots=True)
class Token:
    """One displayed token: ``Token(" Paris", -0.2581, rank=0, top=[(" Paris", -0.2581), (" the", -2.1)])``.

    ``logprob`` None and ``kl`` None: context, not scored. ``rank`` 0 = the model's argmax."""

    text: str
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[str, float]] = field(default_factory=list)  # alternatives, most likely first
    entropy: float | None = None
    kl: float | None = None  # KL(R || Q) at this token (compare pages)
    logprob_r: float | None = None  # compare pages: the reference's log-prob (``logprob``, ``top``: the model's)
    top_r: list[tuple[str, float]] = field(default_factory=list)  # the reference's alternatives

    @property
    def scored(self) -> bool:
        return self.logprob is not None or self.kl is not None


@dataclass(slots=True)
class Segment:
    label: str
    tokens: list[Token]

    @property
    def num_scored(self) -> int:
        return sum(t.scored for t in self.tokens)


def locate_targets(stream: Sequence[int], windows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[int]:
    """Where each window's scored tokens start in ``stream`` (the text's token ids).

    ``windows`` are ``(inputs, targets)`` in order, their targets disjoint and increasing (every
    perplexity policy); each is found at or after the end of the previous one, where the
    window's own tokens (its context before the targets) match the stream too:

    >>> locate_targets([5, 6, 7, 8, 9, 5, 6], [([1, 5, 6, 7], [5, 6, 7]), ([7, 8, 9], [8, 9])])
    [0, 3]
    >>> locate_targets([5, 6, 5, 6], [([5, 6], [6]), ([6, 5, 6], [6])])   # the second 6, after its context
    [1, 3]
    """
    starts, cursor = [], 0
    for inputs, targets in windows:
        n, ctx = len(targets), list(inputs[:len(inputs) - len(targets)])
        pos = cursor
        while pos + n <= len(stream):
            before = list(stream[max(0, pos - len(ctx)):pos])
            # the context may begin with a prefix/BOS token that is not in the stream
            if list(stream[pos:pos + n]) == list(targets) and ctx[len(ctx) - len(before):][1:] == before[1:]:
                break
            pos += 1
        else:
            raise LogprobeError("report", "a window's scored tokens are not in the text's tokens",
                                "this is a bug: report it with the command line")
        starts.append(pos)
        cursor = pos + n
    return starts


def stream_tokens(texts: Sequence[str], starts: Sequence[int], scored: Sequence[Sequence[Token]]) -> list[Token]:
    """The whole text as tokens: ``texts[i]`` is stream token i; windows' scored ``Token`` lists
    replace the context tokens at their ``starts``.

    >>> [t.logprob for t in stream_tokens(["a", "b", "c"], [1], [[Token("b", -1.0)]])]
    [None, -1.0, None]
    """
    out = [Token(t) for t in texts]
    for start, toks in zip(starts, scored, strict=True):
        out[start:start + len(toks)] = toks
    return out


def result_tokens(texts: Sequence[str], logprobs: Sequence[float], ranks: Sequence[int] | None = None,
                  top: Sequence[Sequence[tuple[str, float]]] | None = None,
                  entropy: Sequence[float] | None = None) -> list[Token]:
    """Scored tokens from parallel per-token lists (a scorer result's columns).

    >>> result_tokens([" Paris"], [-0.25], [0], [[(" Paris", -0.25), (" the", -2.5)]])[0].rank
    0
    """
    n = len(texts)
    if len(logprobs) != n or (ranks is not None and len(ranks) != n) or (top is not None and len(top) != n):
        raise LogprobeError("report", "per-token lists of different lengths")
    return [Token(texts[i], float(logprobs[i]), None if ranks is None else int(ranks[i]),
                  [] if top is None else [(str(a), float(b)) for a, b in top[i]],
                  None if entropy is None else float(entropy[i])) for i in range(n)]
