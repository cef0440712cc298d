"""Training-inference mismatch: logprobe's exact log-probs against another engine's for the same
tokens (a rollout engine's sampling log-probs, or a trainer's recomputed ones).

For each scored token t of a sequence, with ``p`` the probability logprobe computes and ``q`` the
one the file gives (the engine that sampled the token, so tokens are draws from q):

    d_t  = log p_t - log q_t            (the log importance ratio; Δ)
    k1_t = -d_t                         unbiased, can be negative
    k2_t = d_t**2 / 2                   low variance, biased
    k3_t = exp(d_t) - 1 - d_t           unbiased and >= 0 (Schulman's estimator)
    each a per-token estimate of KL(q || p); the report gives their means.
    ratio_t = exp(d_t) = p_t / q_t      outside [low, high] (default [0.8, 1.25]) counts as "out"

Worked example (two tokens; logprobe -1.0 and -2.0, the file -1.1 and -1.5):

    d = [0.1, -0.5]; max |Δ| 0.5, mean |Δ| 0.3; k1 0.2, k2 0.065, k3 0.05585079
    ratios [1.105, 0.607]: one of two outside [0.8, 1.25] -> fraction 0.5

Per sequence the means are over its tokens; overall they are over all tokens of all sequences
(token-weighted), summed in float64 in sequence order, so the report does not depend on how the
sequences were batched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from ..errors import LogprobeError


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The mismatch of one sequence, or of all of them (``overall``)."""

    tokens: int
    max_abs: float  # max |Δ| (nats)
    mean_abs: float  # mean |Δ|
    k1: float
    k2: float
    k3: float
    out_of_range: float  # fraction of tokens whose ratio p/q leaves [low, high]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class MismatchReport:
    sequences: list[Mismatch]
    overall: Mismatch
    low: float
    high: float

    def to_dict(self) -> dict:
        return {"overall": self.overall.to_dict(), "low": self.low, "high": self.high,
                "sequences": [m.to_dict() for m in self.sequences]}

    def report(self) -> str:
        o = self.overall
        return (f"{len(self.sequences)} sequences, {o.tokens} tokens: max |Δ| {o.max_abs:.4g}, "
                f"mean |Δ| {o.mean_abs:.4g} nats; KL estimators k1 {o.k1:.4g}, k2 {o.k2:.4g}, k3 {o.k3:.4g}; "
                f"{100 * o.out_of_range:.3g}% of tokens with p/q outside [{self.low:g}, {self.high:g}]")


@dataclass(slots=True)
class _Sums:
    """Running float64 sums of the per-token terms, in the order the tokens are added."""

    tokens: int = 0
    max_abs: float = 0.0
    abs: float = 0.0
    k1: float = 0.0
    k2: float = 0.0
    k3: float = 0.0
    out: int = 0

    def add(self, d: torch.Tensor, low: float, high: float) -> None:
        d = d.to(torch.float64)  # [n] log p - log q
        ratio = d.exp()
        self.tokens += d.numel()
        if d.numel():
            self.max_abs = max(self.max_abs, float(d.abs().max()))
        self.abs += float(d.abs().sum())
        self.k1 += float((-d).sum())
        self.k2 += float((d * d / 2).sum())
        self.k3 += float((torch.expm1(d) - d).sum())
        self.out += int(((ratio < low) | (ratio > high)).sum())

    def merge(self, other: _Sums) -> None:
        self.tokens += other.tokens
        self.max_abs = max(self.max_abs, other.max_abs)
        self.abs += other.abs
        self.k1 += other.k1
        self.k2 += other.k2
        self.k3 += other.k3
        self.out += other.out

    def result(self) -> Mismatch:
        n = max(self.tokens, 1)  # an empty sequence reports zeros
        return Mismatch(self.tokens, self.max_abs, self.abs / n, self.k1 / n, self.k2 / n, self.k3 / n,
                        self.out / n)


def mismatch(ours: Sequence[torch.Tensor | Sequence[float]], theirs: Sequence[torch.Tensor | Sequence[float]],
             low: float = 0.8, high: float = 1.25) -> MismatchReport:
    """Compare per-token log-probs sequence by sequence (``ours[i][j]`` and ``theirs[i][j]``: the
    j-th scored token of sequence i); see the module docstring for the terms.

    >>> r = mismatch([[-1.0, -2.0]], [[-1.1, -1.5]])
    >>> round(r.overall.k3, 8), r.overall.out_of_range
    (0.05585079, 0.5)
    """
    if not 0 < low <= 1 <= high or not math.isfinite(high):
        raise LogprobeError("ratio range", f"[{low}, {high}] must satisfy 0 < low <= 1 <= high", "e.g. 0.8 and 1.25")
    if len(ours) != len(theirs):
        raise LogprobeError("logprobs", f"{len(ours)} sequences scored against {len(theirs)} given",
                            "give one log-prob list per sequence")
    total, per = _Sums(), []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        a = torch.as_tensor(a, dtype=torch.float64).reshape(-1)
        b = torch.as_tensor(b, dtype=torch.float64).reshape(-1)
        if a.numel() != b.numel():
            raise LogprobeError(f"logprobs[{i}]", f"has {b.numel()} values for {a.numel()} completion tokens",
                                "give one log-prob per completion token")
        if not torch.isfinite(b).all():
            raise LogprobeError(f"logprobs[{i}]", "holds a value that is not a finite number",
                                "give finite log-probs (a token the engine could not score has no log-prob)")
        s = _Sums()
        s.add(a - b, low, high)
        per.append(s.result())
        total.merge(s)
    return MismatchReport(per, total.result(), low, high)
