"""Gemma 3, natively: the text models (``gemma3_text``) and the text tower of the multimodal
``gemma3`` checkpoints (``loading.gemma``).

A packed batch is rows of token ids ([T]) with their positions and an ``AttentionMeta`` (see
``models.llama`` and ``layers.attention``). Per block l, with N(.) the (1 + w) RMSNorm
(``layers.norm.OffsetRMSNorm``: normalised and scaled in float32, one cast at the end, as
``Gemma3RMSNorm``):

    h_0     = embed(ids) * s                        # embed; s = sqrt(hidden) as a tensor of the model dtype
    a_l     = N_post_attn(Attn_l(N_in(h_l)))        # resid_pre l, attn_out l
    h'_l    = h_l + a_l                             # resid_mid l
    m_l     = N_post_ff(MLP_l(N_pre_ff(h'_l)))      # mlp_out l
    h_{l+1} = h'_l + m_l                            # resid_post l
    out     = N_final(h_L)                          # final_norm: fed to the log-prob head

    Attn_l:  q, k = N_q(x Wq), N_k(x Wk) per head, then RoPE (the block's own table), v = x Wv;
             softmax(q k^T * query_pre_attn_scalar^-1/2) v, causal, and for a ``sliding_attention``
             block only keys with q_pos - k_pos < sliding_window; o_proj.
    RoPE:    ``full_attention`` blocks rope_theta (with its scaling: default or linear);
             ``sliding_attention`` blocks their own base (``rope_local_base_freq``, or
             ``rope_parameters["sliding_attention"]`` in transformers 5).
    MLP_l:   down(gelu_tanh(x Wgate) * x Wup)       (``hidden_activation`` gelu_pytorch_tanh; gelu: exact)

The names on the right are hook points (``interp.points``): attn_out and mlp_out are what a block
adds to the residual stream, i.e. after the post-attention and post-feedforward norms.

Sliding windows under chunking and prefix sharing: ``packed_attention`` applies each block's
window per query against key positions (context spans of a shared prefix or a chunk cache hold
every earlier key, the window masks them), so a split never changes which keys a row sees.

Final logit soft-capping (``final_logit_softcapping``): in the log-prob head, in float32, before
the temperature. Not run (refused at load, key named, by ``loading.gemma``): attention logit
soft-capping, bidirectional attention (of text), attention bias.

Images (the multimodal checkpoints with their ``vision_config``): the SigLIP tower and projector
(``models.gemma3_vision``) give each image's rows, which replace its ``<image_soft_token>`` rows of
h_0 after the scale s; each run of image tokens is a bidirectional span of every block's attention
(a row inside it sees the keys up to the run's end, still within a sliding block's window).

Tensor parallelism as the Llama family (``GemmaModel``; ``loading.gemma.gemma_shard_tensors``); the
vision tower and projector whole on every rank, the spans run on each rank's own heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LogprobeError
from ..layers.activation import row_invariant
from ..layers.attention import AttentionMeta, packed_attention
from ..layers.embedding import scaled
from ..layers.hooks import Hooks
from ..layers.linear import Linear, fuse_linears
from ..layers.logprob_head import HeadParams
from ..layers.norm import OffsetRMSNorm
from ..layers.numerics import NumericsUser
from ..layers.parallel_linear import ColumnParallelLinear, GatheredRowLinear, ParallelLMHead
from ..layers.rotary import RotaryEmbedding, apply_rotary_pair, rope_inv_freq, to_interleaved
from ..parallel.context import ParallelContext
from ..parallel.shard import kv_heads, num_blocks, q_heads
from .base import FusedQKV, ScoringModel
from .caps import ModelCaps
from .gemma3_vision import Projector, SiglipConfig, VisionTower
from .vision import ImageFormat

LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_activation -> F.gelu's approximate


@dataclass(slots=True)
class GemmaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    query_pre_attn_scalar: float = 256.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # full_attention blocks
    rope_scaling: dict | None = None  # full_attention blocks: None or linear
    rope_local_theta: float = 10_000.0  # sliding_attention blocks
    rope_local_scaling: dict | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131072
    final_logit_softcapping: float | None = None  # the head's cap * tanh(logits / cap), float32
    family: str = "gemma3_text"
    extra: dict = field(default_factory=dict)
    # the multimodal checkpoints' vision tower (``models.gemma3_vision``; None: text only) and the
    # ids of the image tokens and of the <start_of_image> / <end_of_image> around them
    vision: SiglipConfig | None = None
    image_token_id: int | None = None
    boi_token_id: int | None = None
    eoi_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings", "sliding_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LogprobeError(f"config.{name}", f"must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise LogprobeError("config.num_key_value_heads",
                                f"{self.num_kv_heads} does not divide num_attention_heads {self.num_heads}")
        if self.head_dim % 2:
            raise LogprobeError("config.head_dim", f"must be even for RoPE, got {self.head_dim}")
        if len(self.layer_types) != self.num_layers:
            raise LogprobeError("config.layer_types", f"{len(self.layer_types)} entries for "
                                f"{self.num_layers} layers (num_hidden_layers)")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise LogprobeError("config.layer_types", f"{t!r} is not a Gemma 3 layer type",
                                    f"use {' or '.join(LAYER_TYPES)}")
        if self.hidden_activation not in ACTIVATIONS:
            raise LogprobeError("config.hidden_activation", f"{self.hidden_activation!r} is not in the native "
                                f"{self.family} model", "the released models use gelu_pytorch_tanh")
        if not self.query_pre_attn_scalar > 0:
            raise LogprobeError("config.query_pre_attn_scalar", f"must be positive, got {self.query_pre_attn_scalar!r}")
        cap = self.final_logit_softcapping
        if cap is not None and not (isinstance(cap, float) and 0 < cap < float("inf")):
            raise LogprobeError("config.final_logit_softcapping", f"must be a positive number or null, got {cap!r}")
        rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)  # rejects unknown rope types
        rope_inv_freq(self.head_dim, self.rope_local_theta, self.rope_local_scaling)

    @property
    def split_widths(self) -> tuple[int, ...]:
        return (self.num_heads, self.hidden_size, self.intermediate_size)


class GemmaAttention(FusedQKV, NumericsUser, nn.Module):
    def __init__(self, cfg: GemmaConfig, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which layer of a chunk's KV cache is ours
        q0, q1 = q_heads(cfg.num_heads, ctx.rank, ctx.size)  # this rank's query heads and the kv heads they read
        k0, k1 = kv_heads(cfg.num_heads, cfg.num_kv_heads, ctx.rank, ctx.size)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, cfg.head_dim
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = cfg.sliding_window if self.sliding else None
        D, H = cfg.head_dim, cfg.hidden_size
        self.q_proj = ColumnParallelLinear(H, cfg.num_heads * D, False, ctx, rows=(q0 * D, q1 * D), head_dim=D)
        self.k_proj = ColumnParallelLinear(H, cfg.num_kv_heads * D, False, ctx, rows=(k0 * D, k1 * D), head_dim=D)
        self.v_proj = ColumnParallelLinear(H, cfg.num_kv_heads * D, False, ctx, rows=(k0 * D, k1 * D), head_dim=D)
        self.o_proj = GatheredRowLinear(cfg.num_heads * D, H, False, ctx)
        self.q_norm = OffsetRMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.project_qkv(x)  # [T, Nq], [T, Nkv], [T, Nkv]
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))  # [T, Hq, D]
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_pair(q, k, cis, self.numerics.triton)
        o = packed_attention(q, k, v, meta, self.layer_idx, self.scale, self.sliding_window)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))  # [T, H]


class GemmaMLP(NumericsUser, nn.Module):
    def __init__(self, cfg: GemmaConfig, ctx: ParallelContext) -> None:
        super().__init__()
        H, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ColumnParallelLinear(H, inter, False, ctx)
        self.up_proj = ColumnParallelLinear(H, inter, False, ctx)
        self.down_proj = GatheredRowLinear(inter, H, False, ctx)
        self.approximate = ACTIVATIONS[cfg.hidden_activation]
        self.gate_up_proj: Linear | None = None

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # gelu(gate) rounded to the activation dtype, then * up, as transformers; each row's bits
        # independent of the row count on CPU (layers.activation.row_invariant)
        act = row_invariant(lambda g, u: F.gelu(g, approximate=self.approximate) * u, gate, up)
        return self.down_proj(act)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        self.points = tuple(f"blocks.{layer_idx}.{p}" for p in ("resid_pre", "attn_out", "resid_mid", "mlp_out",
                                                                 "resid_post"))
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(H, eps)
        self.self_attn = GemmaAttention(cfg, layer_idx, ctx)
        self.post_attention_layernorm = OffsetRMSNorm(H, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(H, eps)
        self.mlp = GemmaMLP(cfg, ctx)
        self.post_feedforward_layernorm = OffsetRMSNorm(H, eps)

    def forward(self, h: torch.Tensor, cis: dict[str, torch.Tensor], meta: AttentionMeta,
                hooks: Hooks | None = None) -> torch.Tensor:
        c = cis[self.layer_type]
        if hooks is None:
            h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), c, meta))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        resid_pre, attn_out, resid_mid, mlp_out, resid_post = self.points
        h = hooks(resid_pre, h)
        a = self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), c, meta))
        h = hooks(resid_mid, h + hooks(attn_out, a))
        m = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return hooks(resid_post, h + hooks(mlp_out, m))


class GemmaModel(ScoringModel):
    """Final hidden states for a packed batch (``forward(input_ids [T], positions [T], meta, hooks)
    -> [T, H]``); ``head_params()`` feeds the log-prob head. ``ctx``: this rank's tensor-parallel
    group (None: one rank), split as the Llama family (``models.llama``): a rank holds its query
    heads and the kv heads they read, its share of the MLP; the residual stream is whole on every
    rank, so the per-block norms and the q/k norms (per head) run unsplit."""

    caps = ModelCaps(context=True, hooks=True, tensor_parallel=True)

    def __init__(self, cfg: GemmaConfig, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.ctx = ctx = ctx or ParallelContext(blocks=num_blocks(*cfg.split_widths))
        self.shard_vocab(cfg, ctx)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, ctx) for i in range(cfg.num_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.make_rotary()
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.hidden_size, self.vocab_range, ctx)
        # the vision tower and projector, small, are whole on every rank (replicated, not split):
        # each rank embeds the images of its pass alike, so tensor parallelism gives the one-rank
        # embeddings bitwise (deterministic mode: ``models.gemma3_vision``)
        here = cfg.vision is not None
        self.vision_tower = VisionTower(cfg.vision) if here else None
        self.multi_modal_projector = Projector(cfg.vision) if here else None

    @property
    def image_format(self) -> ImageFormat | None:
        """How prompts hold images (``models.vision``): ``<start_of_image>`` once per image, expanded
        as ``Gemma3Processor`` does; the image tokens of one run attend to each other both ways."""
        cfg, v = self.config, self.config.vision
        if v is None:
            return None
        return ImageFormat(cfg.image_token_id, v.pool, placeholder_id=cfg.boi_token_id, begin_id=cfg.boi_token_id,
                           end_id=cfg.eoi_token_id, around="\n\n", bidirectional=True, patch_size=v.patch_size,
                           image_size=v.image_size)

    @property
    def tower_here(self) -> bool:
        return self.vision_tower is not None

    def encode_image(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [g², C * P * P] -> its token embeddings [mm_tokens_per_image, H]."""
        return self.multi_modal_projector(self.vision_tower(pixel_values.to(self.embed_tokens.weight.device)))

    def make_rotary(self, device: torch.device | None = None) -> None:
        """The two rotary tables (non-persistent buffers: made again on the real device at load)."""
        cfg = self.config
        self.rotary_global = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta, cfg.rope_local_scaling).to(device)

    @staticmethod
    def interleave_rope_weights(cfg: GemmaConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint (rotate-half) q/k rows and per-head q/k norm weights -> the interleaved
        layout ``apply_rotary`` expects."""
        out = dict(state)
        for name, w in state.items():
            if any(f".self_attn.{p}." in name for p in ("q_proj", "k_proj", "q_norm", "k_norm")):
                out[name] = to_interleaved(w, w.shape[0] // cfg.head_dim)
        return out

    def head_params(self) -> HeadParams:
        """The LM head with the final logit soft-cap, which the log-prob head applies in float32
        before the temperature (transformers: the model caps, generation then divides by T)."""
        return replace(super().head_params(), softcap=self.config.final_logit_softcapping)

    def fuse_projections(self) -> None:
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta,
                hooks: Hooks | None = None, images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, H]. ``images``: (rows [n], embeddings
        [n, H]) that replace those rows after the embedding's scale (``models.gemma3_vision``)."""
        hooks = hooks or None
        if hooks is not None:
            self.check_hooks(hooks)
        h = self.embed_tokens(input_ids)  # [T, H]
        h = scaled(h, self.config.hidden_size ** 0.5)  # transformers' Gemma3TextScaledWordEmbedding
        if images is not None:
            rows, embeds = images
            h = h.index_copy(0, rows, embeds.to(h.dtype))
        if hooks is not None:
            h = hooks("embed", h)
        types = set(self.config.layer_types)
        cis = {}
        if "full_attention" in types:
            cis["full_attention"] = self.rotary_global(positions)  # [T, D/2] complex
        if "sliding_attention" in types:
            cis["sliding_attention"] = self.rotary_local(positions)
        for layer in self.layers:
            h = layer(h, cis, meta, hooks)
        h = self.norm(h)
        return h if hooks is None else hooks("final_norm", h)
