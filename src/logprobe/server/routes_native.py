"""logprobe's own scoring routes: ``/v1/score``, ``/v1/logprobs``, ``/v1/perplexity`` (the
``Scorer`` methods over HTTP, with ``capture``/``steer`` and a per-request ``timeout``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ..errors import LogprobeError
from ..scoring.sequences import encode_routed_experts
from .images import ImageBudget, read_images, renamed_job, sequence_images
from .responses import NATIVE_CODES, replies, reply
from .schemas import LogprobsBody, LogprobsReply, PerplexityBody, PerplexityReply, ScoreBody, ScoreReply
from .served import Served


def routed_base64(r) -> dict:
    """A sequence's reply: ``routed_experts`` as SGLang's base64 of int32 (not nested lists)."""
    d = r.to_dict()
    if r.routed_experts is not None:
        d["routed_experts"] = encode_routed_experts(r.routed_experts)
    return d


def native_router(served: Served) -> APIRouter:
    scorer, name = served.scorer, served.name
    check_model, check_items, check_top_k, run = served.check_model, served.check_items, served.check_top_k, served.run
    api = APIRouter()

    @api.post("/v1/score", summary="log p(continuation | prompt) for each continuation",
              responses=replies(ScoreReply, NATIVE_CODES))
    async def score(body: ScoreBody, request: Request):
        check_model(body.model)
        check_items(len(body.continuations), "continuations")
        check_top_k(body.top_k)
        images = None
        if body.images is not None:  # read off the loop: decoding, fetching
            images = await run_in_threadpool(read_images, body.images, "images", scorer.context,
                                             ImageBudget(served.config))
        job = await run_in_threadpool(lambda: scorer.score_job(body.prompt, body.continuations,
                                                               temperature=body.temperature, top_k=body.top_k,
                                                               entropy=body.entropy, **body.hook_args(),
                                                               images=images))
        out = await run(job, request, body.timeout)
        if isinstance(out, Response):
            return out
        results, version = out
        return reply({"object": "score", "model": name, "prompt": body.prompt,
                      "results": [r.to_dict() for r in results], **served.versions(version)})

    @api.post("/v1/logprobs", summary="Per-token log-probs of completions (RL), any temperature",
              responses=replies(LogprobsReply, NATIVE_CODES))
    async def logprobs(body: LogprobsBody, request: Request):
        check_model(body.model)
        check_items(len(body.sequences), "sequences")
        check_top_k(body.top_k)
        seqs = [s.model_dump(exclude_none=True) for s in body.sequences]
        renames: list = []
        if any("images" in s or "multi_modal_data" in s for s in seqs):  # read off the loop: decoding, fetching
            seqs, renames = await run_in_threadpool(sequence_images, seqs, scorer.context, ImageBudget(served.config))
        if body.return_routed_experts and not served.config.enable_return_routed_experts:
            raise LogprobeError("return_routed_experts", "is off on this server",
                                "start it with --enable-return-routed-experts")
        job = await run_in_threadpool(lambda: renamed_job(renames, lambda: scorer.logprobs_job(
            seqs, body.temperature, body.top_k, body.entropy, **body.hook_args(),
            return_routed_experts=body.return_routed_experts)))
        out = await run(job, request, body.timeout)
        if isinstance(out, Response):
            return out
        results, version = out
        return reply({"object": "logprobs", "model": name, "temperature": body.temperature,
                      "results": [routed_base64(r) for r in results], **served.versions(version)})

    @api.post("/v1/perplexity", summary="Perplexity of texts or token ids over sliding windows",
              responses=replies(PerplexityReply, NATIVE_CODES))
    async def perplexity(body: PerplexityBody, request: Request):
        check_model(body.model)
        if isinstance(body.texts, list) and body.texts and not isinstance(body.texts[0], int):
            check_items(len(body.texts), "texts")
        job = await run_in_threadpool(lambda: scorer.perplexity_job(
            body.texts, context_length=body.context_length, stride=body.stride, policy=body.policy,
            prefix=body.prefix, max_tokens=body.max_tokens, return_token_nlls=body.return_token_nlls,
            **body.hook_args()))
        out = await run(job, request, body.timeout)
        if isinstance(out, Response):
            return out
        return reply({"object": "perplexity", "model": name, **out[0].to_dict(), **served.versions(out[1])})

    return api
