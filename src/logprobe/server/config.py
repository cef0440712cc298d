"""Server limits and options, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LogprobeError, check_positive_ints


@dataclass(slots=True)
class ServerConfig:
    """How the server listens and what it accepts.

    host: loopback by default; binding elsewhere is an explicit choice (``--host 0.0.0.0``).
    api_key: when set, every endpoint but ``/health`` needs ``Authorization: Bearer <key>``.
    served_model_name: the ``model`` name clients send (``/v1/models`` lists it); None = the model spec.
    max_queue_requests / max_queue_tokens: the engine queue; beyond either a request gets 429
        with ``Retry-After`` (the server is busy, not broken).
    max_request_tokens: input tokens one HTTP request may bring (after windowing), else 413.
    max_request_items: prompts / continuations / sequences / texts per request, else 413.
    max_top_logprobs: cap on ``logprobs`` (top-k alternatives per position) over HTTP, else 400;
        the scored token is always returned whatever the cap.
    max_body_bytes: request bodies beyond this get 413 before they are parsed.
    max_capture_floats: numbers the ``capture`` entries of one request may return, else 413.
    batching: False runs one HTTP request's work per engine step (for comparison; slower).
    pipeline_steps: while several HTTP requests wait, an engine step takes about half of the
        queued work (at least a quarter of the batch budget) and the requests sharing a prompt
        with it, so that the answers of one step can travel while the next computes (clients that
        keep N requests in flight, as RL rollout workers do; ``--pipeline-steps``). Off by default:
        at the 0.5 ms switch interval a step taking all it can was as fast or faster in every
        measured pair (docs/perf.md, Server).
    switch_interval: seconds a Python thread may hold the interpreter lock while another waits for
        it (``sys.setswitchinterval``), set while the app runs and restored after; None leaves it.
        The engine thread launches kernels between short stretches of Python; at Python's 5 ms it
        waited on the event loop's HTTP and JSON work (docs/perf.md, Server). The setting is the
        process's: an app embedded in another program changes it for that program too.
    shutdown_timeout: seconds a shutdown (SIGTERM/SIGINT, the app's lifespan end) waits for queued
        and running requests before failing the rest with 503; new requests get 503 meanwhile.
    body_timeout: seconds a request body may stall (no byte arriving) before the server answers 408
        and closes that connection.
    enable_return_routed_experts: requests may ask for ``return_routed_experts`` (mixture-of-experts
        models; SGLang's ``--enable-return-routed-experts``), else 400 naming it.
    weight_sync_timeout: seconds one ``/update_weights_from_distributed`` may take receiving the
        trainer's broadcasts; beyond it the group is left and the reply is 400 (the old weights
        stay in force).
    warmup: run ``Scorer.warmup`` once the port is open, before any request is scored (requests
        wait meanwhile); ``/ready`` answers 503 ``warming`` until it is done, then 200.
    max_images_per_request: images one HTTP request may carry (a model with a vision tower), else
        400 naming the first one beyond it.
    max_image_pixels: width x height of one image, read off its header before it is decoded, else
        400 naming it (default 4096 x 4096).
    allow_remote_images: http(s) image URLs are fetched (``remote_image_timeout`` s per socket
        operation, at most ``max_remote_image_bytes``); off, they are refused by name (400) and
        images come inline as ``data:`` URLs. Off by default: a fetch reaches whatever the server
        can reach.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_queue_requests: int = 256
    max_queue_tokens: int = 1 << 21
    max_request_tokens: int = 1 << 20
    max_request_items: int = 4096
    max_top_logprobs: int = 100
    max_body_bytes: int = 64 << 20
    max_capture_floats: int = 1 << 22
    batching: bool = True
    pipeline_steps: bool = False
    switch_interval: float | None = 0.0005
    shutdown_timeout: float = 30.0
    body_timeout: float = 30.0
    enable_return_routed_experts: bool = False  # SGLang's flag: requests may ask for routed experts
    weight_sync_timeout: float = 300.0
    warmup: bool = False
    max_images_per_request: int = 16
    max_image_pixels: int = 4096 * 4096
    allow_remote_images: bool = False
    remote_image_timeout: float = 10.0
    max_remote_image_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        check_positive_ints(self, ("max_queue_requests", "max_queue_tokens", "max_request_tokens",
                                   "max_request_items", "max_top_logprobs", "max_body_bytes",
                                   "max_capture_floats", "max_images_per_request", "max_image_pixels",
                                   "max_remote_image_bytes"))
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise LogprobeError("port", f"must be an integer in [0, 65535], got {self.port!r}")
        t = self.shutdown_timeout
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < float("inf"):
            raise LogprobeError("shutdown_timeout", f"must be a number of seconds >= 0, got {t!r}")
        t = self.switch_interval
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= 1):
            raise LogprobeError("switch_interval", f"must be a number of seconds in (0, 1] or None, got {t!r}")
        for key in ("body_timeout", "weight_sync_timeout", "remote_image_timeout"):
            t = getattr(self, key)
            if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < float("inf"):
                raise LogprobeError(key, f"must be a number of seconds > 0, got {t!r}")
        for key in ("batching", "pipeline_steps", "warmup", "allow_remote_images", "enable_return_routed_experts"):
            if not isinstance(getattr(self, key), bool):
                raise LogprobeError(key, f"must be True or False, got {getattr(self, key)!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise LogprobeError("api_key", "is empty", "give a non-empty key or leave it unset")
