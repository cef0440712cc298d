"""Gemma 4's vision tower (``model.vision_tower``) and its embedder into the text model
(``model.embed_vision``) of ``Gemma4ForConditionalGeneration``, natively.

An image arrives as the processor's patches of its aspect-preserving resize, ph x pw patches of
P x P pixels in raster order, each flattened (row, column, channel) ([ph * pw, P * P * 3]; the
processor's padding patches dropped: ``models.vision.ImageFormat.patches``). As transformers'
``Gemma4VisionModel`` and ``Gemma4MultimodalEmbedder`` (N: RMSNorm x / rms(x) * w in float32;
N0: without w; clip: each linear's input and output clamped where ``use_clipped_linears``):

    x_i   = W_in (2 p_i - 1) + E_x[col_i] + E_y[row_i]      the two learned position tables, summed
    q, k  = rope_2d(N_q(W_q a)), rope_2d(N_k(W_k a)),  v = N0(W_v a)      a = N_in(x), per head
    x     = x + N_post_attn(W_o softmax(q k^T) v)           full attention (scale 1), kv heads shared (GQA)
    x     = x + N_post_ff(W_down(act(W_gate b) * W_up b))   b = N_pre_ff(x)
    z_j   = sqrt(H_v) * mean of the k x k patches of token j (float32)   k = pooling_kernel_size, raster
    z     = (z - std_bias) * std_scale                      where ``standardize``
    out   = W_proj N0(z)                                    [ph * pw / k², H_text]: the image tokens' rows

    rope_2d: the first half of a head's dims rotated by the patch's column, the second half by its
    row (each half rotate-half, frequencies theta^(-4j / D) for j < D / 4).

Deterministic mode: every product of the tower and embedder (``layers.linear.Linear``) runs in the
fixed row tiles of ``numerics.row_tile``, and the activation and the rotary's cos / sin
row-invariantly (``layers.activation.row_invariant``), so an image's embeddings do not depend on
the BLAS thread count: a rank of a tensor-parallel group (one thread, the tower whole on every
rank) gives the one-rank embeddings bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LogprobeError
from ..layers.activation import row_invariant
from ..layers.linear import Linear
from ..layers.norm import Float32RMSNorm as Norm

_READ = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "head_dim", "hidden_activation", "rms_norm_eps", "rope_parameters", "pooling_kernel_size", "patch_size",
         "position_embedding_size", "use_clipped_linears", "standardize", "attention_bias", "model_type"}
_INERT = {"initializer_range", "transformers_version", "architectures", "output_hidden_states", "return_dict",
          "dtype", "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
          "problem_type", "_name_or_path", "output_attentions", "attention_dropout",
          "max_position_embeddings"}  # the tower's positions are the two tables, never this
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


@dataclass(frozen=True, slots=True)
class Gemma4VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    text_hidden_size: int
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    use_clipped_linears: bool = False
    standardize: bool = False


def gemma4_vision_config(raw: dict, text_hidden: int, where: str = "config.vision_config.") -> Gemma4VisionConfig:
    """A ``gemma4`` checkpoint's ``vision_config`` -> ``Gemma4VisionConfig``; a key the tower does
    not run (or an unknown one) is refused by name, never ignored."""
    if not isinstance(raw, dict):
        raise LogprobeError(where.rstrip("."), f"must be an object, got {raw!r}")
    unknown = sorted(set(raw) - _READ - _INERT)
    if unknown:
        raise LogprobeError(f"{where}{unknown[0]}", "is not in the native Gemma 4 vision tower",
                            "score the text alone (a checkpoint without the vision_config)")
    if raw.get("model_type", "gemma4_vision") != "gemma4_vision":
        raise LogprobeError(f"{where}model_type", f"{raw['model_type']!r}: the native tower is 'gemma4_vision'")
    if raw.get("attention_bias"):
        raise LogprobeError(f"{where}attention_bias", "true: the native tower's projections have no bias")
    act = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise LogprobeError(f"{where}hidden_activation", f"{act!r} is not in the native tower ({', '.join(ACTIVATIONS)})")
    rope = raw.get("rope_parameters") or {"rope_type": "axial", "rope_theta": 100.0}
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") != "axial" or set(rope) - {"rope_type",
                                                                                                 "rope_theta"}:
        raise LogprobeError(f"{where}rope_parameters", f"{rope!r}: the tower runs the axial rotary only")
    ints = {}
    for key, name, default in (("hidden_size", "hidden_size", 768), ("intermediate_size", "intermediate_size", 3072),
                               ("num_hidden_layers", "num_layers", 16), ("num_attention_heads", "num_heads", 12),
                               ("num_key_value_heads", "num_kv_heads", 12), ("head_dim", "head_dim", 64),
                               ("patch_size", "patch_size", 16), ("pooling_kernel_size", "pooling_kernel_size", 3),
                               ("position_embedding_size", "position_embedding_size", 10240)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LogprobeError(f"{where}{key}", f"must be a positive integer, got {value!r}")
        ints[name] = value
    if ints["head_dim"] % 4:
        raise LogprobeError(f"{where}head_dim", f"{ints['head_dim']}: must be a multiple of 4 (2-D rotary)")
    if ints["num_heads"] % ints["num_kv_heads"]:
        raise LogprobeError(f"{where}num_key_value_heads", f"{ints['num_kv_heads']} does not divide "
                            f"num_attention_heads {ints['num_heads']}")
    return Gemma4VisionConfig(**ints, text_hidden_size=text_hidden, hidden_activation=act,
                              rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                              rope_theta=float(rope.get("rope_theta", 100.0)),
                              use_clipped_linears=bool(raw.get("use_clipped_linears", False)),
                              standardize=bool(raw.get("standardize", False)))


class _Clippable(nn.Module):
    """``Gemma4ClippableLinear``: ``linear`` (no bias), its input and output clamped to the
    checkpoint's bounds where the config clips."""

    def __init__(self, cfg: Gemma4VisionConfig, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = Linear(n_in, n_out)
        self.clip = cfg.use_clipped_linears
        if self.clip:
            for name in ("input_min", "input_max", "output_min", "output_max"):  # transformers' buffers
                setattr(self, name, nn.Parameter(torch.zeros(()), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clip:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)
        return torch.clamp(x, self.output_min, self.output_max) if self.clip else x


class _Layer(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        H, D, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.act = ACTIVATIONS[cfg.hidden_activation]
        self.self_attn = a = nn.Module()
        a.q_proj, a.k_proj = _Clippable(cfg, H, cfg.num_heads * D), _Clippable(cfg, H, cfg.num_kv_heads * D)
        a.v_proj, a.o_proj = _Clippable(cfg, H, cfg.num_kv_heads * D), _Clippable(cfg, cfg.num_heads * D, H)
        a.q_norm, a.k_norm, a.v_norm = Norm(D, eps), Norm(D, eps), Norm(D, eps, scale=False)
        self.mlp = m = nn.Module()
        m.gate_proj, m.up_proj = _Clippable(cfg, H, cfg.intermediate_size), _Clippable(cfg, H, cfg.intermediate_size)
        m.down_proj = _Clippable(cfg, cfg.intermediate_size, H)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Norm(H, eps))

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, a, D = x.shape[0], self.self_attn, self.head_dim
        q = _rope_2d(a.q_norm(a.q_proj(x).view(n, self.num_heads, D)), cos, sin)
        k = _rope_2d(a.k_norm(a.k_proj(x).view(n, self.num_kv_heads, D)), cos, sin)
        v = a.v_norm(a.v_proj(x).view(n, self.num_kv_heads, D))
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), scale=1.0,
                                           enable_gqa=self.num_heads != self.num_kv_heads)[0]  # [heads, n, D]; 4-D: fused
        return a.o_proj(o.transpose(0, 1).reshape(n, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.attention(self.input_layernorm(x), cos, sin))
        m = self.mlp
        b = self.pre_feedforward_layernorm(x)
        # act(gate) * up with its bits independent of the thread count (SIMD tails: row_invariant)
        g = row_invariant(lambda gate, up: self.act(gate) * up, m.gate_proj(b), m.up_proj(b))
        return x + self.post_feedforward_layernorm(m.down_proj(g))


def _rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, D]: each half of D rotated (rotate half within it) by cos / sin [n, D]."""
    halves = []
    for part, c, s in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1)):
        a, b = part.chunk(2, -1)
        halves.append(part * c[:, None] + torch.cat([-b, a], -1) * s[:, None])
    return torch.cat(halves, -1)


class VisionTower(nn.Module):
    """``model.vision_tower``: one image's patches [ph * pw, P * P * 3] of grid (1, ph, pw) ->
    pooled, scaled (and standardized) tokens [ph * pw / k², H_v]."""

    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.patch_embedder = nn.Module()
        self.patch_embedder.input_proj = Linear(3 * cfg.patch_size ** 2, H)
        self.patch_embedder.position_embedding_table = nn.Parameter(
            torch.empty(2, cfg.position_embedding_size, H), requires_grad=False)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        if cfg.standardize:  # transformers' buffers, held as parameters: loaded and updated as weights
            self.std_bias = nn.Parameter(torch.zeros(H), requires_grad=False)
            self.std_scale = nn.Parameter(torch.ones(H), requires_grad=False)

    def rotary(self, rows: torch.Tensor, cols: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, D]: (col f, col f, row f, row f), f = theta^(-4j / D), j < D / 4."""
        D = self.config.head_dim
        inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, D // 2, 2, dtype=torch.float) / (D // 2)))
        inv = inv.to(rows.device)  # made on the host, as transformers makes it; the rows may be on a GPU
        fx, fy = cols[:, None].float() * inv, rows[:, None].float() * inv
        angles = torch.cat([fx, fx, fy, fy], -1)
        return row_invariant(torch.cos, angles).to(dtype), row_invariant(torch.sin, angles).to(dtype)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        _, ph, pw = grid
        cfg, pe = self.config, self.patch_embedder
        rows = torch.arange(ph).repeat_interleave(pw).to(patches.device)
        cols = torch.arange(pw).repeat(ph).to(patches.device)
        w = pe.input_proj.weight
        x = pe.input_proj((2 * (patches - 0.5)).to(w.dtype))
        x = x + (pe.position_embedding_table[0][cols] + pe.position_embedding_table[1][rows])
        cos, sin = self.rotary(rows, cols, x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        k = cfg.pooling_kernel_size
        token = (cols // k) + (pw // k) * (rows // k)  # each patch's token, raster order of the pooled grid
        pooled = torch.zeros(ph * pw // k ** 2, x.shape[1], dtype=torch.float32, device=x.device)
        pooled.index_add_(0, token, x.float() * (1.0 / k ** 2))  # weights 1 / k² in float32, as transformers
        z = pooled * cfg.hidden_size ** 0.5
        if cfg.standardize:
            z = (z - self.std_bias.float()) * self.std_scale.float()
        return z.to(x.dtype)


class Embedder(nn.Module):
    """``model.embed_vision``: the tower's tokens -> the text model's rows (norm without weight, projection)."""

    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = Norm(cfg.hidden_size, cfg.rms_norm_eps, scale=False)
        self.embedding_projection = Linear(cfg.hidden_size, cfg.text_hidden_size)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(z))
