"""Request bodies, validated by pydantic (strict JSON types: ``"1"`` is not a number, ``1`` is not
``true``). Unknown fields are refused: a misspelt option must not silently fall back to a default."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_STRICT = ConfigDict(strict=True, extra="forbid")

PromptType = str | list[str] | list[int] | list[list[int]]


def _check_prompt(value: Any) -> Any:
    """One clear message instead of four union branches."""
    shape = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"must be {shape}, got {type(value).__name__}")
    if not value:
        raise ValueError("is an empty list; give at least one prompt")
    if all(isinstance(x, str) for x in value):
        return value
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return value
    if all(isinstance(x, list) for x in value):
        for i, ids in enumerate(value):
            for j, x in enumerate(ids):
                if not isinstance(x, int) or isinstance(x, bool):
                    raise ValueError(f"[{i}][{j}] must be an integer token id, got {x!r}")
        return value
    raise ValueError(f"must be {shape} (not a mixture)")


class CompletionRequest(BaseModel):
    """OpenAI ``/v1/completions``, for scoring: ``max_tokens`` 0 (prompt log-probs only) or 1 (one greedy token)."""

    model_config = _STRICT

    prompt: PromptType = Field(description="text, texts, token ids, or lists of token ids")
    model: str | None = None
    max_tokens: int = Field(16, description="0 or 1; OpenAI's default of 16 is refused: this server only scores")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, description="top alternatives per position (server cap applies)")
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False,
                               description="accepted for compatibility; the generated token is always greedy and "
                                           "log-probs are the model's own (temperature 1); use /v1/logprobs for "
                                           "temperature-scaled log-probs")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    user: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        return _check_prompt(v)


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    tokens: list[int]
    model: str | None = None


Positions = str | int | list[int | None]  # all | prompt | continuation | last | last_prompt | k | [start, end]
VectorType = list[float] | dict[str, list[float]]


def _check_vector(value: Any) -> Any:
    def numbers(v) -> bool:
        return isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)

    if value is None or numbers(value):
        return value
    if isinstance(value, dict) and value and all(isinstance(k, str) and numbers(v) for k, v in value.items()):
        return value
    raise ValueError("must be a list of numbers or a {layer: [numbers]} object; the server reads no vector files, "
                     "send the numbers inline")


def _check_positions(value: Any) -> Any:
    if isinstance(value, str) or isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], int) and not isinstance(value[0], bool) \
            and (value[1] is None or isinstance(value[1], int) and not isinstance(value[1], bool)):
        return value
    raise ValueError("must be all, prompt, continuation, last, last_prompt, a token index or [start, end]")


class CaptureEntry(BaseModel):
    """Read hidden states at hook points (see the README's hook-point table)."""

    model_config = _STRICT
    at: str | list[str] = Field(description="hook point(s): blocks.10.resid_post, blocks.*.mlp_out, hidden_states.4, ...")
    positions: Positions = "all"
    reduce: Literal["none", "mean", "sum", "last", "project"] = "none"
    vector: VectorType | None = Field(None, description="reduce 'project': the vector (or {layer: vector})")

    _v = field_validator("vector", mode="plain")(classmethod(lambda cls, v: _check_vector(v)))
    _p = field_validator("positions", mode="plain")(classmethod(lambda cls, v: _check_positions(v)))


class SteerEntry(BaseModel):
    """Steer hidden states at hook points; vectors inline (the server reads no files)."""

    model_config = _STRICT
    at: str | list[str] | None = Field(None, description="hook point(s); default for {layer: vector}: each layer's "
                                                         "resid_post")
    vector: VectorType
    coeff: float | dict[str, float] = 1.0
    positions: Positions = "all"
    op: Literal["add", "add_signed", "project_out"] = "add"

    _v = field_validator("vector", mode="plain")(classmethod(lambda cls, v: _check_vector(v)))
    _p = field_validator("positions", mode="plain")(classmethod(lambda cls, v: _check_positions(v)))


class _Hooks(BaseModel):
    capture: list[CaptureEntry] | None = None
    steer: list[SteerEntry] | None = None

    def hook_args(self) -> dict:
        dump = lambda xs: None if xs is None else [x.model_dump(exclude_none=True) for x in xs]  # noqa: E731
        return {"capture": dump(self.capture), "steer": dump(self.steer)}


class _HeadOptions(BaseModel):
    """What the log-prob head computes, per request (the library's ``temperature``/``top_k``/``entropy``)."""

    model_config = _STRICT
    model: str | None = None
    temperature: float = Field(1.0, gt=0, allow_inf_nan=False, description="log_softmax(logits / temperature)")
    top_k: int = Field(0, ge=0, description="also return the k most likely tokens per position (no cap)")
    entropy: bool = False


class ScoreBody(_HeadOptions, _Hooks):
    """``POST /v1/score``: log p(continuation | prompt) for each continuation (``Scorer.score``)."""

    prompt: str
    continuations: list[str] = Field(min_length=1)


class Sequence(BaseModel):
    model_config = _STRICT
    prompt_token_ids: list[int] = Field(min_length=1)
    completion_token_ids: list[int] = Field(min_length=1)


class LogprobsBody(_HeadOptions, _Hooks):
    """``POST /v1/logprobs``: per-token log-probs of completions (``Scorer.logprobs``, RL)."""

    sequences: list[Sequence] = Field(min_length=1)


class PerplexityBody(_Hooks):
    """``POST /v1/perplexity`` (``Scorer.perplexity``)."""

    model_config = _STRICT
    texts: PromptType = Field(description="a text, texts, token ids, or lists of token ids")
    model: str | None = None
    context_length: int | None = Field(None, ge=2)
    stride: int | None = Field(None, ge=1)
    policy: Literal["sliding", "llama.cpp", "rolling"] = "sliding"
    prefix: bool | None = None
    max_tokens: int | None = Field(None, ge=2)
    return_token_nlls: bool = False

    @field_validator("texts", mode="plain")
    @classmethod
    def _texts(cls, v: Any) -> Any:
        return _check_prompt(v)
