"""OpenAI/vLLM routes: ``/v1/completions`` for scoring (``openai_compat``), ``/v1/models`` and the
vLLM tokenizer endpoints lm-evaluation-harness looks for (``/tokenizer_info``, ``/tokenize``,
``/detokenize``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from .openai_compat import completion_job
from .responses import replies, reply
from .schemas import (
    CompletionReply,
    CompletionRequest,
    DetokenizeReply,
    DetokenizeRequest,
    ModelCard,
    ModelsReply,
    TokenizeReply,
    TokenizeRequest,
    TokenizerInfoReply,
)
from .served import Served


def openai_router(served: Served) -> APIRouter:
    scorer, config, name = served.scorer, served.config, served.name
    check_model, check_items, run = served.check_model, served.check_items, served.run
    tok = scorer.tokenizer
    api = APIRouter()

    # -- OpenAI-compatible -----------------------------------------------------------------------

    @api.post("/v1/completions", summary="Prompt log-probs (echo) and at most one greedy token",
              responses=replies(CompletionReply))
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
            check_items(len(body.prompt), "prompt")
        job = await run_in_threadpool(completion_job, body, scorer, name, config.max_top_logprobs)
        out = await run(job, request)
        return out if isinstance(out, Response) else reply({**out[0], **served.versions(out[1])})

    def card() -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "logprobe", "root": scorer.info.path,
                "max_model_len": scorer.info.max_length}

    @api.get("/v1/models", responses=replies(ModelsReply, (401,)))
    async def models():
        return {"object": "list", "data": [card()]}

    @api.get("/v1/models/{model:path}", responses=replies(ModelCard, (401, 404)))
    async def model(model: str):
        """OpenAI's ``models.retrieve``: the served model's card (any name ``model`` accepts), else 404."""
        check_model(model)
        return card()

    # -- tokenizer (the vLLM endpoints lm-evaluation-harness looks for) ---------------------------

    @api.get("/tokenizer_info", responses=replies(TokenizerInfoReply, (401,)))
    async def tokenizer_info():
        hf = tok.hf
        return {"tokenizer_class": type(hf).__name__, "bos_token": hf.bos_token, "eos_token": hf.eos_token,
                "pad_token": hf.pad_token, "unk_token": hf.unk_token, "add_bos_token": tok.add_bos,
                "model_max_length": scorer.info.max_length, "vocab_size": scorer.info.vocab_size,
                "chat_template": getattr(hf, "chat_template", None)}

    @api.post("/tokenize", responses=replies(TokenizeReply, (400, 401, 404, 413)))
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        ids = await run_in_threadpool(tok.encode, body.prompt)
        if body.add_special_tokens and tok.add_bos:
            ids = [tok.bos_id] + ids
        out = {"count": len(ids), "max_model_len": scorer.info.max_length, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tok.token_texts(ids) if ids else []
        return out

    @api.post("/detokenize", responses=replies(DetokenizeReply, (400, 401, 404, 413)))
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        ids = scorer.context.check_ids(body.tokens, "tokens")
        return {"prompt": await run_in_threadpool(tok.decode, ids)}

    return api
