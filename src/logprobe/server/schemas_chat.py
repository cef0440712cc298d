"""``/v1/chat/completions`` bodies (``routes_chat``): strict like ``schemas`` (unknown fields refused,
strings checked), the reply documented for the OpenAPI schema."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from .schemas import _OPEN, _STRICT, Num, PromptLogprob, Text, Usage


class ContentPart(BaseModel):
    """An OpenAI content part: ``{"type": "text", "text": ...}`` is scored as text (parts joined by
    newlines); ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` stands
    in the prompt on a model with a vision tower (``server.images``: inline data, or http(s) with
    ``--allow-remote-images``); audio and file parts, and images on a text-only model, are refused
    by name, so their other fields are let through to be named, not checked."""

    model_config = _OPEN
    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Text
    content: Text | list[ContentPart] = Field(description="a string, or OpenAI content parts (text; image_url on a "
                                                                "model with a vision tower)")
    name: Text | None = None


class ChatCompletionRequest(BaseModel):
    """OpenAI ``/v1/chat/completions``, for scoring the final assistant message (vLLM's prompt-logprob
    chat request): ``max_tokens`` 0, and ``echo`` + ``logprobs`` and/or ``prompt_logprobs``."""

    model_config = _STRICT

    messages: list[ChatMessage] = Field(description="the conversation; the last message (the assistant's) is scored")
    model: Text | None = None
    max_tokens: int | None = Field(None, description="must be 0: this server scores, it does not generate")
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name of max_tokens; must be 0")
    echo: bool = Field(False, description="vLLM's: the reply's message is the last message; with logprobs, "
                                          "choices[0].logprobs.content holds its tokens' log-probs")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, description="alternatives per scored token (server cap applies)")
    prompt_logprobs: int | None = Field(None, ge=0, description="vLLM's: the reply's prompt_logprobs, one entry per "
                                                               "token of the templated conversation")
    add_generation_prompt: bool = Field(False, description="vLLM's; must be false: the last message is scored, "
                                                           "nothing is generated after it")
    continue_final_message: bool = Field(False, description="vLLM's; must be false (the message is scored whole, "
                                                            "with its end-of-turn marker)")
    n: int = 1
    stream: bool = False
    user: Text | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: Num
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatReplyMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    model_config = _OPEN
    index: int
    message: ChatReplyMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class ChatCompletionReply(BaseModel):
    model_config = _OPEN
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="vLLM's, when asked for: null, then {token id: {logprob, rank, decoded_token}} per token "
                          "of the templated conversation")
    usage: Usage
    weights_version: int = Field(description="the weights that computed it (update_weights_from_disk increments it)")
    weight_version: str = Field(description="their name (SGLang's weight_version)")
