"""Request bodies, validated by pydantic (strict JSON types: ``"1"`` is not a number, ``1`` is not
``true``). Unknown fields are refused: a misspelt option must not silently fall back to a default.
Every string (dict keys included) is ``Text``: a lone surrogate, valid in JSON (``"\\ud800"``) but
not in Unicode, is a 400 naming the field before any tokenizer sees it.

The ``*Reply`` models document the successful answers in the OpenAPI schema (the handlers build
plain dicts); ``ErrorReply`` is every 4xx/5xx body."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from ..io.text import text_problem

_STRICT = ConfigDict(strict=True, extra="forbid")


def _valid_text(value: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(f"{problem}; send UTF-8 text")
    return value


Text = Annotated[str, AfterValidator(_valid_text)]
"""A string that is valid Unicode (no lone surrogates): every string field of every body is one."""

PromptType = Text | list[Text] | list[int] | list[list[int]]
_Ids = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
PromptSchema = (Annotated[Text, Field(min_length=1)] | Annotated[list[Annotated[Text, Field(min_length=1)]],
                Field(min_length=1)] | _Ids | Annotated[list[_Ids], Field(min_length=1)])
"""What the OpenAPI document says a prompt is (``_check_prompt`` gives the clear messages)."""


def _check_prompt(value: Any) -> Any:
    """One clear message instead of four union branches."""
    shape = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(value, str):
        return _valid_text(value)
    if not isinstance(value, list):
        raise ValueError(f"must be {shape}, got {type(value).__name__}")
    if not value:
        raise ValueError("is an empty list; give at least one prompt")
    if all(isinstance(x, str) for x in value):
        for i, x in enumerate(value):
            if (problem := text_problem(x)) is not None:
                raise ValueError(f"[{i}] {problem}; send UTF-8 text")
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
    model: Text | None = None
    max_tokens: int = Field(16, description="0 or 1; OpenAI's default of 16 is refused: this server only scores")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, description="top alternatives per position (server cap applies)")
    prompt_logprobs: int | None = Field(None, ge=0, description="vLLM's: choices[i].prompt_logprobs with the prompt "
                                                               "token and this many alternatives per position")
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False,
                               description="accepted for compatibility; the generated token is always greedy and "
                                           "log-probs are the model's own (temperature 1); use /v1/logprobs for "
                                           "temperature-scaled log-probs")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[Text, float] | None = None
    suffix: Text | None = None
    user: Text | None = None

    @field_validator("prompt", mode="plain", json_schema_input_type=PromptSchema)
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        return _check_prompt(v)


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    prompt: Text
    model: Text | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    tokens: list[int]
    model: Text | None = None


Positions = str | int | list[int | None]  # all | prompt | continuation | last | last_prompt | k | [start, end]
PositionsSchema = Text | int | tuple[int, int | None]  # what the OpenAPI document says Positions is
VectorType = list[float] | dict[Text, list[float]]


def _check_vector(value: Any) -> Any:
    def numbers(v) -> bool:
        return isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)

    if value is None or numbers(value):
        return value
    if isinstance(value, dict) and value and all(isinstance(k, str) and numbers(v) for k, v in value.items()):
        for k in value:
            if (problem := text_problem(k)) is not None:
                raise ValueError(f"key {k!r} {problem}; send UTF-8 text")
        return value
    raise ValueError("must be a list of numbers or a {layer: [numbers]} object; the server reads no vector files, "
                     "send the numbers inline")


def _check_positions(value: Any) -> Any:
    if isinstance(value, str):
        return _valid_text(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], int) and not isinstance(value[0], bool) \
            and (value[1] is None or isinstance(value[1], int) and not isinstance(value[1], bool)):
        return value
    raise ValueError("must be all, prompt, continuation, last, last_prompt, a token index or [start, end]")


class CaptureEntry(BaseModel):
    """Read hidden states at hook points (see the hook-point table in docs/interp.md)."""

    model_config = _STRICT
    at: Text | list[Text] = Field(description="hook point(s): blocks.10.resid_post, blocks.*.mlp_out, hidden_states.4, ...")
    positions: Positions = "all"
    reduce: Literal["none", "mean", "sum", "last", "project"] = "none"
    vector: VectorType | None = Field(None, description="reduce 'project': the vector (or {layer: vector})")

    _v = field_validator("vector", mode="plain", json_schema_input_type=VectorType | None)(
        classmethod(lambda cls, v: _check_vector(v)))
    _p = field_validator("positions", mode="plain", json_schema_input_type=PositionsSchema)(
        classmethod(lambda cls, v: _check_positions(v)))


class SteerEntry(BaseModel):
    """Steer hidden states at hook points; vectors inline (the server reads no files)."""

    model_config = _STRICT
    at: Text | list[Text] | None = Field(None, description="hook point(s); default for {layer: vector}: each layer's "
                                                         "resid_post")
    vector: VectorType
    coeff: float | dict[Text, float] = 1.0
    positions: Positions = "all"
    op: Literal["add", "add_signed", "project_out"] = "add"

    _v = field_validator("vector", mode="plain", json_schema_input_type=VectorType)(
        classmethod(lambda cls, v: _check_vector(v)))
    _p = field_validator("positions", mode="plain", json_schema_input_type=PositionsSchema)(
        classmethod(lambda cls, v: _check_positions(v)))


class _Hooks(BaseModel):
    capture: list[CaptureEntry] | None = None
    steer: list[SteerEntry] | None = None

    def hook_args(self) -> dict:
        dump = lambda xs: None if xs is None else [x.model_dump(exclude_none=True) for x in xs]  # noqa: E731
        return {"capture": dump(self.capture), "steer": dump(self.steer)}


class _HeadOptions(BaseModel):
    """What the log-prob head computes, per request (the library's ``temperature``/``top_k``/``entropy``)."""

    model_config = _STRICT
    model: Text | None = None
    temperature: float = Field(1.0, gt=0, allow_inf_nan=False, description="log_softmax(logits / temperature)")
    top_k: int = Field(0, ge=0, description="also return the k most likely tokens per position (no cap)")
    entropy: bool = False


class _Deadline(BaseModel):
    timeout: float | None = Field(None, gt=0, le=86400, allow_inf_nan=False,
                                  description="seconds: a request not started by then answers 408 (code 'timeout') "
                                              "and is not computed; once started it is finished")


class ScoreBody(_HeadOptions, _Hooks, _Deadline):
    """``POST /v1/score``: log p(continuation | prompt) for each continuation (``Scorer.score``)."""

    prompt: Text
    continuations: list[Annotated[Text, Field(min_length=1)]] = Field(min_length=1)
    images: list[Text] | None = Field(None, min_length=1, description="a model with a vision tower: the prompt's "
                                      "images (data:image/...;base64 URLs; http(s) with --allow-remote-images), its "
                                      "placeholder once per image in prompt (Qwen3.5 <|image_pad|>); only the "
                                      "continuations are scored")


class MultiModalData(BaseModel):
    """verl's / vLLM's ``multi_modal_data``: images only (videos are not taken)."""

    model_config = _STRICT
    image: list[Text] = Field(min_length=1, description="data:image/...;base64 URLs or bare base64 (http(s) with "
                                                        "--allow-remote-images)")


class Sequence(BaseModel):
    model_config = _STRICT
    prompt_token_ids: list[int] = Field(min_length=1)
    completion_token_ids: list[int] = Field(min_length=1)
    images: list[Text] | None = Field(None, min_length=1, description="a model with a vision tower: the prompt's "
                                      "images (data:image/...;base64 URLs; http(s) with --allow-remote-images), "
                                      "the image token once per image in prompt_token_ids, or expanded")
    multi_modal_data: MultiModalData | None = Field(None, description="verl's form of images: {\"image\": [...]}")
    routed_experts: Text | list[list[list[int]]] | None = Field(
        None, description="mixture-of-experts models: the experts to force, [len(prompt) + len(completion) - 1]"
                          "[moe_layers][k] (every token fed), or SGLang's [..][num_hidden_layers][k] (zeros in "
                          "dense blocks), as lists or SGLang's base64 of int32")


class LogprobsBody(_HeadOptions, _Hooks, _Deadline):
    """``POST /v1/logprobs``: per-token log-probs of completions (``Scorer.logprobs``, RL)."""

    sequences: list[Sequence] = Field(min_length=1)
    return_routed_experts: bool = Field(False, description="each result's routed_experts: SGLang's base64 of "
                                                           "int32 [tokens fed, moe_layers, k] (the server needs "
                                                           "--enable-return-routed-experts)")


class PerplexityBody(_Hooks, _Deadline):
    """``POST /v1/perplexity`` (``Scorer.perplexity``)."""

    model_config = _STRICT
    texts: PromptType = Field(description="a text, texts, token ids, or lists of token ids")
    model: Text | None = None
    context_length: int | None = Field(None, ge=2)
    stride: int | None = Field(None, ge=1)
    policy: Literal["sliding", "llama.cpp", "rolling"] = "sliding"
    prefix: bool | None = None
    max_tokens: int | None = Field(None, ge=2)
    return_token_nlls: bool = False

    @field_validator("texts", mode="plain", json_schema_input_type=PromptSchema)
    @classmethod
    def _texts(cls, v: Any) -> Any:
        return _check_prompt(v)


# -- replies (documentation of the OpenAPI schema; a number that is not finite is null) -----------

_OPEN = ConfigDict(extra="allow")
Num = float | None  # a float, or null where the value is not finite (see io.jsonsafe: "<key>_reason")


class ErrorDetail(BaseModel):
    message: str = Field(description="'<field>: <problem>; <fix>'")
    type: str
    param: str | None = Field(description="the field at fault, when there is one")
    code: str | None


class ErrorReply(BaseModel):
    """Every 4xx and 5xx answer."""

    error: ErrorDetail


class CompletionLogprobs(BaseModel):
    model_config = _OPEN
    tokens: list[str]
    token_logprobs: list[Num]
    top_logprobs: list[dict[str, Num] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: Num
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    model_config = _OPEN
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="vLLM's, when asked for: null, then {token id: {logprob, rank, decoded_token}} per token")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens read from the prefix cache instead of computed "
                                           "(0 with the prefix cache off: logprobe serve --prefix-cache)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionReply(BaseModel):
    model_config = _OPEN
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    weights_version: int = Field(description="the weights that computed it (update_weights_from_disk "
                                                 "increments it)")
    weight_version: str = Field(description="their name (SGLang's weight_version: the one the update gave, "
                                            "else weights_version as a string)")


class ModelCard(BaseModel):
    model_config = _OPEN
    id: str
    object: Literal["model"]
    owned_by: str
    max_model_len: int


class ModelsReply(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeReply(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeReply(BaseModel):
    prompt: str


class TokenizerInfoReply(BaseModel):
    model_config = _OPEN
    tokenizer_class: str
    add_bos_token: bool
    model_max_length: int
    vocab_size: int


class ContinuationReply(BaseModel):
    model_config = _OPEN
    continuation: str
    log_prob: Num
    prob: Num
    perplexity: Num
    num_tokens: int
    is_greedy: bool
    tokens: list[str]
    token_ids: list[int]
    token_logprobs: list[Num]
    entropy: list[Num] | None
    top_k: list[list[tuple[int, str, Num]]] | None
    captures: list[dict[str, Any]] | None


class ScoreReply(BaseModel):
    model_config = _OPEN
    object: Literal["score"]
    model: str
    prompt: str
    results: list[ContinuationReply]
    weights_version: int = Field(description="the weights that computed it (update_weights_from_disk "
                                                 "increments it)")
    weight_version: str = Field(description="their name (SGLang's weight_version: the one the update gave, "
                                            "else weights_version as a string)")


class SequenceReply(BaseModel):
    model_config = _OPEN
    logprobs: list[Num]
    sum_logprob: Num
    is_greedy: list[bool]
    entropy: list[Num] | None = None
    top_k_ids: list[list[int]] | None = None
    top_k_logprobs: list[list[Num]] | None = None
    captures: list[dict[str, Any]] | None = None
    routed_experts: str | None = None


class LogprobsReply(BaseModel):
    model_config = _OPEN
    object: Literal["logprobs"]
    model: str
    temperature: float
    results: list[SequenceReply]
    weights_version: int = Field(description="the weights that computed it (update_weights_from_disk "
                                                 "increments it)")
    weight_version: str = Field(description="their name (SGLang's weight_version: the one the update gave, "
                                            "else weights_version as a string)")


class PerplexityReply(BaseModel):
    model_config = _OPEN
    object: Literal["perplexity"]
    model: str
    perplexity: Num
    perplexity_stderr: Num
    nll_mean: Num
    nll_stderr: Num
    num_tokens: int
    num_windows: int
    policy: str
    context_length: int
    stride: int | None
    word_perplexity: Num
    byte_perplexity: Num
    bits_per_byte: Num
    num_words: int | None
    num_bytes: int | None
    token_nlls: list[list[Num]] | None
    captures: list[list[dict[str, Any]]] | None
    weights_version: int = Field(description="the weights that computed it (update_weights_from_disk "
                                                 "increments it)")
    weight_version: str = Field(description="their name (SGLang's weight_version: the one the update gave, "
                                            "else weights_version as a string)")


class HealthReply(BaseModel):
    status: str
    model: str
    queue_requests: int
    queue_tokens: int
    weights_version: int = Field(description="the weights new requests are computed under")
    weight_version: str = Field(description="their name (SGLang's weight_version)")


class ReadyReply(BaseModel):
    status: str = Field(description='"ready", or "warming" (503) while the warm-up runs')
    model: str


class WeightVersionReply(BaseModel):
    weight_version: str = Field(description="the name of the weights new requests are computed under")
