"""A scoring request: token ids and which of them are scored, with per-request head options."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class SteerAt:
    """Steer the rows of token indices ``positions`` at one hook point (see ``layers.hooks``)."""

    point: str
    positions: tuple[int, ...]
    op: str  # add | add_signed | project_out
    vector: torch.Tensor  # [H] float32
    coeff: float


@dataclass(frozen=True, slots=True)
class CaptureAt:
    """Read the rows of token indices ``positions`` at one hook point.

    kind "rows" -> [n, H]; "sum" -> [H]; "project" -> [n] (onto ``vector``)."""

    point: str
    positions: tuple[int, ...]
    kind: str
    vector: torch.Tensor | None = None


@dataclass(slots=True)
class ImageInputs:
    """A request's images: the processor's patches, where their tokens are, the multimodal
    positions of every token (Qwen3.5, ``models.qwen3_5_vision``) and the bidirectional spans of
    its image tokens (Gemma 3). The engine runs the vision tower once per request (``embeds``,
    kept here) and puts its rows at the image tokens.

    Two images, grids (1, 4, 4) and (1, 2, 4) merged by 2: 4 + 2 image tokens; ``token_index``
    lists the 6 tokens' indices in ``ScoreRequest.tokens``, ``embeds`` is then [6, H]."""

    pixel_values: torch.Tensor  # [patches, patch_dim]: every image's patches, image after image
    grids: tuple[tuple[int, int, int], ...]  # each image's (t, h, w) patch grid
    token_index: np.ndarray  # [n] int64: the index of each image token in the request's tokens, in order
    positions: np.ndarray | None  # [3, len(tokens)] int64: (t, h, w) position rows; None: token indices
    # each image's digest (its pixel values and grid): two requests share prefix rows only where
    # their ids and the images among them are equal (``engine.images.planned_ids``)
    keys: tuple[str, ...]
    embeds: torch.Tensor | None = None  # [n, H] the tower's output, set by the engine (``engine.images``)
    # token index spans [a, e) whose rows see the keys up to e (a run of image tokens attending to
    # itself both ways: Gemma 3, ``engine.images.bidirectional_spans``); () for causal attention
    spans: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class ScoreRequest:
    """Score ``tokens[score_begin:]``; token j is predicted by the row of token j - 1.

    Only ``tokens[:-1]`` is fed to the model (the last token is a target, never an input), unless a
    capture reads the last token's row: then every token is fed and the last row scores nothing.
    Options are per request, so requests with different temperatures or steering share a batch.
    """

    tokens: list[int]
    score_begin: int
    temperature: float = 1.0
    top_k: int = 0
    entropy: bool = False
    steer: tuple[SteerAt, ...] = ()
    capture: tuple[CaptureAt, ...] = ()
    # mixture-of-experts routing (``layers.hooks.RouteTable``): read the expert ids of tokens
    # 0 .. len(tokens) - 2 (every token fed, SGLang's convention), and/or force them:
    # force_experts [len(tokens) - 1, moe_layers, k] int64, row j for token j
    route: bool = False
    force_experts: torch.Tensor | None = None
    images: ImageInputs | None = None  # image tokens: all before score_begin (only text is scored)

    def __post_init__(self) -> None:
        if not 1 <= self.score_begin < len(self.tokens):
            raise ValueError(f"score_begin {self.score_begin} outside [1, {len(self.tokens)})")
        if self.images is not None and len(self.images.token_index) and \
                int(self.images.token_index[-1]) >= self.score_begin:
            raise ValueError(f"an image token at {int(self.images.token_index[-1])} is scored (score_begin "
                             f"{self.score_begin}): only text tokens carry log-probs")

    @property
    def hooked(self) -> bool:
        """Whether it steers, captures, or reads or forces routed experts (its pass needs hooks)."""
        return bool(self.steer or self.capture or self.route or self.force_experts is not None)

    @property
    def feeds_last(self) -> bool:
        last = len(self.tokens) - 1
        return any(c.positions and c.positions[-1] == last for c in self.capture)

    @property
    def num_inputs(self) -> int:
        return len(self.tokens) - (0 if self.feeds_last else 1)

    @property
    def inputs(self) -> list[int]:
        return self.tokens[:self.num_inputs]

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
    captures: list[torch.Tensor] | None = None  # one per ScoreRequest.capture, float32
    routed_experts: torch.Tensor | None = None  # [tokens fed here, moe_layers, k] int64 (ScoreRequest.route)
    cached_tokens: int = 0  # leading input tokens read from the prefix cache, not computed (engine.prefix_cache)
