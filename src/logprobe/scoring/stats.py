"""Perplexity statistics from per-token negative log-likelihoods (lm-evaluation-harness definitions)."""

from __future__ import annotations

import math
import re


def count_words(text: str) -> int:
    """Words as lm-eval counts them for word perplexity: pieces between runs of whitespace."""
    return len(re.split(r"\s+", text))


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n)); stderr is nan for n < 2."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, math.nan
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def exp_or_inf(x: float) -> float:
    """``math.exp``, but inf (then ``null`` in JSON) where the result exceeds float64, not OverflowError.

    >>> exp_or_inf(0.0), exp_or_inf(1e6)
    (1.0, inf)
    """
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
