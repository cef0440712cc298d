"""Routes for RL frameworks: SGLang's ``POST /generate`` (scoring: ``max_new_tokens`` 0) and
``POST /update_weights_from_disk``. ``create_app`` wires them; the jobs live in ``sglang_compat``
(``/generate``) and ``weights`` (the swap), the bodies in ``schemas_rl``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..errors import LogprobeError
from .batcher import JobFailed
from .responses import SafeJSONResponse, error_body, replies, reply
from .schemas_rl import (
    DestroyWeightsUpdateGroupRequest,
    GenerateReply,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedReply,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsReply,
    UpdateWeightsRequest,
    WeightsGroupReply,
)
from .served import INLINE_TOKENS, Served, off_loop
from .sglang_compat import batched, generate_job


def stamp(reply: dict, version: int, name: str | None = None) -> dict:
    """``weights_version`` (logprobe's) and ``meta_info.weight_version`` (SGLang's name, a string:
    the one the update gave, else ``str(version)``)."""
    reply["weights_version"] = version
    reply["meta_info"]["weight_version"] = str(version) if name is None else name
    return reply


def rl_router(served: Served, paused=None) -> APIRouter:
    """``paused``: an awaitable gate (``/pause_generation``) each ``/generate`` passes first."""
    scorer, config, run, weights = served.scorer, served.config, served.run, served.weights
    router = APIRouter()

    @router.post("/generate", summary="SGLang /generate for scoring: input_token_logprobs (max_new_tokens 0)",
                 responses=replies(GenerateReply | list[GenerateReply]))
    async def generate(body: GenerateRequest, request: Request):
        if paused is not None:
            await paused()
        if body.input_ids is not None and batched(body):
            served.check_items(len(body.input_ids), "input_ids")
        elif isinstance(body.text, list):
            served.check_items(len(body.text), "text")
        ids = body.input_ids  # token ids: no tokenizer to run, only as much work as there are ids
        work = INLINE_TOKENS if ids is None or body.image_data is not None \
            else sum(len(x) if isinstance(x, list) else 1 for x in ids)  # images: decoded in the thread pool
        job, owners = await off_loop(work, generate_job, body, scorer, config.max_top_logprobs,
                                     config.enable_return_routed_experts, config)
        try:
            out = await run(job, request)
        except JobFailed as e:  # name the body's item, not the engine request (items may need none)
            e.field = owners[e.index]
            raise
        if isinstance(out, Response):
            return out
        value, version = out
        name = weights.name(version)
        return reply([stamp(r, version, name) for r in value] if isinstance(value, list)
                     else stamp(value, version, name))

    @router.post("/flush_cache", summary="Empty the prefix cache (SGLang's flush_cache)", operation_id="flush_cache_post",
                 responses=replies(None, (401, 503)))
    @router.get("/flush_cache", summary="Empty the prefix cache (SGLang's flush_cache)", operation_id="flush_cache_get",
                responses=replies(None, (401, 503)))
    async def flush_cache():
        """Drops every cached prefix between engine steps (new weights do it by themselves); the
        counters stay. ``success`` is true also with the prefix cache off (nothing to drop)."""
        cache = scorer.prefix_cache
        if cache is not None:
            await asyncio.to_thread(weights.batcher.exclusive, cache.clear)
        return {"success": True, "message": "prefix cache flushed" if cache is not None else "no prefix cache"}

    @router.post("/update_weights_from_disk", summary="Load new weights (same architecture) between batches",
                 responses=replies(UpdateWeightsReply, (400, 401, 503)))
    async def update_weights_from_disk(body: UpdateWeightsRequest):
        """400 (with SGLang's ``success: false`` and ``message`` beside the error) when the path or
        the checkpoint is bad: the old weights stay in force."""
        before = weights.version
        try:
            version = await asyncio.to_thread(weights.load, body.model_path, body.weight_version, body.in_place)
        except LogprobeError as e:
            return SafeJSONResponse({**error_body(400, str(e), e.field, "invalid_value"), "success": False,
                                     "message": str(e), "num_paused_requests": 0}, status_code=400)
        return {"success": True, "message": f"loaded {body.model_path}: weights_version {before} -> {version}",
                "num_paused_requests": 0, "weights_version": version, "weight_version": weights.name(version)}

    def refused(e: LogprobeError) -> SafeJSONResponse:
        """400 with SGLang's ``success: false`` and ``message`` beside logprobe's error."""
        return SafeJSONResponse({**error_body(400, str(e), e.field, "invalid_value"), "success": False,
                                 "message": str(e)}, status_code=400)

    @router.post("/init_weights_update_group", summary="Join the trainer's process group (weights by broadcast)",
                 responses=replies(WeightsGroupReply, (400, 401, 503)))
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest):
        """Answers once every rank joined (the trainer, rank 0, joins as it sends this)."""
        try:
            await asyncio.to_thread(weights.join_group, body.master_address, body.master_port, body.rank_offset,
                                    body.world_size, body.group_name, body.backend, body.in_place)
        except LogprobeError as e:
            return refused(e)
        return {"success": True, "message": f"joined {body.group_name!r} as rank {body.rank_offset} of "
                                            f"{body.world_size} ({body.backend})"}

    @router.post("/update_weights_from_distributed", summary="Receive new weights by broadcast, apply between batches",
                 responses=replies(UpdateWeightsFromDistributedReply, (400, 401, 503)))
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest):
        """Receives every tensor (scoring goes on, on the old weights), then applies them all between
        engine steps once every weight has come (buckets: held until then). 400 (``success: false``)
        when the metadata or the tensors are refused: the old weights stay in force."""
        before = weights.version
        try:
            version, kept, written = await asyncio.to_thread(weights.update_from_group, body.names, body.dtypes,
                                                             body.shapes, body.group_name, body.weight_version)
        except LogprobeError as e:
            return refused(e)
        if version is None and written:  # an in-place group's bucket: written, the round not complete
            return {"success": True, "message": f"received {len(body.names)} tensors: written in place; scoring "
                                                f"answers 503 until every weight has come",
                    "weights_version": before, "weight_version": weights.name(before), "kept_buffers": []}
        if version is None:  # a bucket: the old weights are still served
            return {"success": True, "message": f"received {len(body.names)} tensors: held until every weight has "
                                                f"come; weights_version {before} is still served",
                    "weights_version": before, "weight_version": weights.name(before), "kept_buffers": []}
        return {"success": True, "message": f"received {len(body.names)} tensors: weights_version {before} -> "
                                            f"{version}" + (f"; {len(kept)} buffers kept (none sent)" if kept else ""),
                "weights_version": version, "weight_version": weights.name(version), "kept_buffers": list(kept)}

    @router.post("/destroy_weights_update_group", summary="Leave a weight update group",
                 responses=replies(WeightsGroupReply, (400, 401, 503)))
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupRequest):
        try:
            await asyncio.to_thread(weights.leave_group, body.group_name)
        except LogprobeError as e:
            return refused(e)
        return {"success": True, "message": f"left {body.group_name!r}"}

    return router
