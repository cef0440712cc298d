"""``logprobe serve``: the HTTP scoring server on uvicorn (a thin shell over ``server.create_app``)."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import sys

from ..executor.workers import freeze_heap
from ..server import ServerConfig, create_app


def add_serve_parser(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "serve", parents=[common], help="HTTP scoring server (OpenAI /v1/completions, tokenizer and native endpoints)",
        description="Serve the model over HTTP. Concurrent requests are scored in shared batches. Endpoints: "
                    "POST /v1/completions (echo + logprobs, max_tokens 0 or 1), GET /v1/models, GET /tokenizer_info, "
                    "POST /tokenize, POST /detokenize, POST /v1/score, POST /v1/logprobs, POST /v1/perplexity, "
                    "GET /health, GET /ready, GET /metrics, GET /docs (OpenAPI).",
        epilog="The key can also come from the LOGPROBE_API_KEY environment variable (keeps it out of `ps`).")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: the --model value)")
    s.add_argument("--max-queue-requests", type=int, default=256, metavar="N",
                   help="HTTP requests queued for the engine before 429 (default: %(default)s)")
    s.add_argument("--max-queue-tokens", type=int, default=1 << 21, metavar="N",
                   help="input tokens queued before 429 (default: %(default)s)")
    s.add_argument("--max-request-tokens", type=int, default=1 << 20, metavar="N",
                   help="input tokens one request may bring, else 413 (default: %(default)s)")
    s.add_argument("--max-request-items", type=int, default=4096, metavar="N",
                   help="prompts/continuations/sequences/texts per request, else 413 (default: %(default)s)")
    s.add_argument("--max-top-logprobs", type=int, default=100, metavar="K",
                   help="cap on /v1/completions 'logprobs' (default: %(default)s)")
    s.add_argument("--max-capture-floats", type=int, default=1 << 22, metavar="N",
                   help="numbers the 'capture' entries of one request may return, else 413 (default: %(default)s)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT: answer new requests 503, finish queued ones within S seconds, fail "
                        "the rest with 503, exit 0; a second signal exits at once (default: %(default)s)")
    s.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="a request body that stalls S seconds (no byte arrives) is answered 408 and its "
                        "connection closed (default: %(default)s)")
    s.add_argument("--weight-sync-timeout", type=float, default=300.0, metavar="S",
                   help="seconds one /update_weights_from_distributed may take receiving the trainer's "
                        "broadcasts; beyond it the weight update group is left and the reply is 400, the old "
                        "weights stay (default: %(default)s)")
    s.add_argument("--enable-return-routed-experts", action="store_true",
                   help="allow 'return_routed_experts' (mixture-of-experts models: each token's experts, "
                        "SGLang's R3 shape)")
    s.add_argument("--warmup", action="store_true",
                   help="compile and tune the model's kernels once the port is open, before scoring (as "
                        "`logprobe warmup`); GET /ready answers 503 'warming' until done, then 200")
    s.add_argument("--max-images-per-request", type=int, default=16, metavar="N",
                   help="images one request may carry (a model with a vision tower), else 400 (default: "
                        "%(default)s)")
    s.add_argument("--max-image-pixels", type=int, default=4096 * 4096, metavar="N",
                   help="width x height of one image, checked before it is decoded, else 400 (default: "
                        "%(default)s)")
    s.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s) image URLs (10 s timeout, 32 MiB each); without it they are refused and "
                        "images come inline as data: URLs")
    s.add_argument("--no-batching", action="store_true",
                   help="score one HTTP request at a time (for comparison; slower under concurrency)")
    s.add_argument("--switch-interval", type=float, default=0.0005, metavar="SECONDS",
                   help="the interpreter's switch interval while serving (default: %(default)s; Python's own is "
                        "0.005, which keeps the engine thread waiting on the HTTP work)")
    s.add_argument("--pipeline-steps", action="store_true",
                   help="while several requests wait, an engine step takes about half of the queued work, so "
                        "one step's answers travel while the next computes (default: a step takes all it can)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key or os.environ.get("LOGPROBE_API_KEY") or None,
        served_model_name=args.served_model_name or args.model, max_queue_requests=args.max_queue_requests,
        max_queue_tokens=args.max_queue_tokens, max_request_tokens=args.max_request_tokens,
        max_request_items=args.max_request_items, max_top_logprobs=args.max_top_logprobs,
        max_capture_floats=args.max_capture_floats, batching=not args.no_batching,
        pipeline_steps=args.pipeline_steps, switch_interval=args.switch_interval,
        shutdown_timeout=args.shutdown_timeout, body_timeout=args.body_timeout,
        enable_return_routed_experts=args.enable_return_routed_experts,
        weight_sync_timeout=args.weight_sync_timeout, warmup=args.warmup,
        max_images_per_request=args.max_images_per_request, max_image_pixels=args.max_image_pixels,
        allow_remote_images=args.allow_remote_images)
    if not _loopback(config.host) and config.api_key is None:
        print(f"logprobe: warning: serving on {config.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    scorer = args.make_scorer(args)
    app = create_app(scorer, config)
    frozen = freeze_heap()
    import uvicorn

    DrainingServer = _server_class()
    print(f"logprobe: serving {scorer.info.name} ({scorer.info.device}, {scorer.info.dtype}) on "
          f"http://{config.host}:{config.port} ({frozen} objects left out of garbage collection)",
          file=sys.stderr, flush=True)
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=10))
    server.run()
    return 0


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, with a graceful stop: the first SIGTERM/SIGINT drains the app (new requests 503,
        queued ones finished within --shutdown-timeout, the rest 503) while the port stays open,
        then uvicorn shuts down as usual (exit 0). A second signal: uvicorn's own immediate exit."""

        _draining = False
        _loop = None

        def handle_exit(self, sig, frame) -> None:
            lifecycle = getattr(getattr(self.config.app, "state", None), "lifecycle", None)
            if self._draining:  # a second signal: stop now
                self.should_exit = self.force_exit = True
                return
            if lifecycle is None or self._loop is None:
                self.should_exit = True
                return
            self._draining = True
            timeout = self.config.app.state.config.shutdown_timeout
            print(f"logprobe: shutting down: finishing queued requests (up to {timeout:g} s)", file=sys.stderr,
                  flush=True)

            async def drain() -> None:
                try:
                    failed = await lifecycle.drain(timeout)
                    if failed:
                        print(f"logprobe: {failed} requests not reached in {timeout:g} s answered 503",
                              file=sys.stderr, flush=True)
                finally:
                    self.should_exit = True

            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(drain()))

        async def serve(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

    return DrainingServer


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
