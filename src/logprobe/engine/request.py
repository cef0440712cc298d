"""A scoring request: token ids and which of them are scored, with per-request head options."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ScoreRequest:
    """Score ``tokens[score_begin:]``; token j is predicted by the row of token j - 1.

    Only ``tokens[:-1]`` is fed to the model (the last token is a target, never an input).
    Options are per request, so requests with different temperatures share a batch.
    """

    tokens: list[int]
    score_begin: int
    temperature: float = 1.0
    top_k: int = 0
    entropy: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.score_begin < len(self.tokens):
            raise ValueError(f"score_begin {self.score_begin} outside [1, {len(self.tokens)})")

    @property
    def num_inputs(self) -> int:
        return len(self.tokens) - 1

    @property
    def num_scored(self) -> int:
        return len(self.tokens) - self.score_begin


@dataclass(slots=True)
class RequestResult:
    logprobs: torch.Tensor  # [n] float32, n = num_scored
    ranks: torch.Tensor  # [n] int64: how many vocabulary entries beat the target (0 = greedy)
    entropy: torch.Tensor | None = None  # [n]
    topk_ids: torch.Tensor | None = None  # [n, k]
    topk_logprobs: torch.Tensor | None = None  # [n, k]
