"""The ASGI app (FastAPI on uvicorn): thin handlers over ``Scorer`` jobs and the shared ``Batcher``.
``create_app`` wires the OpenAI/vLLM routes of ``routes_openai``, the native routes of
``routes_native`` and the RL routes of ``routes_rl`` (SGLang's ``/generate`` and
``/update_weights_from_disk``); every scoring reply says the ``weights_version`` that computed it.

Every error is JSON ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape) with a
4xx status naming the field and the fix; 429 and 503 carry ``Retry-After``. Faults (issue 23): a
request that does not fit in memory even alone answers 413 (its neighbours in the batch are
answered as usual); a client that disconnects costs no forward pass after the one under way
(``logprobe_requests_dropped_total{reason="disconnected"}``); the native endpoints take an optional
``timeout`` (408 when not answered by then, its work stopped the same way); a body is read whole
by the ``Gate`` (413 over the limit, chunked or not; 408 when it stalls ``body_timeout`` s); ``drain`` (SIGTERM via ``logprobe serve``, or the
lifespan's end) answers new requests 503 and finishes queued ones within ``shutdown_timeout``. Every JSON reply goes
through ``io.jsonsafe`` (``SafeJSONResponse``): no NaN or Infinity, always valid UTF-8. The OpenAPI
document (``/openapi.json``) states each reply's shape, errors included; ``tests/test_server_fuzz.py``
fuzzes the app from it.
"""

from __future__ import annotations

import asyncio
import hmac
import sys
import threading
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.responses import PlainTextResponse, Response
from fastapi.routing import APIRoute

from .. import __version__
from ..scorer import Scorer
from .batcher import Batcher, engine_call
from .config import ServerConfig
from .handlers import install_error_handlers, openapi_without_422
from .metrics import Metrics
from .responses import SafeJSONResponse, error_response, replies
from .routes_chat import chat_router
from .routes_native import native_router
from .routes_openai import openai_router
from .routes_pause import Pause, pause_router
from .routes_rl import rl_router
from .schemas import HealthReply, ReadyReply, WeightVersionReply
from .served import Served
from .weights import ServedWeights

OPEN_PATHS = {"/health", "/ready"}  # reachable without the API key (load balancers, probes)
NO_HEAD = {"/flush_cache"}  # GET routes with an effect: a HEAD probe must not empty the prefix cache


def add_head_routes(app: FastAPI, routes: list) -> None:
    """HEAD on each GET route of ``routes`` (but ``NO_HEAD``), answered as its GET: the same status
    and headers, no body (uvicorn sends none to a HEAD). Load balancers probe ``/health`` with
    HEAD; FastAPI's routes answer only the methods they name (405). Kept out of the OpenAPI
    document, which lists each operation once."""
    for route in routes:
        if isinstance(route, APIRoute) and "GET" in route.methods and route.path not in NO_HEAD:
            app.add_api_route(route.path, route.endpoint, methods=["HEAD"], name=f"{route.name}_head",
                              response_class=route.response_class, include_in_schema=False)


class Gate:
    """Pure ASGI middleware: API key, the body (read whole: size limit, stall timeout), request metrics."""

    def __init__(self, app, config: ServerConfig, metrics: Metrics, routes: set[str], lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.config = config
        self.metrics = metrics
        self.routes = routes
        self.key = f"Bearer {config.api_key}".encode() if config.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.routes else "other"
        t0 = time.perf_counter()
        status = {"code": 500}

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.lifecycle.draining and path != "/metrics":  # stop accepting: new requests 503
                resp = error_response(503, "the server is shutting down and takes no new requests; retry on "
                                      "another replica or after Retry-After seconds", None, "shutting_down",
                                      {"Retry-After": "5", "Connection": "close"})
                return await resp(scope, receive, send_wrapped)
            headers = dict(scope.get("headers") or [])
            if self.key is not None and path not in OPEN_PATHS:
                given = headers.get(b"authorization", b"")
                if not hmac.compare_digest(given, self.key):
                    problem = "is missing" if not given else "is wrong"
                    resp = error_response(401, f"Authorization: the bearer key {problem}; send the header "
                                          "'Authorization: Bearer <key>' with the key the server was started "
                                          "with", "Authorization", "invalid_api_key",
                                          {"WWW-Authenticate": "Bearer"})
                    return await resp(scope, receive, send_wrapped)
            limit = self.config.max_body_bytes
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                await self.drain(receive, 0)  # read before answering: closing on unread bytes resets it
                resp = error_response(413, f"body: {int(length)} bytes exceed the limit of {limit}; send less "
                                      "per request", "body", "body_too_large", {"Connection": "close"})
                return await resp(scope, receive, send_wrapped)
            messages, refusal = await self.read_body(receive)
            if refusal is not None:
                return await refusal(scope, receive, send_wrapped)
            if messages is None:  # the client went away while sending
                status["code"] = 499
                return None
            scope["logprobe.body"] = messages  # for the error of a body the JSON parser cannot read
            replay = iter(messages)

            async def receive_read():
                message = next(replay, None)
                return message if message is not None else await receive()

            await self.app(scope, receive_read, send_wrapped)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)


    async def read_body(self, receive) -> tuple[list[dict] | None, Response | None]:
        """The body's messages, read whole before any route sees them (a chunked body has no
        length to check up front), or the refusal: 413 past ``max_body_bytes`` (the rest read and
        dropped first), 408 when no byte arrives for ``body_timeout`` s. (None, None): the client
        went away."""
        limit, wait = self.config.max_body_bytes, self.config.body_timeout
        messages: list[dict] = []
        received = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:
                return None, error_response(408, f"body: no byte arrived for {wait:g} s after {received} bytes of "
                                            "the request body; send the whole body (Content-Length must match "
                                            "it)", "body", "body_timeout", {"Connection": "close"})
            if message["type"] != "http.request":
                return None, None
            received += len(message.get("body", b""))
            if received > limit:
                await self.drain(receive, received)
                return None, error_response(413, f"body: more than {received} bytes (sent without a "
                                            f"length) exceed the limit of {limit}; send less per request", "body", "body_too_large", {"Connection": "close"})
            messages.append(message)
            if not message.get("more_body", False):
                return messages, None

    async def drain(self, receive, received: int) -> None:
        """Read and drop the rest of a refused body (up to twice ``max_body_bytes`` in all, while it
        keeps coming), so that the client, still sending, reads the answer instead of a reset."""
        while received <= 2 * self.config.max_body_bytes:
            try:
                message = await asyncio.wait_for(receive(), min(self.config.body_timeout, 5.0))
            except asyncio.TimeoutError:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            received += len(message.get("body", b""))


class Lifecycle:
    """Shutdown state: ``drain(timeout)`` once; the Gate answers 503 while draining."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self.draining = False
        self._drained: asyncio.Task | None = None

    async def drain(self, timeout: float) -> int:
        """Take no new requests; finish the queued ones within ``timeout`` s, fail the rest (503).
        Returns how many were failed; a second call waits for the first."""
        self.draining = True
        if self._drained is None:
            self._drained = asyncio.ensure_future(asyncio.to_thread(self.batcher.drain, timeout))
        return await asyncio.shield(self._drained)


class Readiness:
    """Whether the server is ready: at once, or once ``Scorer.warmup`` has run (``start``: in a
    thread, inside ``Batcher.exclusive``, so that requests that come meanwhile wait for it). A
    warm-up that fails is logged and the server serves anyway (it only costs the first requests
    their compile time)."""

    def __init__(self, scorer: Scorer, batcher: Batcher, warmup: bool) -> None:
        self.scorer, self.batcher = scorer, batcher
        self.status = "warming" if warmup else "ready"
        self.report: dict | None = None

    def start(self) -> None:
        if self.status == "warming":
            threading.Thread(target=self._run, name="logprobe-warmup", daemon=True).start()

    def _run(self) -> None:
        try:
            self.batcher.exclusive(self._warm)
        except Exception as e:  # noqa: BLE001 (any failure: serve unwarmed, say why)
            print(f"logprobe: warm-up failed ({type(e).__name__}: {e}); serving without it", file=sys.stderr,
                  flush=True)
        self.status = "ready"

    def _warm(self) -> None:
        self.report = self.scorer.warmup()
        print(f"logprobe: warm-up done in {self.report['seconds']:.2f} s ({self.report['tuned']} kernel choices "
              "recorded)", file=sys.stderr, flush=True)


def create_app(scorer: Scorer, config: ServerConfig | None = None, model_name: str | None = None) -> FastAPI:
    """The app serving ``scorer``; its engine thread starts and stops with the app (lifespan)."""
    config = config or ServerConfig()
    name = config.served_model_name or model_name or scorer.info.name
    metrics = Metrics(scorer.executor)

    batcher = Batcher(engine_call(scorer.executor), scorer.config.max_batch_tokens, config.max_queue_requests,
                      config.max_queue_tokens, config.batching, metrics.observe_step,
                      lambda reason: metrics.dropped.labels(reason).inc(),
                      lambda tokens, limit: scorer.prefix_cache.peek(tokens, limit) if scorer.prefix_cache is not None else 0,
                      config.pipeline_steps)
    metrics.watch(batcher)
    lifecycle = Lifecycle(batcher)
    weights = ServedWeights(scorer, batcher, config.weight_sync_timeout)
    readiness = Readiness(scorer, batcher, config.warmup)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        switch = sys.getswitchinterval()
        if config.switch_interval is not None:  # see ServerConfig.switch_interval
            sys.setswitchinterval(config.switch_interval)
        batcher.start()
        readiness.start()
        try:
            yield
            await lifecycle.drain(config.shutdown_timeout)  # a no-op when `logprobe serve` drained on SIGTERM
            batcher.close()
        finally:
            sys.setswitchinterval(switch)

    app = FastAPI(title="logprobe", version=__version__, lifespan=lifespan, default_response_class=SafeJSONResponse,
                  description="Exact log-probabilities of given text: OpenAI-compatible scoring, tokenizer "
                              "endpoints and native scoring endpoints.")
    app.openapi = openapi_without_422(app.openapi)
    app.state.scorer, app.state.batcher, app.state.config, app.state.metrics = scorer, batcher, config, metrics
    app.state.lifecycle = lifecycle

    install_error_handlers(app)
    served = Served(scorer, config, name, batcher, weights)
    pause = Pause()  # SGLang's pause_generation: /generate waits while it is closed
    ops = APIRouter()

    # -- operations ------------------------------------------------------------------------------

    @app.get("/health", responses=replies(HealthReply, (503,)))  # 503: shutting down
    async def health():
        """Liveness: 200 while the process serves ("warming" during ``--warmup``, then "ok")."""
        jobs, tokens = batcher.queue_depth
        return {"status": "ok" if readiness.status == "ready" else readiness.status, "model": name, "queue_requests": jobs, "queue_tokens": tokens,
                "weights_version": weights.version, "weight_version": weights.weight_version}

    @app.get("/ready", responses=replies(ReadyReply, (503,)))
    async def ready():
        """Readiness (a load balancer's probe): 503 "warming" while ``--warmup`` runs, then 200."""
        body = {"status": readiness.status, "model": name}
        return body if readiness.status == "ready" else SafeJSONResponse(body, status_code=503)

    @app.get("/get_weight_version", responses=replies(WeightVersionReply, (401,)))
    async def get_weight_version():
        """SGLang's: the name of the weights new requests are computed under."""
        return {"weight_version": weights.weight_version}

    @ops.get("/metrics", response_class=PlainTextResponse, responses=replies(None, (401,)))
    async def prometheus():
        jobs, tokens = batcher.queue_depth
        metrics.queue_jobs.set(jobs)
        metrics.queue_tokens.set(tokens)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    routers = [openai_router(served), chat_router(served), native_router(served), rl_router(served, pause.wait), pause_router(served, pause), ops]
    for router in routers:
        app.include_router(router)
    add_head_routes(app, [*app.routes, *(r for x in routers for r in x.routes)])
    routes = {getattr(r, "path", "") for r in [*app.routes, *(r for x in routers for r in x.routes)]} - {""}
    app.add_middleware(Gate, config=config, metrics=metrics, routes=routes, lifecycle=lifecycle)
    return app
