"""How the server answers: the JSON response class, the error body and the OpenAPI ``responses``
of a route (shared by ``app`` and the protocol route modules, so none imports ``app``)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from ..io.jsonsafe import encode
from .schemas import ErrorReply


class SafeJSONResponse(JSONResponse):
    """Every JSON reply: non-finite numbers become null (with a ``<key>_reason``), never NaN/Infinity."""

    def render(self, content) -> bytes:
        return encode(content)


def reply(content) -> SafeJSONResponse:
    """A scoring route's answer, already a Response: FastAPI then skips ``jsonable_encoder``, which
    walks every float of a reply in Python (60% of the serving thread's time on ``/v1/logprobs``
    in a CPU profile; docs/perf.md) before ``io.jsonsafe`` encodes it anyway."""
    return SafeJSONResponse(content)


ERRORS = {
    400: "a field is invalid: the message names it and the fix",
    401: "the bearer key is missing or wrong",
    404: "the model is not served here",
    408: "the request's 'timeout' passed before it was started; nothing was computed",
    413: "the body, the input tokens, the items or the captured numbers of one request exceed a limit, "
         "or one of its sequences does not fit in the server's memory even alone",
    429: "the queue is full; retry after Retry-After seconds",
    503: "out of memory, shutting down, or the weights being replaced in place; retry after Retry-After seconds",
}
DEFAULT_CODES = (400, 401, 404, 413, 429, 503)
NATIVE_CODES = (400, 401, 404, 408, 413, 429, 503)  # the endpoints with a 'timeout'


def replies(model: type | None = None, codes=DEFAULT_CODES) -> dict:
    """OpenAPI ``responses`` of a route: its 200 body and the error bodies it may answer."""
    out = {code: {"model": ErrorReply, "description": ERRORS[code]} for code in codes}
    if model is not None:
        out[200] = {"model": model, "description": "the result"}
    return out


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return SafeJSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)
