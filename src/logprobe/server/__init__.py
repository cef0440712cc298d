"""The HTTP scoring server: OpenAI-compatible ``/v1/completions`` (echo + logprobs, vLLM's
``prompt_logprobs``), vLLM-style tokenizer endpoints, native ``/v1/score``, ``/v1/logprobs``,
``/v1/perplexity``, and for RL frameworks SGLang's ``/generate`` (scoring) and
``/update_weights_from_disk`` (``routes_rl``); concurrent requests share engine batches
(``Batcher``), and a weight swap happens between them (``Batcher.exclusive``)."""

from .app import create_app
from .batcher import Batcher, QueueFull
from .config import ServerConfig

__all__ = ["Batcher", "QueueFull", "ServerConfig", "create_app"]
