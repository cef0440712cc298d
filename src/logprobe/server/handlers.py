"""The app's error handlers (every error a JSON body naming the field; see ``app``) and its
OpenAPI document without FastAPI's 422s."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.delivery import RequestOutOfMemory
from ..errors import LogprobeError, WeightsUnavailable
from .batcher import JobFailed, JobTimeout, QueueFull, ServerClosed
from .responses import error_response
from .schemas import (
    CompletionRequest,
    DetokenizeRequest,
    LogprobsBody,
    PerplexityBody,
    ScoreBody,
    TokenizeRequest,
)
from .schemas_chat import ChatCompletionRequest
from .schemas_rl import GenerateRequest, UpdateWeightsRequest
from .served import ModelNotFound, RequestTooLarge
from .validation import parse_failure, validation_message

log = logging.getLogger("logprobe.server")
# FastAPI's whole answer when its JSON parser raises anything but a syntax error (``parse_failure``)
PARSE_ERROR = "There was an error parsing the body"
# the body model of each route, for naming the field of a validation error
BODIES = {"/v1/completions": CompletionRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
          "/v1/score": ScoreBody, "/v1/logprobs": LogprobsBody, "/v1/perplexity": PerplexityBody,
          "/generate": GenerateRequest, "/update_weights_from_disk": UpdateWeightsRequest,
          "/v1/chat/completions": ChatCompletionRequest}


def openapi_without_422(fastapi_openapi):
    """FastAPI's document, less the 422 it adds to every body route: bad bodies answer 400."""

    def openapi() -> dict:
        doc = fastapi_openapi()
        for ops in doc.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(unused, None)
        return doc

    return openapi


def _unavailable(e: WeightsUnavailable):
    """503: the weights are being written in place, or were left part old, part new (a server state,
    not the request's fault); the client retries."""
    return error_response(503, str(e), e.field, "weights_unavailable", {"Retry-After": "5"})


def install_error_handlers(app: FastAPI) -> None:
    """Each exception type to its status: 400 bad values, 404 unknown model, 408 not started in
    time, 413 too large (body, request or memory), 429 queue full, 503 shutting down or out of
    memory, 500 only for a fault of the server's own."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        field, message = validation_message(list(exc.errors()), BODIES.get(request.url.path), exc.body)
        ctype = request.headers.get("content-type", "")
        if field == "body" and "json" not in ctype:
            message += f" (the request was sent as {ctype or 'no content type'}: send Content-Type: application/json)"
        return error_response(400, message, field, "invalid_value")

    @app.exception_handler(LogprobeError)
    async def _logprobe_error(request: Request, exc: LogprobeError):
        if isinstance(exc, WeightsUnavailable):
            return _unavailable(exc)
        if isinstance(exc, ModelNotFound):
            return error_response(404, str(exc), exc.field, "model_not_found")
        return error_response(400, str(exc), exc.field, "invalid_value")

    @app.exception_handler(RequestTooLarge)
    async def _too_large(request: Request, exc: RequestTooLarge):
        return error_response(413, str(exc), exc.field, "request_too_large")

    @app.exception_handler(QueueFull)
    async def _queue_full(request: Request, exc: QueueFull):
        return error_response(429, f"server busy: {exc.reason}; retry after {exc.retry_after} s", None,
                              "queue_full", {"Retry-After": str(exc.retry_after)})

    @app.exception_handler(JobTimeout)
    async def _timeout(request: Request, exc: JobTimeout):
        return error_response(408, str(exc), "timeout", "timeout")

    @app.exception_handler(JobFailed)
    async def _job_failed(request: Request, exc: JobFailed):
        e = exc.error
        if isinstance(e, RequestOutOfMemory):
            have = f"at most about {e.fits} tokens have fit in one pass" if e.fits else "no pass has fit yet"
            # the job's requests are the body's items, in order (perplexity: its windows)
            items = {"/v1/score": "continuations", "/v1/logprobs": "sequences"}.get(request.url.path)
            field = exc.field or (f"{items}[{exc.index}]" if items else "texts" if request.url.path == "/v1/perplexity"
                                  else "prompt")
            what = f"window {exc.index} of this request has " if field == "texts" else ""
            return error_response(413, f"{field}: {what}{e.tokens} input tokens do not fit in the server's memory "
                                  f"even alone (out of memory at {e.context} tokens; {have}); send shorter inputs",
                                  field, "out_of_memory")
        if isinstance(e, WeightsUnavailable):
            return _unavailable(e)
        if isinstance(e, LogprobeError):
            return error_response(400, str(e), e.field, "invalid_value")
        log.error("request failed in the engine: %r", e)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error")

    @app.exception_handler(ServerClosed)
    async def _closed(request: Request, exc: ServerClosed):
        return error_response(503, f"{exc}; retry later", None, "shutting_down", {"Retry-After": "5"})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.detail == PARSE_ERROR:  # not UTF-8, nested too deep, ...
            messages = request.scope.get("logprobe.body")  # the body as the Gate read it
            body = b"".join(m.get("body", b"") for m in messages) if messages is not None else None
            return error_response(400, parse_failure(exc.__cause__, body), "body", "invalid_value")
        message = {404: f"{request.url.path}: no such endpoint; see /docs for the list",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, message, None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return error_response(503, "out of memory on the server; send fewer tokens per request or retry",
                                  None, "out_of_memory", {"Retry-After": "5"})
        log.exception("unexpected error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error")
