"""The option sets that every scoring floor passes along, each as one frozen record.

``Scorer`` methods keep their keywords and build these once; ``scoring``, ``jobs``, the CLI and
the server pass the records down instead of repeating ``temperature, top_k, entropy`` (the head),
``context_length, stride, policy, prefix, max_tokens`` (perplexity windows) and ``capture, steer``
(hidden-state hooks) at every call:

>>> HeadOptions(temperature=2, top_k=3).checked()
HeadOptions(temperature=2.0, top_k=3, entropy=False)
>>> Windows().resolved(8192)
Windows(context_length=2048, stride=512, policy='sliding', prefix=True, max_tokens=None)
>>> bool(HookSpecs()), bool(HookSpecs(capture=[{"at": "blocks.0.resid_post"}]))
(False, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .inputs import check_options


@dataclass(frozen=True, slots=True)
class HeadOptions:
    """How the head turns logits into answers: ``log_softmax(logits / temperature)``, the ``top_k``
    alternatives per scored row (0: none), and each row's entropy."""

    temperature: float = 1.0
    top_k: int = 0
    entropy: bool = False

    def checked(self) -> HeadOptions:
        """The same options once ``temperature`` and ``top_k`` are valid (``temperature`` as a
        float); ``LogprobeError`` naming the field otherwise."""
        temperature, top_k = check_options(self.temperature, self.top_k)
        return HeadOptions(temperature, top_k, self.entropy)


@dataclass(frozen=True, slots=True)
class Windows:
    """How perplexity cuts a token stream into windows (``scoring.windows``): ``context_length``
    tokens per window (None: min(2048, the model's)), ``stride`` between "sliding" windows (None:
    context // 4), the ``policy`` ("sliding", "rolling", "llama.cpp"), ``prefix`` (the prefix token
    first; None: on unless "llama.cpp") and ``max_tokens`` (the first N tokens of each text)."""

    context_length: int | None = None
    stride: int | None = None
    policy: str = "sliding"
    prefix: bool | None = None
    max_tokens: int | None = None

    def resolved(self, max_length: int) -> Windows:
        """The defaults filled in for a model of ``max_length`` tokens (other policies keep the
        stride given).

        >>> Windows(policy="rolling").resolved(512)
        Windows(context_length=512, stride=None, policy='rolling', prefix=True, max_tokens=None)
        """
        context_length = min(2048, max_length) if self.context_length is None else self.context_length
        stride = self.stride
        if stride is None and self.policy == "sliding":
            stride = max(1, context_length // 4)
        prefix = (self.policy != "llama.cpp") if self.prefix is None else bool(self.prefix)
        return replace(self, context_length=context_length, stride=stride, prefix=prefix)


@dataclass(frozen=True, slots=True)
class HookSpecs:
    """Hidden-state reads (``capture``) and interventions (``steer``) of one call, as the caller
    wrote them (``interp.specs`` parses them against the model); false when there are neither."""

    capture: Sequence[dict] | None = None
    steer: Sequence[dict] | None = None

    def __bool__(self) -> bool:
        return bool(self.capture) or bool(self.steer)
