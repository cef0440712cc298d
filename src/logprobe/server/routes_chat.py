"""``/v1/chat/completions`` for scoring a conversation's final assistant message (``chat_compat``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from .chat_compat import chat_completion_job
from .responses import replies, reply
from .schemas_chat import ChatCompletionReply, ChatCompletionRequest
from .served import Served


def chat_router(served: Served) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions", summary="Log-probs of the last (assistant) message under the chat template",
              responses=replies(ChatCompletionReply))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        served.check_model(body.model)
        served.check_items(len(body.messages), "messages")
        job = await run_in_threadpool(chat_completion_job, body, served.scorer, served.name,
                                      served.config.max_top_logprobs, served.config)
        out = await served.run(job, request)
        return out if isinstance(out, Response) else reply({**out[0], **served.versions(out[1])})

    return api
