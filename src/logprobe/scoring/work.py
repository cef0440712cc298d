"""``Job``: a method's engine requests and how to turn their results into its answer; and
``ScoringContext``, what building a job reads about the model, built once by the ``Scorer``.

The job builders (``scoring.continuations``, ``sequences``, ``perplexity``, ``states``,
``compare``) take a ``ScoringContext`` and never call back into the ``Scorer``:
``Scorer.perplexity_job(texts)`` is ``scoring.perplexity.perplexity_job(scorer.context, texts, ...)``.

>>> job = Job([], lambda results: len(results))
>>> job.num_tokens, job.finish([])
(0, 0)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.request import RequestResult, ScoreRequest
from ..errors import LogprobeError
from ..interp.specs import CaptureSpec, SteerSpec
from ..loading import LoadedModel
from ..models.caps import ModelCaps
from ..models.moe import routed_blocks
from ..tokenizer import Tokenizer
from .images import ImageReader
from .inputs import check_hooks, check_ids
from .options import HookSpecs


@dataclass(slots=True)
class Job:
    """Engine requests and how to turn their results into the method's answer.

    ``Scorer.score(...)`` is ``job = Scorer.score_job(...)`` then ``job.finish(engine.run(job.requests))``;
    the server runs the requests of many jobs in shared batches and finishes each job on its own.
    """

    requests: list[ScoreRequest]
    finish: Callable[[list[RequestResult]], Any]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_inputs for r in self.requests)


def moe_routing(model) -> tuple[int, int, int]:
    """(MoE layers, experts per token, experts) of a native model's MoE blocks; (0, 0, 0) for none."""
    blocks = [m for _, m in routed_blocks(model)]
    return (len(blocks), blocks[0].top_k, blocks[0].spec.num_experts) if blocks else (0, 0, 0)


@dataclass(frozen=True, slots=True)
class ScoringContext:
    """What the job builders need to know about a scorer's model, and nothing else.

    ``hook_layers`` / ``hook_width``: the depth and hidden size that hook points are checked
    against (0 for a model without hook points). ``deterministic``: the engine's mode, which sums
    captures in a fixed order (``interp.specs.request_hooks``); ``Scorer.config = ...`` renews it.
    """

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_length: int
    backend: str
    caps: ModelCaps
    hook_layers: int
    hook_width: int
    deterministic: bool = False
    routing: tuple[int, int, int] = (0, 0, 0)  # MoE layers, experts per token, experts (0s: no routers)
    # each MoE layer's block (DeepSeek-V3 with one dense first block: (1, 2, 3)) and the number of
    # blocks (num_hidden_layers): SGLang's routed-experts layout has a row per block
    route_blocks: tuple[int, ...] = ()
    num_blocks: int = 0
    images: ImageReader | None = None  # a model with a vision tower (Qwen3.5, Gemma 3): its images -> request inputs

    @staticmethod
    def of(loaded: LoadedModel, deterministic: bool = False) -> ScoringContext:
        """The context of a loaded model (on a parallel scorer: the driver's weightless copy)."""
        model, info = loaded.model, loaded.info
        caps = ModelCaps.of(model)
        layers, width = (model.config.num_layers, model.config.hidden_size) if caps.hooks else (0, 0)
        blocks = tuple(i for i, _ in routed_blocks(model))
        return ScoringContext(info.name, loaded.tokenizer, info.vocab_size, info.max_length, info.backend, caps,
                              layers, width, bool(deterministic), moe_routing(model), blocks,
                              model.config.num_layers if blocks else 0, _image_reader(loaded))

    def check_images(self, field: str) -> ImageReader:
        """The image reader; a model without a vision tower: a ``LogprobeError`` naming ``field``."""
        if self.images is None:
            raise LogprobeError(field, f"{self.name} has no vision tower: images cannot be scored with it",
                                "score images with a checkpoint that has its vision_config (Qwen3.5, Gemma 3), "
                                "or send text")
        fmt = self.images.fmt
        for key, token in (("image_token_id", fmt.image_token_id), ("boi_token_index", fmt.begin_id),
                           ("eoi_token_index", fmt.end_id)):
            if token is not None and not 0 <= token < self.vocab_size:
                raise LogprobeError(f"config.{key}", f"{token} is outside the vocabulary [0, {self.vocab_size}): "
                                    "images cannot be placed", "fix the checkpoint's config")
        return self.images

    def check_routing(self, field: str) -> tuple[int, int, int]:
        """(MoE layers, experts per token, experts); a dense model: a ``LogprobeError`` naming ``field``."""
        if not self.routing[0]:
            raise LogprobeError(field, f"{self.name} has no mixture-of-experts layers: it routes no experts",
                                "ask for routed experts of a mixture-of-experts model (Qwen-MoE, Mixtral, ...)")
        return self.routing

    def check_ids(self, ids, name: str) -> list[int]:
        """``ids`` as a list of ints in this model's vocabulary (``scoring.inputs.check_ids``)."""
        return check_ids(ids, name, self.vocab_size)

    def hook_specs(self, hooks: HookSpecs) -> tuple[list[CaptureSpec], list[SteerSpec]]:
        """``hooks`` parsed against this model's depth and width; ``([], [])`` for none."""
        return check_hooks(hooks.capture, hooks.steer, self.caps.hooks, self.hook_layers, self.hook_width,
                           self.backend)


def _image_reader(loaded: LoadedModel) -> ImageReader | None:
    """Images for a model whose config has a vision tower (its ``image_format``), else None."""
    fmt = getattr(loaded.model, "image_format", None)
    if fmt is None:
        return None
    return ImageReader(loaded.info.path, loaded.tokenizer, fmt)
