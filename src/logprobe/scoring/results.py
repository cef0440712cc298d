"""What the ``Scorer`` methods return: one dataclass per job, each with ``to_dict()`` for JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ..interp.specs import Capture


@dataclass(slots=True)
class ContinuationScore:
    continuation: str  # the continuation as scored (boundary whitespace moved onto it)
    log_prob: float  # sum of the token log-probs, natural log
    prob: float  # exp(log_prob)
    perplexity: float  # exp(-log_prob / num_tokens)
    num_tokens: int
    is_greedy: bool  # every token was the argmax of its position
    tokens: list[str]
    token_ids: list[int]
    token_logprobs: list[float]
    entropy: list[float] | None = None
    top_k: list[list[tuple[int, str, float]]] | None = None  # per token: (id, text, log-prob)
    captures: list[Capture] | None = None  # per capture entry and point, positions as in interp.specs

    def to_dict(self) -> dict:
        d = asdict(self)
        d["captures"] = None if self.captures is None else [c.to_dict() for c in self.captures]
        return d


@dataclass(slots=True)
class SequenceLogprobs:
    """One log-prob per completion token (RL): ``logprobs[j]`` is log p(completion[j] | prompt, completion[:j])."""

    logprobs: torch.Tensor  # [n] float32
    ranks: torch.Tensor  # [n] int64, 0 = the token was the argmax
    entropy: torch.Tensor | None = None  # [n]
    topk_ids: torch.Tensor | None = None  # [n, k]
    topk_logprobs: torch.Tensor | None = None  # [n, k]
    captures: list[Capture] | None = None
    # [len(prompt) + len(completion) - 1, moe_layers, k] int32: the experts of every token fed
    # (return_routed_experts; row j: token j's routing at each MoE layer, the router's order)
    routed_experts: torch.Tensor | None = None

    @property
    def sum_logprob(self) -> float:
        return float(self.logprobs.double().sum())

    def to_dict(self) -> dict:
        d = {"logprobs": self.logprobs.tolist(), "sum_logprob": self.sum_logprob,
             "is_greedy": (self.ranks == 0).tolist()}
        if self.entropy is not None:
            d["entropy"] = self.entropy.tolist()
        if self.topk_ids is not None:
            d["top_k_ids"] = self.topk_ids.tolist()
            d["top_k_logprobs"] = self.topk_logprobs.tolist()
        if self.captures is not None:
            d["captures"] = [c.to_dict() for c in self.captures]
        if self.routed_experts is not None:
            d["routed_experts"] = self.routed_experts.tolist()
        return d


@dataclass(slots=True)
class PerplexityResult:
    perplexity: float  # exp(mean token NLL)
    perplexity_stderr: float  # delta method: perplexity * nll_stderr
    nll_mean: float
    nll_stderr: float
    num_tokens: int  # scored tokens
    num_windows: int
    policy: str
    context_length: int
    stride: int | None
    word_perplexity: float | None = None  # exp(total NLL / words), texts only
    byte_perplexity: float | None = None  # exp(total NLL / UTF-8 bytes), texts only
    bits_per_byte: float | None = None  # total NLL / bytes / ln 2
    num_words: int | None = None
    num_bytes: int | None = None
    token_nlls: list[list[float]] | None = field(default=None, repr=False)  # per text, in token order
    captures: list[list[Capture]] | None = field(default=None, repr=False)  # per text; positions = text tokens

    def to_dict(self) -> dict:
        d = asdict(self)
        d["captures"] = None if self.captures is None else [[c.to_dict() for c in cs] for cs in self.captures]
        return d
