"""Gemma 4, natively: the text models (``gemma4_text``) and the text tower of the multimodal
``gemma4`` checkpoints (``loading.gemma4``).

Transformers' ``Gemma4TextModel``, block by block, with N(.) the plain RMSNorm of Gemma 4 (``Norm``:
normalised and scaled by w in float32, one cast at the end; ``Norm0`` has no weight):

    h_0     = embed(ids) * s                          # embed; s = sqrt(hidden), a tensor of the model dtype
    a_l     = N_post_attn(Attn_l(N_in(h_l)))          # resid_pre l, attn_out l
    h'_l    = h_l + a_l                               # resid_mid l
    m_l     = N_post_ff(MLP_l(N_pre_ff(h'_l)))        # mlp_out l
    h''_l   = h'_l + m_l
    h''_l  += N_ple(P_l(act(G_l h''_l) * e_l))        # per-layer embeddings, when hidden_size_per_layer_input
    h_{l+1} = h''_l * layer_scalar_l                  # resid_post l
    out     = N_final(h_L)                            # final_norm; the head soft-caps (final_logit_softcapping)

    Attn_l:  q = rope(N_q(x Wq)); k_raw = x Wk; k = rope(N_k(k_raw)); v = Norm0(x Wv, or k_raw where
             attention_k_eq_v on full-attention blocks); softmax(q k^T) v (scale 1: the norms set it),
             causal, a ``sliding_attention`` block's keys cut to its window; o_proj.
             Full-attention blocks have their own head_dim and kv heads (``global_head_dim``,
             ``num_global_key_value_heads``, or transformers' ``per_layer_config``).
    RoPE:    rotate-half layout (permuted to the interleaved one at load); per layer type
             inv_freq_i = theta^(-2i / head_dim) / factor for i < partial * head_dim / 2, else 0
             ("proportional"; "default" is partial 1, factor 1).
    MLP_l:   down(gelu_tanh(x Wgate) * x Wup), twice as wide on KV-shared blocks with use_double_wide_mlp.
    PLE:     e_l = (N_proj(x_0 Wple * hidden^-1/2)[l] + E_ple[ids][l] * sqrt(ple_dim)) * 2^-1/2, x_0 = h_0.
    KV sharing: the last ``num_kv_shared_layers`` blocks compute no keys or values: each reuses those of
             the last earlier block of its layer type (the "producer"). Under chunking and prefix
             sharing a consumer stores the producer's keys in its own cache slot, so every layer's
             context is its own.

With ``attention_k_eq_v`` the values are the raw key projection, whose rows were permuted with the
keys' for the interleaved rotary: such a block's o_proj input columns take the same permutation.

Not run (refused at load, key named): mixture-of-experts blocks (``enable_moe_block``), attention
bias, bidirectional attention over all tokens.

Images (the multimodal checkpoints with their ``vision_config``): the tower and embedder
(``models.gemma4_vision``) give each image's rows, which replace its image tokens' rows of h_0
after the scale; their per-layer embeddings e_l are the pad token's (transformers looks image
tokens up as ``pad_token_id``), their projection part reads the image rows. With
``use_bidirectional_attention: "vision"`` each run of image tokens is a bidirectional span of the
sliding blocks' attention (full blocks stay causal: transformers' ``create_masks_for_vision_model``).

Tensor parallelism (``ctx``) as the Llama family (``models.llama``), per block with its own head_dim
and kv heads: a rank holds its query heads and the kv heads they read (a KV-shared block reads its
producer's, the same heads: ``loading.gemma4.gemma4_parallel_context`` checks the producer's kv heads
and head_dim equal the block's), its share of the MLP, and of the per-layer embeddings' gate its
share of the ple_dim columns (``per_layer_input_gate`` column-parallel, ``per_layer_projection``
gathered-row), the per-layer inputs e_l cut to the same columns. The per-layer projection of h_0 is
normed per layer over the whole ple_dim, so it is held whole on every rank; the embeddings (both
tables) and the LM head are split by vocabulary. Worked example, 4 query heads, sliding blocks 2 kv
heads of 16, full blocks 1 kv head of 32, ple_dim 8, TP = 2: rank 1 holds q heads 2, 3, on sliding
blocks kv head 1 (k_proj rows 16:32), on full blocks kv head 0 (rows 0:32, replicated), ple columns 4:8.
The vision tower and embedder are whole on every rank; the image spans run on each rank's own heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LogprobeError
from ..layers.activation import row_invariant
from ..layers.attention import AttentionMeta, packed_attention
from ..layers.embedding import VocabParallelEmbedding, scaled
from ..layers.hooks import Hooks
from ..layers.linear import Linear, fuse_linears
from ..layers.logprob_head import HeadParams
from ..layers.norm import Float32RMSNorm as Norm
from ..layers.numerics import NumericsUser
from ..layers.parallel_linear import ColumnParallelLinear, GatheredRowLinear, ParallelLMHead
from ..layers.rotary import apply_rotary, to_interleaved
from ..parallel.context import ParallelContext
from ..parallel.shard import kv_heads, num_blocks, q_heads
from .base import ScoringModel
from .caps import ModelCaps
from .gemma4_vision import Embedder, Gemma4VisionConfig, VisionTower
from .vision import ImageFormat

LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(slots=True)
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]
    layer_head_dims: tuple[int, ...]  # per block: head_dim (sliding) or the global head_dim (full)
    layer_kv_heads: tuple[int, ...]
    sliding_window: int
    rope: dict = field(default_factory=dict)  # layer type -> (theta, partial_rotary_factor, factor)
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    ple_dim: int = 0  # hidden_size_per_layer_input; 0: no per-layer embeddings
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 131072
    family: str = "gemma4_text"
    # the multimodal checkpoints' vision tower (``models.gemma4_vision``; None: text only), the ids
    # of the image tokens and of <|image> / <image|> around them, the id whose per-layer embedding
    # image tokens take, and whether image runs attend both ways on sliding blocks
    # (use_bidirectional_attention "vision")
    vision: Gemma4VisionConfig | None = None
    image_token_id: int | None = None
    boi_token_id: int | None = None
    eoi_token_id: int | None = None
    pad_token_id: int = 0
    vision_bidirectional: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "max_position_embeddings", "sliding_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LogprobeError(f"config.{name}", f"must be a positive integer, got {value!r}")
        for key, values in (("layer_types", self.layer_types), ("head_dim", self.layer_head_dims),
                            ("num_key_value_heads", self.layer_kv_heads)):
            if len(values) != self.num_layers:
                raise LogprobeError(f"config.{key}", f"{len(values)} per-layer entries for {self.num_layers} layers")
        for i, (t, d, kv) in enumerate(zip(self.layer_types, self.layer_head_dims, self.layer_kv_heads)):
            if t not in LAYER_TYPES:
                raise LogprobeError("config.layer_types", f"{t!r} is not a Gemma 4 layer type",
                                    f"use {' or '.join(LAYER_TYPES)}")
            if d < 2 or d % 2:
                raise LogprobeError("config.head_dim", f"layer {i}: head_dim {d} must be even for RoPE")
            if kv < 1 or self.num_heads % kv:
                raise LogprobeError("config.num_key_value_heads", f"layer {i}: {kv} does not divide "
                                    f"num_attention_heads {self.num_heads}")
        if self.hidden_activation not in ACTIVATIONS:
            raise LogprobeError("config.hidden_activation", f"{self.hidden_activation!r} is not in the native "
                                f"{self.family} model", "the released models use gelu_pytorch_tanh")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise LogprobeError("config.num_kv_shared_layers", f"{self.num_kv_shared_layers} of {self.num_layers} "
                                "layers: some earlier layer must compute the keys they share")
        for t in set(self.layer_types):
            if t not in self.rope:
                raise LogprobeError("config.rope_parameters", f"has no entry for {t}")
        orphans = [i for i in range(self.first_shared, self.num_layers) if i not in self.producers]
        if orphans:
            raise LogprobeError("config.num_kv_shared_layers", f"layers {orphans} share keys of a layer type no "
                                "earlier layer computes")

    @property
    def split_widths(self) -> tuple[int, ...]:
        """The widths tensor parallelism cuts (``parallel.shard.num_blocks``: the column block count)."""
        return (self.num_heads, self.hidden_size, self.intermediate_size, *([self.ple_dim] if self.ple_dim else []))

    @property
    def first_shared(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    @property
    def producers(self) -> dict[int, int]:
        """KV-shared block -> the block whose keys and values it reuses (the last earlier block of its type)."""
        out = {}
        for i in range(self.first_shared, self.num_layers):
            earlier = [j for j in range(self.first_shared) if self.layer_types[j] == self.layer_types[i]]
            if earlier:
                out[i] = earlier[-1]
        return out


def rope_table(head_dim: int, theta: float, partial: float, factor: float) -> torch.Tensor:
    """Gemma 4's inverse frequencies [head_dim / 2] (float32): theta^(-2i / head_dim) / factor for
    the first int(partial * head_dim / 2) pairs, 0 (no turn) for the rest. Computed in float32 as
    transformers computes them (its float64 forward keeps these float32 values too): the float64
    powers rounded once differ by an ulp, 3e-4 radians by position 5,000."""
    angles = int(partial * head_dim // 2)
    inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))  # float32
    return torch.cat([inv, inv.new_zeros(head_dim // 2 - angles)]) / factor


def keep_blocks(*layers: ColumnParallelLinear) -> None:
    """Deterministic mode's column blocks on layers that hold a single block (one kv head on a rank,
    or in the whole model): stated as one block of their width, so q | k | v fused keeps every
    product block-wide at every TP size (fused without, the product spans q's columns too and its
    width changes with the TP size, which rounds otherwise on CPU). Alone, one block is one
    product: the same as none. Models with one block (``ctx.blocks`` 1) have none anywhere."""
    for layer in layers:
        if layer is not None and layer.ctx.blocks > 1 and not layer.col_blocks:
            layer.col_blocks = [layer.out_features]


def rotate(x: torch.Tensor, cis: torch.Tensor, triton: bool) -> torch.Tensor:
    """``layers.rotary.apply_rotary`` (x [T, H, D] interleaved pairs, cis [T, D/2]) with each element's
    bits independent of the head count H on CPU, so a rank holding some of the heads rotates them as
    one process does. PyTorch's CPU complex multiply rounds its vectorised body otherwise than its
    scalar tail, and which elements fall in the tail depends on H when D/2 is not a whole number of
    vectors (head_dim 12: [T, 2, 6] runs per head with tails, [T, 1, 6] as one flat vector loop);
    separate real products and sums round every element alike on either path. CUDA: apply_rotary.

    >>> x, f = torch.randn(5, 2, 12), torch.randn(5, 6)
    >>> cis = torch.polar(torch.ones_like(f), f)
    >>> torch.equal(rotate(x, cis, False)[:, 1:], rotate(x[:, 1:].contiguous(), cis, False))  # head 1 alone
    True
    """
    if x.is_cuda:
        return apply_rotary(x, cis, triton)
    T, H, D = x.shape
    pairs = x.float().reshape(T, H, D // 2, 2)  # [T, H, D/2, 2]: (even, odd) dims of a pair
    re, im = pairs[..., 0], pairs[..., 1]
    c, s = cis.real[:, None, :], cis.imag[:, None, :]  # [T, 1, D/2]
    return torch.stack([re * c - im * s, re * s + im * c], dim=-1).reshape(T, H, D).to(x.dtype)


class Gemma4Attention(NumericsUser, nn.Module):
    def __init__(self, cfg: Gemma4Config, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        D, H, kv = cfg.layer_head_dims[layer_idx], cfg.hidden_size, cfg.layer_kv_heads[layer_idx]
        q0, q1 = q_heads(cfg.num_heads, ctx.rank, ctx.size)  # this rank's query heads and the kv heads they read
        k0, k1 = kv_heads(cfg.num_heads, kv, ctx.rank, ctx.size)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, D
        full = cfg.layer_types[layer_idx] == "full_attention"
        self.sliding_window = None if full else cfg.sliding_window
        self.shared = layer_idx >= cfg.first_shared  # reuses a producer's keys and values
        self.k_eq_v = cfg.attention_k_eq_v and full
        self.q_proj = ColumnParallelLinear(H, cfg.num_heads * D, False, ctx, rows=(q0 * D, q1 * D), head_dim=D)
        self.q_norm = Norm(D, cfg.rms_norm_eps)
        if not self.shared:
            kv_rows = dict(rows=(k0 * D, k1 * D), head_dim=D)
            self.k_proj = ColumnParallelLinear(H, kv * D, False, ctx, **kv_rows)
            self.v_proj = None if self.k_eq_v else ColumnParallelLinear(H, kv * D, False, ctx, **kv_rows)
            self.k_norm = Norm(D, cfg.rms_norm_eps)
            self.v_norm = Norm(D, cfg.rms_norm_eps, scale=False)
            keep_blocks(self.q_proj, self.k_proj, self.v_proj)
        self.o_proj = GatheredRowLinear(cfg.num_heads * D, H, False, ctx)
        self.qkv_proj: Linear | None = None

    def fuse(self) -> None:
        if not self.shared:
            self.qkv_proj = fuse_linears([self.q_proj, self.k_proj] + ([self.v_proj] if self.v_proj else []))

    def forward(self, x: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta,
                shared: dict[int, tuple[torch.Tensor, torch.Tensor]], producer: int | None) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        if self.shared:
            q = self.q_proj(x)
            k, v = shared[producer]
        else:
            nq, nkv = self.num_heads * D, self.num_kv_heads * D
            if self.qkv_proj is not None:
                parts = self.qkv_proj(x).split([nq, nkv] + ([nkv] if self.v_proj else []), dim=-1)
            else:
                parts = [self.q_proj(x), self.k_proj(x)] + ([self.v_proj(x)] if self.v_proj else [])
            q, k_raw = parts[0], parts[1].reshape(T, self.num_kv_heads, D)  # [T, Hkv, D]
            v = self.v_norm(k_raw if self.k_eq_v else parts[2].reshape(T, self.num_kv_heads, D))
            k = rotate(self.k_norm(k_raw), cis, self.numerics.triton)
            shared[self.layer_idx] = (k, v)  # a later KV-shared block of this type may read them
        q = rotate(self.q_norm(q.reshape(T, self.num_heads, D)), cis, self.numerics.triton)  # [T, Hq, D]
        # image runs attend both ways on sliding blocks only (transformers' create_masks_for_vision_model)
        o = packed_attention(q, k, v, meta, self.layer_idx, 1.0, self.sliding_window,
                             bidirectional=self.sliding_window is not None)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.num_heads * D))


class Gemma4MLP(NumericsUser, nn.Module):
    def __init__(self, hidden: int, inter: int, activation: str, ctx: ParallelContext) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inter, False, ctx)
        self.up_proj = ColumnParallelLinear(hidden, inter, False, ctx)
        self.down_proj = GatheredRowLinear(inter, hidden, False, ctx)
        self.approximate = ACTIVATIONS[activation]
        self.gate_up_proj: Linear | None = None

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(row_invariant(lambda g, u: F.gelu(g, approximate=self.approximate) * u, gate, up))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        self.producer = cfg.producers.get(layer_idx)
        self.points = tuple(f"blocks.{layer_idx}.{p}" for p in ("resid_pre", "attn_out", "resid_mid", "mlp_out",
                                                                 "resid_post"))
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        wide = 2 if cfg.use_double_wide_mlp and layer_idx >= cfg.first_shared else 1
        self.input_layernorm = Norm(H, eps)
        self.self_attn = Gemma4Attention(cfg, layer_idx, ctx)
        self.post_attention_layernorm = Norm(H, eps)
        self.pre_feedforward_layernorm = Norm(H, eps)
        self.mlp = Gemma4MLP(H, cfg.intermediate_size * wide, cfg.hidden_activation, ctx)
        self.post_feedforward_layernorm = Norm(H, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.ple = cfg.ple_dim > 0
        if self.ple:
            self.approximate = ACTIVATIONS[cfg.hidden_activation]
            self.per_layer_input_gate = ColumnParallelLinear(H, cfg.ple_dim, False, ctx)
            self.per_layer_projection = GatheredRowLinear(cfg.ple_dim, H, False, ctx)
            self.post_per_layer_input_norm = Norm(H, eps)
            self.ple_cols = self.per_layer_input_gate.tp_rows  # this rank's ple_dim columns [start, end)

    def forward(self, h: torch.Tensor, cis: dict, meta: AttentionMeta, shared: dict, ple: torch.Tensor | None,
                hooks: Hooks | None = None) -> torch.Tensor:
        hk = hooks if hooks is not None else (lambda _point, x: x)
        resid_pre, attn_out, resid_mid, mlp_out, resid_post = self.points
        h = hk(resid_pre, h)
        a = self.self_attn(self.input_layernorm(h), cis[self.layer_type], meta, shared, self.producer)
        h = hk(resid_mid, h + hk(attn_out, self.post_attention_layernorm(a)))
        h = h + hk(mlp_out, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))))
        if ple is not None:
            p0, p1 = self.ple_cols
            g = row_invariant(lambda x, e: F.gelu(x, approximate=self.approximate) * e,
                              self.per_layer_input_gate(h), ple[:, p0:p1].contiguous())  # [T, P / TP]
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return hk(resid_post, h * self.layer_scalar)


class Gemma4Model(ScoringModel):
    """Final hidden states for a packed batch (``forward(input_ids [T], positions [T], meta, hooks) -> [T, H]``).
    ``ctx``: this rank's tensor-parallel group (None: one rank; split as the module docstring says)."""

    caps = ModelCaps(context=True, hooks=True, tensor_parallel=True)

    def __init__(self, cfg: Gemma4Config, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.ctx = ctx = ctx or ParallelContext(blocks=num_blocks(*cfg.split_widths))
        self.shard_vocab(cfg, ctx)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i, ctx) for i in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.ple_dim:
            L, P = cfg.num_layers, cfg.ple_dim
            self.embed_tokens_per_layer = VocabParallelEmbedding(cfg.vocab_size, L * P, ctx, *self.vocab_range)
            # whole on every rank (normed per layer over all of ple_dim), in the same column blocks
            self.per_layer_model_projection = ColumnParallelLinear(cfg.hidden_size, L * P, False, ctx, rows=(0, L * P))
            self.per_layer_projection_norm = Norm(P, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.hidden_size, self.vocab_range, ctx)
        self.make_rotary()
        # the vision tower and embedder, small, are whole on every rank (replicated, not split):
        # each rank embeds the images of its pass alike, so tensor parallelism gives the one-rank
        # embeddings bitwise (deterministic mode: ``models.gemma4_vision``)
        here = cfg.vision is not None
        self.vision_tower = VisionTower(cfg.vision) if here else None
        self.embed_vision = Embedder(cfg.vision) if here else None

    @property
    def image_format(self) -> ImageFormat | None:
        """How prompts hold images (``models.vision``): the image token once per image, expanded to
        <|image> + its tokens + <image|> as ``Gemma4Processor`` does; bidirectional runs where the
        config says "vision" (on sliding blocks)."""
        cfg, v = self.config, self.config.vision
        if v is None:
            return None
        return ImageFormat(cfg.image_token_id, v.pooling_kernel_size, begin_id=cfg.boi_token_id,
                           end_id=cfg.eoi_token_id, bidirectional=cfg.vision_bidirectional)

    @property
    def tower_here(self) -> bool:
        return self.vision_tower is not None

    def encode_image(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [ph * pw, P * P * 3] -> its token embeddings [ph * pw / k², H]."""
        return self.embed_vision(self.vision_tower(pixel_values.to(self.embed_tokens.weight.device), grid))

    def make_rotary(self, device: torch.device | None = None) -> None:
        """One inverse-frequency table per layer type (non-persistent buffers, made again at load)."""
        cfg = self.config
        for t in set(cfg.layer_types):
            d = cfg.layer_head_dims[cfg.layer_types.index(t)]
            self.register_buffer(f"inv_freq_{t}", rope_table(d, *cfg.rope[t]).to(device), persistent=False)

    def head_params(self) -> HeadParams:
        return replace(super().head_params(), softcap=self.config.final_logit_softcapping)

    @staticmethod
    def interleave_rope_weights(cfg: Gemma4Config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint (rotate-half) q/k rows and q/k norm weights -> the interleaved layout; where the
        values are the raw keys (k_eq_v), o_proj's input columns follow the keys' permutation."""
        out = dict(state)
        for name, w in state.items():
            if ".self_attn." not in name or not name.startswith("layers."):  # the vision tower keeps its layout
                continue
            layer = int(name.split(".")[1])
            D = cfg.layer_head_dims[layer]
            if any(f".self_attn.{p}." in name for p in ("q_proj", "k_proj", "q_norm", "k_norm")):
                out[name] = to_interleaved(w, w.shape[0] // D)
            elif ".self_attn.o_proj." in name and cfg.attention_k_eq_v and cfg.layer_types[layer] == "full_attention":
                out[name] = to_interleaved(w.T, w.shape[1] // D).T.contiguous()  # [H, Hq * D] columns
        return out

    def fuse_projections(self) -> None:
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def _ple(self, ids: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
        """Per-layer inputs [T, L, P]: (norm(projection of h_0) + scaled per-layer embeddings) / sqrt(2)."""
        cfg = self.config
        L, P = cfg.num_layers, cfg.ple_dim
        e = self.embed_tokens_per_layer(ids)
        e = scaled(e, P ** 0.5)  # [T, L * P]
        proj = self.per_layer_model_projection(h0) * cfg.hidden_size ** -0.5  # [T, L * P]
        proj = self.per_layer_projection_norm(proj.reshape(-1, L, P))  # [T, L, P]
        return (proj + e.reshape(-1, L, P)) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta,
                hooks: Hooks | None = None, images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, H]. ``images``: (rows [n], embeddings
        [n, H]) that replace those rows after the scale; their per-layer embeddings are the pad
        token's (transformers looks the image tokens up as ``pad_token_id``)."""
        hooks = hooks or None
        if hooks is not None:
            self.check_hooks(hooks)
        h = self.embed_tokens(input_ids)  # [T, H]
        h = scaled(h, self.config.hidden_size ** 0.5)
        ple_ids = input_ids
        if images is not None:
            rows, embeds = images
            h = h.index_copy(0, rows, embeds.to(h.dtype))
            ple_ids = input_ids.index_fill(0, rows, self.config.pad_token_id)
        ple = self._ple(ple_ids, h) if self.config.ple_dim else None
        if hooks is not None:
            h = hooks("embed", h)
        cis = {}
        for t in set(self.config.layer_types):
            freqs = positions.float()[:, None] * getattr(self, f"inv_freq_{t}")[None, :]  # [T, D_t / 2]
            cis[t] = torch.polar(torch.ones_like(freqs), freqs)
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cis, meta, shared, ple[:, i] if ple is not None else None, hooks)
        h = self.norm(h)
        return h if hooks is None else hooks("final_norm", h)
