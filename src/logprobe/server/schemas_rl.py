"""Bodies and replies of the RL-framework endpoints: SGLang's ``/generate`` (scoring only) and
``/update_weights_from_disk``. Strict like ``schemas``: unknown fields are refused, strings are
``Text``. SGLang's own names and defaults are kept so that its clients' bodies pass unchanged.

Sampling options that would change the probabilities (``top_p``, ``top_k``, ``min_p``, penalties)
are accepted only at their neutral values: the log-probs returned are always the full-vocabulary
``log_softmax(logits / temperature)``; options that only steer generation (``stop``,
``skip_special_tokens``, ...) are accepted and have no effect, since nothing is generated.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..io.text import text_problem
from .schemas import Num, Text, _valid_text

_STRICT = ConfigDict(strict=True, extra="forbid")
_OPEN = ConfigDict(extra="allow")

_Ids = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
InputIdsSchema = _Ids | Annotated[list[_Ids], Field(min_length=1)]
TextSchema = Annotated[Text, Field(min_length=1)] | Annotated[list[Annotated[Text, Field(min_length=1)]],
                                                               Field(min_length=1)]


def _check_input_ids(value: Any) -> Any:
    """A list of token ids (one prompt) or a non-empty list of such lists (a batch)."""
    if value is None:
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty list of token ids or a non-empty list of token-id lists")
    if set(map(type, value)) == {int}:  # in C: no Python per id (the loops below name what is wrong)
        return value
    if all(isinstance(x, list) for x in value):
        for i, ids in enumerate(value):
            if not ids:
                raise ValueError(f"[{i}] is an empty list; give at least one token id")
            if set(map(type, ids)) == {int}:
                continue
            for j, x in enumerate(ids):
                if not isinstance(x, int) or isinstance(x, bool):
                    raise ValueError(f"[{i}][{j}] must be an integer token id, got {x!r}")
        return value
    raise ValueError("must be a list of token ids or a list of token-id lists (not a mixture)")


def _check_texts(value: Any) -> Any:
    if value is None:
        return value
    if isinstance(value, str):
        if not value:
            raise ValueError("is empty; give some text")
        return _valid_text(value)
    if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
        raise ValueError("must be a non-empty string or a non-empty list of strings")
    for i, x in enumerate(value):
        if not x:
            raise ValueError(f"[{i}] is empty; give some text")
        if (problem := text_problem(x)) is not None:
            raise ValueError(f"[{i}] {problem}; send UTF-8 text")
    return value


ImageDataSchema = Text | list[Text | list[Text] | None]


def _check_image_data(value: Any) -> Any:
    """SGLang's ``image_data``: an image (a string) or a list of them for one input; for a batch, a
    list with one entry per input (a string, a list of strings, or null). Shapes only: which
    strings are images is ``server.images``'s."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be an image (a data: URL or base64 string) or a list of them (a batch: one "
                         "entry per input)")
    for i, x in enumerate(value):
        if x is not None and not isinstance(x, (str, list)) or isinstance(x, list) \
                and not all(isinstance(y, str) for y in x):
            raise ValueError(f"[{i}] must be an image string, a list of image strings or null")
    return value


class SamplingParams(BaseModel):
    """SGLang's ``sampling_params``, for scoring: ``max_new_tokens`` 0 (or absent: this server only
    scores), ``temperature`` T: log-probs are ``log_softmax(logits / T)``; T below 1e-6 (0 included)
    means greedy in SGLang, which then uses T = 1, and so does this server."""

    model_config = _STRICT

    max_new_tokens: int | None = Field(None, description="0 or absent: score the input only; anything else is "
                                                         "refused (this server generates nothing)")
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False,
                               description="log_softmax(logits / temperature); below 1e-6 (greedy): 1")
    top_p: float = Field(1.0, description="must be 1 (the log-probs are over the full vocabulary)")
    top_k: int = Field(-1, description="must be -1 or 0 (no cut)")
    min_p: float = Field(0.0, description="must be 0")
    frequency_penalty: float = Field(0.0, description="must be 0")
    presence_penalty: float = Field(0.0, description="must be 0")
    repetition_penalty: float = Field(1.0, description="must be 1")
    n: int = Field(1, description="must be 1")
    min_new_tokens: int = Field(0, description="must be 0")
    stop: Text | list[Text] | None = Field(None, description="accepted; no effect (nothing is generated)")
    stop_token_ids: list[int] | None = Field(None, description="accepted; no effect")
    ignore_eos: bool = Field(False, description="accepted; no effect")
    skip_special_tokens: bool = Field(True, description="accepted; no effect")
    spaces_between_special_tokens: bool = Field(True, description="accepted; no effect")
    no_stop_trim: bool = Field(False, description="accepted; no effect")

    @field_validator("max_new_tokens")
    @classmethod
    def _no_generation(cls, v: int | None) -> int | None:
        """1 is refused too: SGLang would sample that token (at the given temperature, with its own
        random state), which a scoring server cannot reproduce; its input log-probs equal those of 0."""
        if v not in (None, 0):
            raise ValueError(f"is {v}; this server scores the input and generates nothing; send max_new_tokens 0 "
                             "(the input_token_logprobs are the same)")
        return v

    @field_validator("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "n",
                     "min_new_tokens")
    @classmethod
    def _neutral(cls, v: float, info) -> float:
        """Refuse what would reshape the distribution: the log-probs are the full-vocabulary ones."""
        want = cls.model_fields[info.field_name].default
        if v != want:
            raise ValueError(f"must be {want:g} here (the log-probs are the full-vocabulary "
                             "log_softmax(logits / temperature)); leave it out")
        return v

    @field_validator("top_k")
    @classmethod
    def _no_cut(cls, v: int) -> int:
        if v not in (-1, 0):
            raise ValueError("must be -1 or 0 here (the log-probs are over the full vocabulary); leave it out")
        return v


class GenerateRequest(BaseModel):
    """SGLang's ``POST /generate`` body, for scoring. One of ``input_ids`` / ``text``; a list of
    lists (texts) is a batch and gets a list of replies. ``return_logprob``, ``logprob_start_len``
    and ``top_logprobs_num`` are one value for all or a list, one per item; so is ``sampling_params``
    (one object for all, or a list of objects, one per item, as SGLang takes them)."""

    model_config = _STRICT

    input_ids: list[int] | list[list[int]] | None = Field(None, description="token ids, or a batch of them")
    text: Text | list[Text] | None = Field(None, description="a text or a batch of texts (tokenized as SGLang "
                                                           "does: with BOS when the tokenizer adds one)")
    sampling_params: SamplingParams | list[SamplingParams] | None = Field(
        None, description="one for the whole batch, or a list: one per item of a batch")
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = Field(-1, description="first input position returned (-1: the last "
                                                               "input token only, SGLang's default)")
    top_logprobs_num: int | list[int] = Field(0, description="alternatives per position (server cap applies)")
    return_text_in_logprobs: bool = Field(False, description="third element of each entry: the token's text")
    stream: bool = Field(False, description="must be false")
    rid: Text | list[Text] | None = Field(None, description="request id(s), echoed as meta_info.id")
    return_routed_experts: bool | list[bool] = Field(False, description="meta_info.routed_experts: base64 of "
                                                                        "int32 [len(input) - 1, num_hidden_layers, "
                                                                        "k], zeros in dense blocks, as SGLang "
                                                                        "(--enable-return-routed-experts)")

    image_data: Any = Field(None, description="a model with a vision tower: the input's images (data:image/...;"
                                              "base64 URLs or bare base64; http(s) with --allow-remote-images), the "
                                              "image token once per image in the input, or expanded; a batch: one "
                                              "entry per input (a string, a list, or null)")

    @field_validator("image_data", mode="plain", json_schema_input_type=ImageDataSchema | None)
    @classmethod
    def _images(cls, v: Any) -> Any:
        return _check_image_data(v)

    @field_validator("input_ids", mode="plain", json_schema_input_type=InputIdsSchema | None)
    @classmethod
    def _ids(cls, v: Any) -> Any:
        return _check_input_ids(v)

    @field_validator("text", mode="plain", json_schema_input_type=TextSchema | None)
    @classmethod
    def _text(cls, v: Any) -> Any:
        return _check_texts(v)

    @field_validator("stream")
    @classmethod
    def _whole(cls, v: bool) -> bool:
        if v:
            raise ValueError("is not supported (a scoring reply comes whole); set stream false")
        return v


class UpdateWeightsRequest(BaseModel):
    """SGLang's ``POST /update_weights_from_disk`` body."""

    model_config = _STRICT

    model_path: Annotated[Text, Field(min_length=1)] = Field(description="a local checkpoint of the same "
                                                                         "architecture (directory or file)")
    load_format: Text | None = Field(None, description="accepted: 'auto' or absent (the format is read from "
                                                       "the files)")
    abort_all_requests: bool = Field(False, description="must be false: requests under way are always finished "
                                                        "on the old weights, queued ones run on the new")
    weight_version: Text | None = Field(None, description="the new weights' name (SGLang's): replies' "
                                                          "meta_info.weight_version and GET /get_weight_version "
                                                          "give it; default: the new weights_version as a string")
    in_place: bool = Field(False, description="tensor-parallel servers: the workers copy in their slices as they "
                                              "come, no staged copy of the weights (a file found bad part way then "
                                              "leaves scoring answering 503 until an update completes)")

    @field_validator("load_format")
    @classmethod
    def _format(cls, v: str | None) -> str | None:
        if v not in (None, "auto"):
            raise ValueError(f"{v!r} is not supported; leave it out (the format is read from the files)")
        return v

    @field_validator("abort_all_requests")
    @classmethod
    def _no_abort(cls, v: bool) -> bool:
        if v:
            raise ValueError("is not supported: requests under way are finished on the old weights first; "
                             "leave it false")
        return v


# -- replies ----------------------------------------------------------------------------------

Entry = tuple[Num, int, str | None]  # [logprob (null for the first), token id, text or null]


class GenerateMetaInfo(BaseModel):
    model_config = _OPEN
    id: str
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    input_token_logprobs: list[Entry] | None = None
    output_token_logprobs: list[Entry] | None = None
    input_top_logprobs: list[list[Entry] | None] | None = None
    output_top_logprobs: list[list[Entry] | None] | None = None
    routed_experts: str | None = None


class GenerateReply(BaseModel):
    model_config = _OPEN
    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo
    weights_version: int


class UpdateWeightsReply(BaseModel):
    model_config = _OPEN
    success: bool
    message: str
    num_paused_requests: int
    weights_version: int
    weight_version: str


# -- weight sync over a collective (SGLang's init_weights_update_group / update_weights_from_distributed)

_GROUP = Field("weight_update_group", min_length=1, description="the process group's name (the trainer's "
                                                                "init_custom_process_group group_name)")


class InitWeightsUpdateGroupRequest(BaseModel):
    """SGLang's ``POST /init_weights_update_group`` body: join the trainer's process group (the
    trainer is rank 0 and hosts its store; this server is rank ``rank_offset``)."""

    model_config = _STRICT

    master_address: Annotated[Text, Field(min_length=1)] = Field(description="the trainer's host (rank 0's store)")
    master_port: int = Field(ge=1, le=65535, description="the port of the trainer's store")
    rank_offset: int = Field(ge=1, description="this server's rank in the group (1 .. world_size - 1)")
    world_size: int = Field(ge=2, description="the trainer plus every rank that receives")
    group_name: Text = _GROUP
    backend: Text = Field("nccl", description="'nccl' (the model on CUDA) or 'gloo'")
    in_place: bool = Field(False, description="write each bucket as it comes (no second copy of the weights: "
                                              "models that fill their GPUs); scoring answers 503 until an update "
                                              "completes. False: buckets held until every weight has come")

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v not in ("nccl", "gloo"):
            raise ValueError(f"{v!r} is not supported; use 'nccl' or 'gloo'")
        return v


class UpdateWeightsFromDistributedRequest(BaseModel):
    """SGLang's ``POST /update_weights_from_distributed`` body: the tensors the trainer then
    broadcasts from rank 0, in this order. Every weight of the model, as ``update_weights``."""

    model_config = _STRICT

    names: Annotated[list[Text], Field(min_length=1)] = Field(description="Hugging Face parameter names")
    dtypes: Annotated[list[Text], Field(min_length=1)] = Field(description="'bfloat16', 'float32', 'float16' "
                                                                          "(or 'torch.bfloat16' ...), one per name")
    shapes: Annotated[list[list[Annotated[int, Field(ge=0)]]], Field(min_length=1)] = Field(
        description="one shape per name")
    group_name: Text = _GROUP
    flush_cache: bool = Field(True, description="accepted: nothing computed under the old weights is reused")
    abort_all_requests: bool = Field(False, description="must be false: requests under way finish on the old "
                                                        "weights, queued ones run on the new")
    weight_version: Text | None = Field(None, description="the new weights' name (default: the new "
                                                          "weights_version as a string)")
    load_format: Text | None = Field(None, description="accepted: absent or 'auto'")
    torch_empty_cache: bool = Field(False, description="accepted; no effect")

    @field_validator("abort_all_requests")
    @classmethod
    def _no_abort(cls, v: bool) -> bool:
        return UpdateWeightsRequest._no_abort(v)

    @field_validator("load_format")
    @classmethod
    def _format(cls, v: str | None) -> str | None:
        if v not in (None, "auto"):
            raise ValueError(f"{v!r} is not supported; leave it out")
        return v


class DestroyWeightsUpdateGroupRequest(BaseModel):
    """SGLang's ``POST /destroy_weights_update_group`` body."""

    model_config = _STRICT

    group_name: Text = _GROUP


class WeightsGroupReply(BaseModel):
    """SGLang's reply of the group endpoints: ``success`` and ``message``."""

    model_config = _OPEN
    success: bool
    message: str


class UpdateWeightsFromDistributedReply(BaseModel):
    """SGLang's ``success`` and ``message``, with the version served after the call and the weights
    transformers holds as buffers that the applied update kept (none of them sent)."""

    model_config = _OPEN
    success: bool
    message: str
    weights_version: int
    weight_version: str
    kept_buffers: list[str] = Field(default_factory=list, description=(
        "the weights transformers holds as buffers (mlp.gate.e_score_correction_bias, Gemma 4's layer_scalar) "
        "that the applied update left as they were, none of them sent (named_parameters() lacks them), as a "
        "trainer names them; [] while a bucket is held or when they were sent"))
