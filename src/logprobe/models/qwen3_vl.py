"""Qwen3-VL (``qwen3_vl``) and Qwen3-VL MoE (``qwen3_vl_moe``), natively: Qwen3's text blocks
(``models.llama``: q/k RMSNorm per head; the MoE: Qwen3-MoE's routed blocks, ``models.moe``) with
the multimodal rotary and Qwen3.5's vision tower plus its deepstack mergers
(``models.qwen3_5_vision``):

    h_0     = embed(ids), the image tokens' rows replaced by the tower's merger output
    h'_l    = h_l + Attn_l(RMSNorm(h_l))                       rotary by the (t, h, w) rows
    h_{l+1} = h'_l + MLP_l(RMSNorm(h'_l))  [+ deep_l at the image rows, l < K]
    out     = RMSNorm(h_L)

deep_l: the l-th deepstack features of the image tokens (``ScoringModel.place_images``; K = the
vision config's ``deepstack_visual_indexes``, 3 in the released models). The rotary is Qwen3.5's
interleaved multimodal one (``layers.rotary.MRotaryEmbedding``, ``mrope_section`` [24, 20, 20] by
default) over the whole head; text tokens have three equal rows, so a prompt without images is the
plain rotary bit for bit. Positions of a prompt with images: ``qwen3_5_vision.mrope_positions``
(transformers' ``Qwen3VLModel.get_rope_index``: an image's tokens at (p + t, p + row, p + col), the
text after it from p + max(h', w')).

Tensor parallelism splits the text model as the Llama family's; the tower, small, is whole on
every rank (replicated, not split), each rank embedding the images of its pass alike; under
data-parallel attention a rank adds the deepstack features of its own rows
(``ScoringModel.forward``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.rotary import MRotaryEmbedding
from ..parallel.context import ParallelContext
from .llama import LlamaConfig, LlamaModel
from .moe import MoeModel
from .qwen3_5_vision import QwenImages, VisionConfig, VisionTower


@dataclass(slots=True)
class Qwen3VLConfig(LlamaConfig):
    """The text model (a ``LlamaConfig`` of Qwen3 or Qwen3-MoE blocks) with the multimodal rotary's
    sections, the vision tower (None: a checkpoint without ``vision_config``) and the image token."""

    mrope_section: tuple[int, int, int] = (24, 20, 20)
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    family: str = "qwen3_vl"  # the checkpoint's model_type


class VisionLanguage(QwenImages):
    """What Qwen3-VL adds to its text model (dense or MoE): the tower ``visual``, the multimodal
    rotary, and the images' format, embeddings and deepstack count."""

    def add_tower(self) -> None:
        v = self.config.vision
        self.visual = VisionTower(v) if v is not None else None
        self.deepstack_layers = len(v.deepstack) if v is not None else 0

    def make_rotary(self, freq_factors: torch.Tensor | None = None) -> MRotaryEmbedding:
        cfg = self.config
        return MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)


class Qwen3VLModel(VisionLanguage, LlamaModel):
    """Qwen3-VL's dense text model and tower."""

    def __init__(self, cfg: Qwen3VLConfig, rope_freq_factors=None, ctx: ParallelContext | None = None) -> None:
        super().__init__(cfg, None, ctx)
        self.add_tower()


class Qwen3VLMoeModel(VisionLanguage, MoeModel):
    """Qwen3-VL MoE's text model (Qwen3-MoE blocks) and tower."""

    def __init__(self, cfg: Qwen3VLConfig, rope_freq_factors=None, ctx: ParallelContext | None = None) -> None:
        super().__init__(cfg, None, ctx)
        self.add_tower()


def qwen3_vl_model_class(cfg: Qwen3VLConfig) -> type[LlamaModel]:
    return Qwen3VLModel if cfg.moe is None else Qwen3VLMoeModel
