"""The HTTP scoring server: OpenAI-compatible ``/v1/completions`` (echo + logprobs), vLLM-style
tokenizer endpoints, native ``/v1/score``, ``/v1/logprobs``, ``/v1/perplexity``; concurrent
requests share engine batches (``Batcher``)."""

from .app import create_app
from .batcher import Batcher, QueueFull
from .config import ServerConfig

__all__ = ["Batcher", "QueueFull", "ServerConfig", "create_app"]
