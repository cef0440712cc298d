"""Qwen3.5's vision tower (``model.visual`` of ``Qwen3_5ForConditionalGeneration`` and of the MoE
variant, which shares it), natively, and the multimodal positions of a prompt with images. It is
Qwen3-VL's tower (transformers derives Qwen3.5's from ``Qwen3VLVisionModel``) less the deepstack
mergers, which Qwen3-VL adds (``deepstack_visual_indexes``; see below).

An image arrives as the processor's patches: ``pixel_values`` [N, C * Tp * P * P] (each row one
patch of Tp frames of P x P pixels, C channels) and its patch grid (t, h, w), N = t * h * w, the
patches of each frame listed block by block of ``m x m`` (``m = spatial_merge_size``):
(block row, block column, row in block, column in block). The tower, per frame of an image:

    x_i   = W_patch vec(patch_i) + b_patch                 Conv3d with kernel = stride: linear per patch
    x_i  += Σ_{2x2 taps} w_tap E[tap]                       the learned side x side position table, resampled
                                                            bilinearly (align corners) to the h x w grid
    x     = x + Attn(LN_1(x)),  x = x + MLP(LN_2(x))        per block; attention: full (not causal) within
                                                            the frame, q/k rotated by (row, col) (2-D rotary)
    out_j = W_2 gelu(W_1 vec(LN(x)_{4j .. 4j+3}) + b_1) + b_2   the merger: m x m patches -> one token

    MLP(x) = W_fc2 act(W_fc1 x + b) + b                     act: ``hidden_act`` (gelu_pytorch_tanh)

Deepstack (Qwen3-VL, ``deepstack_visual_indexes`` = [b_0, b_1, ...]): the output x of block b_i also
goes through deepstack merger i, which normalises after the m x m shuffle (one LayerNorm over the
m² H values):

    deep_i,j = W_2 gelu(W_1 LN(vec(x_{4j .. 4j+3})) + b_1) + b_2

The features are listed in block order (deep_0: the lowest block's), and the text model adds the
k-th to the hidden states of the image tokens after its block k (``ScoringModel.forward``). The
tower gives each token (1 + K) * out_hidden_size values: the merger's, then the K features.

The 2-D rotary (transformers' ``Qwen3_5VisionRotaryEmbedding``): head dim D, frequencies
``θ^(-2k / (D/2))`` for k < D/4; in the rotate-half layout pair j (dims j, j + D/2) turns by
``row * f_j`` for j < D/4 and ``col * f_{j - D/4}`` for D/4 <= j < D/2.

Text positions (``mrope_positions``): a text token at running position p has (p, p, p); an image
of merged grid (t, h', w') = (t, h / m, w / m) starting at p gets (p + t_i, p + r, p + c) for its
tokens in raster order, and the text after it continues from p + max(h', w') (transformers'
``get_rope_index``; for t = 1 that is one past the image's largest position).

Deterministic mode: every product of the tower (the patch embedding, each block's and the
merger's linear layers) runs in the fixed row tiles of ``layers.linear`` (``numerics.row_tile``),
so an image's embeddings do not depend on the BLAS thread count: a rank of a tensor-parallel
group (one thread, the tower whole on every rank) gives the one-rank embeddings bitwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LogprobeError
from ..layers.linear import Linear, numerics_product
from ..layers.numerics import NumericsUser
from .vision import ImageFormat

# the vision config keys the tower reads, and those that carry nothing for the forward
_READ = {"depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels", "patch_size",
         "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings", "rope_parameters",
         "deepstack_visual_indexes"}
_INERT = {"model_type", "initializer_range", "transformers_version", "architectures", "output_hidden_states",
          "return_dict", "dtype", "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
          "label2id", "problem_type", "_name_or_path", "output_attentions", "num_attention_heads",
          "num_hidden_layers"}
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


@dataclass(frozen=True, slots=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: the blocks whose outputs feed the deepstack mergers

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def vision_config(raw: dict, where: str = "config.vision_config.", deepstack: bool = False) -> VisionConfig:
    """A checkpoint's ``vision_config`` -> ``VisionConfig``; a key the tower does not run (or an
    unknown one) is refused by name, never ignored. ``deepstack``: the model adds deepstack
    features to its text blocks (Qwen3-VL); else ``deepstack_visual_indexes`` is refused (Qwen3.5's
    text model has no place for them)."""
    if not isinstance(raw, dict):
        raise LogprobeError(where.rstrip("."), f"must be an object, got {raw!r}")
    unknown = sorted(set(raw) - _READ - _INERT)
    if unknown:
        raise LogprobeError(f"{where}{unknown[0]}", "is not in the native Qwen3.5 vision tower",
                            "score the text alone (a checkpoint without the vision_config)")
    rope = raw.get("rope_parameters") or {"rope_type": "axial"}
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") != "axial" \
            or set(rope) - {"rope_type", "rope_theta"}:
        raise LogprobeError(f"{where}rope_parameters", f"{rope!r}: the tower runs the axial rotary "
                            "(rope_type 'axial', rope_theta) only")
    act = raw.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise LogprobeError(f"{where}hidden_act", f"{act!r} is not in the native tower ({', '.join(ACTIVATIONS)})")
    ints = {}
    for key, default in (("depth", None), ("hidden_size", None), ("intermediate_size", None), ("num_heads", None),
                         ("out_hidden_size", None), ("num_position_embeddings", None), ("in_channels", 3),
                         ("patch_size", 16), ("temporal_patch_size", 2), ("spatial_merge_size", 2)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LogprobeError(f"{where}{key}", f"must be a positive integer, got {value!r}")
        ints[key] = value
    if raw.get("deepstack_visual_indexes") and not deepstack:
        raise LogprobeError(f"{where}deepstack_visual_indexes", "deepstack features (Qwen3-VL's) are not in the "
                            "native Qwen3.5 model", "a Qwen3-VL checkpoint has model_type qwen3_vl or qwen3_vl_moe")
    indexes = _deepstack(raw.get("deepstack_visual_indexes") or [], ints["depth"], where)
    side = math.isqrt(ints["num_position_embeddings"])
    if side * side != ints["num_position_embeddings"]:
        raise LogprobeError(f"{where}num_position_embeddings", f"{side * side} != {ints['num_position_embeddings']}: "
                            "the learned positions are a square grid")
    if ints["hidden_size"] % ints["num_heads"] or (ints["hidden_size"] // ints["num_heads"]) % 4:
        raise LogprobeError(f"{where}num_heads", f"hidden_size / num_heads must be a multiple of 4 (2-D rotary), "
                            f"got {ints['hidden_size']} / {ints['num_heads']}")
    return VisionConfig(**ints, hidden_act=act, rope_theta=float(rope.get("rope_theta", 10000.0)),
                        deepstack=indexes)


def _deepstack(indexes, depth: int, where: str) -> tuple[int, ...]:
    """The blocks whose outputs feed deepstack mergers, in the config's order (merger i reads block
    ``indexes[i]``); each a distinct block of the tower (transformers would give a repeated or
    missing block fewer features than mergers, silently)."""
    field = f"{where}deepstack_visual_indexes"
    if not isinstance(indexes, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in indexes):
        raise LogprobeError(field, f"must be a list of block indices, got {indexes!r}")
    if len(set(indexes)) != len(indexes) or any(not 0 <= b < depth for b in indexes):
        raise LogprobeError(field, f"{indexes}: must be distinct blocks of the tower's {depth}")
    return tuple(indexes)


def block_order(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of an h x w frame in the processor's order, m x m blocks one after
    another:

    >>> [t.tolist() for t in block_order(2, 4, 2)]
    [[0, 0, 1, 1, 0, 0, 1, 1], [0, 1, 0, 1, 2, 3, 2, 3]]
    """
    row = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    col = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    return row.permute(0, 2, 1, 3).reshape(-1), col.permute(0, 2, 1, 3).reshape(-1)


def bilinear_taps(n: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid positions 0..n-1 on an axis of the side-long table, corners aligned:
    (taps [n, 2] = floor, floor + 1 clamped; weights [n, 2] = 1 - distance, float32)."""
    src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
    floor = src.floor()
    taps = (floor.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - torch.arange(2)).abs()).clamp(min=0)
    return taps, weights


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.norm1 = nn.LayerNorm(H, eps=1e-6)
        self.norm2 = nn.LayerNorm(H, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = Linear(H, 3 * H, bias=True)
        self.attn.proj = Linear(H, H, bias=True)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = Linear(H, cfg.intermediate_size, bias=True)
        self.mlp.linear_fc2 = Linear(cfg.intermediate_size, H, bias=True)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Full attention over one frame's patches x [n, H]; q, k rotated in float32 (rotate half)."""
        n = x.shape[0]
        q, k, v = self.attn.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)  # [n, heads, D] each
        q, k = (_rotate(t.float(), cos, sin).to(x.dtype) for t in (q, k))
        # 4-D inputs: SDPA's fused kernels take only those (3-D ran its unfused math path, the
        # tower's largest cost on a GPU)
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0]  # [heads, n, D]
        return self.attn.proj(o.transpose(0, 1).reshape(n, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), cos, sin)
        return x + self.mlp.linear_fc2(self.act(self.mlp.linear_fc1(self.norm2(x))))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, D] * cos + rotate_half(x) * sin, cos / sin [n, D]."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + turned * sin[:, None]


class PatchMerger(nn.Module):
    """m x m patches -> one token: ``W_2 gelu(W_1 vec(.) + b_1) + b_2`` of the patches normalised
    each alone (the merger) or normalised together after the shuffle (``postshuffle``: a deepstack
    merger). Parameter names: the checkpoint's (``norm``, ``linear_fc1``, ``linear_fc2``)."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool = False) -> None:
        super().__init__()
        H, wide = cfg.hidden_size, cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(wide if postshuffle else H, eps=1e-6)
        self.linear_fc1 = Linear(wide, wide, bias=True)
        self.linear_fc2 = Linear(wide, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] (patches in the processor's order) -> [n / m², out_hidden_size]."""
        wide = self.linear_fc1.in_features
        x = self.norm(x.reshape(-1, wide)) if self.postshuffle else self.norm(x).reshape(-1, wide)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(NumericsUser, nn.Module):
    """``forward(pixel_values [t*h*w, patch_dim], (t, h, w)) -> [t*h*w / m², (1 + k) * out_hidden_size]``:
    one image's tokens for the text model (k: the deepstack mergers, 0 for Qwen3.5; their features
    follow the merger's in each row). Parameter names are the checkpoint's under ``model.visual.``.
    Its products follow the model's numerics (``set_numerics`` reaches them: fixed row tiles in
    deterministic mode)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.side = math.isqrt(cfg.num_position_embeddings)
        # the checkpoint's Conv3d (kernel = stride: a matrix on flattened patches) and learned
        # position table, as bare parameters: nn.Conv3d's and nn.Embedding's initialisation on the
        # meta device imports torch._dynamo (a second of every load)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = _param(H, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                              cfg.patch_size)
        self.patch_embed.proj.bias = _param(H)
        self.pos_embed = nn.Module()
        self.pos_embed.weight = _param(cfg.num_position_embeddings, H)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        if cfg.deepstack:  # absent from Qwen3.5's checkpoints (and state dict) altogether
            self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack)

    def patch_product(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The patch embedding's product under the numerics (the Conv3d is not a ``Linear``)."""
        return numerics_product(x, w, b, self.numerics)

    def check_grid(self, grid: tuple[int, int, int], patches: int, field: str) -> None:
        t, h, w = grid
        m = self.config.spatial_merge_size
        if min(grid) < 1 or h % m or w % m or t * h * w != patches:
            raise LogprobeError(field, f"grid (t, h, w) = {grid} with {patches} patches: needs t * h * w patches "
                                f"and h, w multiples of spatial_merge_size {m}", "use the checkpoint's processor")

    def positions(self, h: int, w: int) -> torch.Tensor:
        """The learned position table resampled to an h x w frame, in patch order [h * w, H]
        (float32 at least)."""
        row, col = block_order(h, w, self.config.spatial_merge_size)
        (rt, rw), (ct, cw) = bilinear_taps(h, self.side), bilinear_taps(w, self.side)
        taps = (rt[row][:, :, None] * self.side + ct[col][:, None, :]).reshape(-1, 4)  # [h*w, 4]
        weights = (rw[row][:, :, None] * cw[col][:, None, :]).reshape(-1, 4)  # [h*w, 4]
        E = self.pos_embed.weight
        # float32 weights, as transformers': a bf16 table's taps are summed in float32
        return (E[taps.to(E.device)] * weights.to(E.device)[:, :, None]).sum(1)

    def rotary(self, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [h * w, D] (float32) of the 2-D rotary for an h x w frame, in patch order."""
        D = self.config.head_dim
        inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, D // 2, 2, dtype=torch.float) / (D // 2)))
        row, col = block_order(h, w, self.config.spatial_merge_size)
        angles = torch.cat([row[:, None].float() * inv, col[:, None].float() * inv], dim=-1)  # [n, D/2]
        angles = torch.cat([angles, angles], dim=-1).to(device)  # the rotate-half layout: pair j with j + D/2
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid
        proj = self.patch_embed.proj
        x = self.patch_product(pixel_values.to(proj.weight.dtype), proj.weight.reshape(proj.weight.shape[0], -1),
                               proj.bias)
        x = x + self.positions(h, w).to(x.dtype).repeat(t, 1)
        cos, sin = self.rotary(h, w, x.device)
        frames = [x[f * h * w:(f + 1) * h * w] for f in range(t)]  # attention stays within a frame
        deep = []  # in block order, each block's own merger (transformers' order where the list is not sorted)
        for b, block in enumerate(self.blocks):
            frames = [block(f, cos, sin) for f in frames]
            if b in self.config.deepstack:
                deep.append(self.deepstack_merger_list[self.config.deepstack.index(b)](torch.cat(frames)))
        return torch.cat([self.merger(torch.cat(frames)), *deep], dim=-1)


class QwenImages:
    """What a model with this tower (``visual``; None when the checkpoint has no vision config or
    this rank holds none) says of images: the image token once per image, expanded to
    t * h * w / m² tokens, multimodal positions, causal attention; the tower's output per image."""

    @property
    def image_format(self) -> ImageFormat | None:
        v = self.config.vision
        return None if v is None else ImageFormat(self.config.image_token_id, v.spatial_merge_size, mrope=True)

    @property
    def tower_here(self) -> bool:
        return self.visual is not None

    def encode_image(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t*h*w, patch_dim] -> [t*h*w / m², (1 + K) H]: its token embeddings,
        then its K deepstack features where the tower has them (``ScoringModel.place_images``)."""
        return self.visual(pixel_values.to(self.embed_tokens.weight.device), grid)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def mrope_positions(ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]], merge: int
                    ) -> torch.Tensor:
    """[3, len(ids)] int64 (t, h, w) positions: text tokens (p, p, p), each run of image tokens the
    merged grid of the next image (see the module's docstring). Each image's tokens must be one run
    of t * h * w / merge² ids (checked by the caller). Text, an image of grid (1, 4, 6) merged by 2
    (2 x 3 tokens), text:

    >>> mrope_positions([7, 8, 9, 9, 9, 9, 9, 9, 5, 6], 9, [(1, 4, 6)], 2).tolist()
    [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6], [0, 1, 2, 2, 2, 3, 3, 3, 5, 6], [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]
    """
    ids = np.asarray(ids)
    out = np.empty((3, len(ids)), dtype=np.int64)
    image_at = np.flatnonzero(ids == image_token_id)
    p, j, k = 0, 0, 0  # next position, next row, image tokens placed
    for t, h, w in grids:
        a = int(image_at[k])  # the image's first token: text rows j .. a - 1 before it
        out[:, j:a] = p + np.arange(a - j)
        p += a - j
        h, w = h // merge, w // merge
        n = t * h * w
        out[:, a:a + n] = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, n) + p
        p, j, k = p + max(h, w), a + n, k + n
    out[:, j:] = p + np.arange(len(ids) - j)
    return torch.from_numpy(out)
