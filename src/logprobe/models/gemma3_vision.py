"""Gemma 3's vision tower (SigLIP, ``model.vision_tower.vision_model``) and multimodal projector
(``model.multi_modal_projector``) of ``Gemma3ForConditionalGeneration``, natively.

An image arrives as the processor's S x S picture cut into g x g patches of P x P pixels
(g = S / P; ``models.vision.ImageFormat.patches``: each patch flattened (channel, row, column),
patches in raster order), [g², C * P * P]. The tower, as transformers' ``SiglipVisionModel``
(no pooling head: Gemma 3 reads its last hidden state) and ``Gemma3MultiModalProjector``:

    x_i  = W_patch vec(patch_i) + b_patch + E[i]          Conv2d with kernel = stride: linear per patch;
                                                           E the learned g² position table (no resampling)
    x    = x + Attn(LN_1(x)),  x = x + MLP(LN_2(x))        per encoder layer; attention full (not causal)
    y    = LN_post(x)                                     [g², H_v]
    z    = AvgPool_k(y as H_v x g x g)                     k = g / sqrt(mm_tokens_per_image): one token
                                                           per k x k patches, raster order
    out  = RMS_(1+w)(z) W_proj                             [mm_tokens_per_image, H_text]: the image tokens' rows

    Attn(x) = W_o softmax(q k^T / sqrt(D)) v + b_o,  q, k, v = W x + b per head
    MLP(x)  = W_fc2 act(W_fc1 x + b) + b                    act: ``hidden_act`` (gelu_pytorch_tanh)

Their rows replace the ``<image_soft_token>`` embeddings after the text embedding's sqrt(hidden)
scale (transformers scatters the image features into the scaled embeddings), and the tokens of
one run of image tokens attend to each other both ways in every block (``layers.attention``:
``Segment.spans``; ``engine.images.bidirectional_spans``).

Deterministic mode: every product of the tower and projector (the patch embedding, each layer's
linear layers, the projection) runs in the fixed row tiles of ``layers.linear``
(``numerics.row_tile``) and the activation row-invariantly (``layers.activation.row_invariant``),
so an image's embeddings do not depend on the BLAS thread count: a rank of a tensor-parallel group
(one thread, the tower whole on every rank) gives the one-rank embeddings bitwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LogprobeError
from ..layers.activation import row_invariant
from ..layers.linear import Linear, numerics_product
from ..layers.norm import OffsetRMSNorm
from ..layers.numerics import NumericsUser

# the vision config keys the tower reads, and those that carry nothing for its forward
_READ = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
         "image_size", "patch_size", "hidden_act", "layer_norm_eps", "model_type"}
_INERT = {"initializer_range", "transformers_version", "architectures", "output_hidden_states", "return_dict",
          "dtype", "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
          "problem_type", "_name_or_path", "output_attentions",
          "attention_dropout",  # training only
          "vision_use_head"}  # the pooling head: built by SigLIP, never read by Gemma 3 (its weights are skipped)
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


@dataclass(frozen=True, slots=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    mm_tokens_per_image: int
    text_hidden_size: int
    num_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    @property
    def side(self) -> int:
        """g: patches per side of an image."""
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:
        """k: patches per side of one image token."""
        return self.side // math.isqrt(self.mm_tokens_per_image)


def siglip_config(raw: dict, mm_tokens: int, text_hidden: int, where: str = "config.vision_config.") -> SiglipConfig:
    """A ``gemma3`` checkpoint's ``vision_config`` (and ``mm_tokens_per_image``) -> ``SiglipConfig``;
    a key the tower does not run (or an unknown one) is refused by name, never ignored."""
    if not isinstance(raw, dict):
        raise LogprobeError(where.rstrip("."), f"must be an object, got {raw!r}")
    unknown = sorted(set(raw) - _READ - _INERT)
    if unknown:
        raise LogprobeError(f"{where}{unknown[0]}", "is not in the native Gemma 3 vision tower",
                            "score the text alone (a checkpoint without the vision_config)")
    if raw.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise LogprobeError(f"{where}model_type", f"{raw['model_type']!r}: the native tower is SigLIP "
                            "('siglip_vision_model')")
    act = raw.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise LogprobeError(f"{where}hidden_act", f"{act!r} is not in the native tower ({', '.join(ACTIVATIONS)})")
    ints = {}
    for key, name, default in (("hidden_size", "hidden_size", 768), ("intermediate_size", "intermediate_size", 3072),
                               ("num_hidden_layers", "num_layers", 12), ("num_attention_heads", "num_heads", 12),
                               ("num_channels", "num_channels", 3), ("image_size", "image_size", 224),
                               ("patch_size", "patch_size", 16)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LogprobeError(f"{where}{key}", f"must be a positive integer, got {value!r}")
        ints[name] = value
    if ints["hidden_size"] % ints["num_heads"]:
        raise LogprobeError(f"{where}num_attention_heads", f"{ints['num_heads']} does not divide hidden_size "
                            f"{ints['hidden_size']}")
    side, tokens = ints["image_size"] // ints["patch_size"], math.isqrt(max(mm_tokens, 0))
    if ints["image_size"] % ints["patch_size"] or mm_tokens < 1 or tokens * tokens != mm_tokens or side % tokens:
        raise LogprobeError("config.mm_tokens_per_image", f"{mm_tokens}: must be a square whose side divides the "
                            f"{side} x {side} patches of an image (image_size {ints['image_size']} / patch_size "
                            f"{ints['patch_size']})")
    return SiglipConfig(**ints, mm_tokens_per_image=mm_tokens, text_hidden_size=text_hidden, hidden_act=act,
                        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-6)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.layer_norm1 = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, Linear(H, H, bias=True))
        self.mlp = nn.Module()
        self.mlp.fc1 = Linear(H, cfg.intermediate_size, bias=True)
        self.mlp.fc2 = Linear(cfg.intermediate_size, H, bias=True)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Full attention over one image's patches x [n, H]."""
        n, a = x.shape[0], self.self_attn
        q, k, v = (p(x).view(n, self.num_heads, -1).transpose(0, 1) for p in (a.q_proj, a.k_proj, a.v_proj))
        o = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # [heads, n, D], scale 1 / sqrt(D); 4-D: fused
        return a.out_proj(o.transpose(0, 1).reshape(n, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.layer_norm1(x))
        # the activation's bits independent of the thread count (its SIMD tails: row_invariant)
        return x + self.mlp.fc2(row_invariant(self.act, self.mlp.fc1(self.layer_norm2(x))))


class VisionTower(NumericsUser, nn.Module):
    """``model.vision_tower``: patches [g², C * P * P] -> [g², H_v]. Names as transformers 5 holds
    and saves them (``vision_tower.embeddings...``; the hub's ``vision_tower.vision_model.`` is
    read as that: ``loading.gemma``). Its products follow the model's numerics (``set_numerics``
    reaches them: fixed row tiles in deterministic mode)."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        # the checkpoint's Conv2d (kernel = stride: a matrix on flattened patches) and position
        # table as bare parameters (nn.Conv2d / nn.Embedding initialise on the meta device slowly)
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Module()
        self.embeddings.patch_embedding.weight = _param(H, cfg.num_channels, cfg.patch_size, cfg.patch_size)
        self.embeddings.patch_embedding.bias = _param(H)
        self.embeddings.position_embedding = nn.Module()
        self.embeddings.position_embedding.weight = _param(cfg.side ** 2, H)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(H, eps=cfg.layer_norm_eps)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        e = self.embeddings
        w = e.patch_embedding.weight
        x = numerics_product(patches.to(w.dtype), w.reshape(w.shape[0], -1), e.patch_embedding.bias, self.numerics)
        x = x + e.position_embedding.weight
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Projector(NumericsUser, nn.Module):
    """``model.multi_modal_projector``: the tower's [g², H_v] -> [mm_tokens_per_image, H_text]."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.side, self.pool = cfg.side, cfg.pool
        self.mm_input_projection_weight = _param(cfg.hidden_size, cfg.text_hidden_size)
        self.mm_soft_emb_norm = OffsetRMSNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        H, g = y.shape[1], self.side
        z = F.avg_pool2d(y.T.reshape(1, H, g, g), self.pool, self.pool)  # [1, H, t, t]
        z = z.flatten(2)[0].T  # [t², H]: tokens in raster order
        # z W as F.linear(z, W^T) under the numerics (W [H_v, H_text] is no Linear's [out, in])
        w = self.mm_input_projection_weight
        return numerics_product(self.mm_soft_emb_norm(z), w.T, None, self.numerics).to(y.dtype)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)
