"""SGLang's ``POST /pause_generation``, ``POST /continue_generation`` and ``GET /get_load``, as RL
weight-sync clients (torchrl's SGLang scheme) call them around a weight update.

While paused, ``/generate`` requests wait (they are neither refused nor lost) and run once
``/continue_generation`` comes; scoring already in the engine finishes on the weights it began
with (a scoring step has no partial generation to retract or keep in place), so every mode
(``abort``, ``retract``, ``in_place``) behaves the same here. Weight updates work while paused.
``/get_load`` answers SGLang's shape: one dict per data-parallel rank (here one).
"""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from .responses import replies
from .served import Served

MODES = ("abort", "retract", "in_place")


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "retract", "in_place"] = "abort"


class Pause:
    """Open unless paused; ``wait`` holds a request until it is open."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.waiting = 0
        self.mode: str | None = None

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def wait(self) -> None:
        if self._open.is_set():
            return
        self.waiting += 1
        try:
            await self._open.wait()
        finally:
            self.waiting -= 1

    def pause(self, mode: str) -> None:
        self.mode = mode
        self._open.clear()

    def resume(self) -> None:
        self.mode = None
        self._open.set()


def pause_router(served: Served, pause: Pause) -> APIRouter:
    router = APIRouter()

    @router.post("/pause_generation", summary="Hold new /generate requests until /continue_generation",
                 responses=replies(None, (400, 401)))
    async def pause_generation(body: PauseRequest | None = None):
        mode = body.mode if body is not None else "abort"
        pause.pause(mode)
        return {"success": True, "message": f"paused ({mode}): new requests wait for /continue_generation"}

    @router.post("/continue_generation", summary="Run the requests held by /pause_generation",
                 responses=replies(None, (401,)))
    async def continue_generation():
        pause.resume()
        return {"success": True, "message": "resumed"}

    @router.get("/get_load", summary="SGLang's load: one dict per data-parallel rank",
                responses=replies(None, (401,)))
    async def get_load():
        jobs, tokens = served.batcher.queue_depth
        return [{"dp_rank": 0, "num_running_reqs": jobs, "num_waiting_reqs": pause.waiting,
                 "num_tokens": tokens, "num_reqs": jobs + pause.waiting, "paused": pause.paused}]

    return router
