"""The Llama family, natively: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM.

A packed batch is rows of token ids ([T]) with their positions and an ``AttentionMeta`` that
says which keys each row sees (its own sequence causally, plus a shared prefix or earlier chunks'
cached keys; see ``layers.attention``). The model has no batch mode of its own: everything about
the batch's layout comes in that explicit argument.

    h_0     = embed(ids)                            # embed
    h'_l    = h_l + Attn_l(RMSNorm(h_l))           # resid_pre l, attn_out l, resid_mid l
    h_{l+1} = h'_l + MLP_l(RMSNorm(h'_l))          # mlp_out l, resid_post l
    out     = RMSNorm(h_L)                          # final_norm: fed to the log-prob head

The names on the right are hook points (``interp.points``): an optional ``Hooks`` argument steers
and captures there, per packed row (``layers.hooks``); without it the forward is unchanged.

Tensor parallelism lives in the layers (``layers.parallel_linear``, ``layers.embedding``, the
vocabulary-sharded head): a rank holds its heads and its share of the MLP, and the residual
stream h is whole on every rank, so hooks see the full width whatever the TP size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import LogprobeError
from ..layers.attention import AttentionMeta, packed_attention
from ..layers.embedding import VocabParallelEmbedding
from ..layers.hooks import Hooks
from ..layers.linear import Linear, fuse_linears
from ..layers.norm import RMSNorm
from ..layers.numerics import NumericsUser
from ..layers.parallel_linear import ColumnParallelLinear, GatheredRowLinear, ParallelLMHead
from ..layers.rotary import RotaryEmbedding, apply_rotary_pair, rope_inv_freq, rotary_dim, to_interleaved
from ..parallel.context import ParallelContext
from ..parallel.shard import kv_heads, num_blocks, q_heads, vocab_chunk_width, vocab_shard
from .base import FusedQKV, ScoringModel, SplitSteps
from .caps import ModelCaps

if TYPE_CHECKING:
    from ..layers.moe import MoeSpec


@dataclass(slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False  # Qwen2: bias on q, k, v
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    qk_norm_full: bool = False  # OLMoE: RMSNorm over the whole q (and k) projection before RoPE
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # Mistral v0.1
    max_position_embeddings: int = 4096
    moe: MoeSpec | None = None  # a mixture of experts in place of the dense MLP (models.moe)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LogprobeError(f"config.{name}", f"must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise LogprobeError("config.num_key_value_heads",
                                f"{self.num_kv_heads} does not divide num_attention_heads {self.num_heads}")
        if self.head_dim % 2:
            raise LogprobeError("config.head_dim", f"must be even for RoPE, got {self.head_dim}")
        rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)  # rejects unknown rope types

    @property
    def split_widths(self) -> tuple[int, ...]:
        """The widths tensor parallelism cuts: query heads, hidden and intermediate sizes (and a
        shared expert's). ``parallel.shard.num_blocks`` of them is the model's column block count."""
        moe = () if self.moe is None else (self.moe.intermediate_size, self.moe.shared_intermediate_size)
        return (self.num_heads, self.hidden_size, self.intermediate_size, *(w for w in moe if w))


class LlamaAttention(FusedQKV, NumericsUser, nn.Module):
    """This rank's query heads and the kv heads they read (all of them with one rank)."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which layer of a chunk's KV cache is ours
        q0, q1 = q_heads(cfg.num_heads, ctx.rank, ctx.size)
        k0, k1 = kv_heads(cfg.num_heads, cfg.num_kv_heads, ctx.rank, ctx.size)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_window
        D, H, bias = cfg.head_dim, cfg.hidden_size, cfg.attention_bias
        self.q_proj = ColumnParallelLinear(H, cfg.num_heads * D, bias, ctx, rows=(q0 * D, q1 * D), head_dim=D)
        self.k_proj = ColumnParallelLinear(H, cfg.num_kv_heads * D, bias, ctx, rows=(k0 * D, k1 * D), head_dim=D)
        self.v_proj = ColumnParallelLinear(H, cfg.num_kv_heads * D, bias, ctx, rows=(k0 * D, k1 * D), head_dim=D)
        self.o_proj = GatheredRowLinear(cfg.num_heads * D, H, False, ctx)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        if cfg.qk_norm_full:  # over all heads at once: whole on every rank (``norm_full``)
            self.q_norm = RMSNorm(cfg.num_heads * D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.num_kv_heads * D, cfg.rms_norm_eps)
        self.qk_norm_full = cfg.qk_norm_full
        self.ctx, self.q_cols, self.k_cols = ctx, (q0 * D, q1 * D), (k0 * D, k1 * D)

    def forward(self, x: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.project_qkv(x)  # [T, Nq], [T, Nkv], [T, Nkv]
        if self.qk_norm_full:
            q, k = self.norm_full(q, self.q_norm, self.q_cols), self.norm_full(k, self.k_norm, self.k_cols)
        q = q.reshape(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_pair(q, k, cis, self.numerics.triton)
        o = packed_attention(q, k, v, meta, self.layer_idx, self.scale, self.sliding_window)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))  # [T, H]


    def norm_full(self, x: torch.Tensor, norm: RMSNorm, cols: tuple[int, int]) -> torch.Tensor:
        """RMSNorm over the whole projection (OLMoE, MiniMax-M2): x [T, this rank's heads * D] ->
        the same. Over several ranks the heads are gathered (copies), the whole row normalised as
        one rank does, and this rank's columns kept (``parallel_context`` asks kv heads not be
        replicated, so the gathered k is the whole k)."""
        if not self.ctx.parallel:
            return norm(x)
        return norm(self.ctx.gather_columns(x))[:, cols[0]:cols[1]].contiguous()  # [T, N] -> [T, N / size]


class LlamaMLP(NumericsUser, nn.Module):
    def __init__(self, cfg: LlamaConfig, ctx: ParallelContext) -> None:
        super().__init__()
        H, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ColumnParallelLinear(H, inter, False, ctx)
        self.up_proj = ColumnParallelLinear(H, inter, False, ctx)
        self.down_proj = GatheredRowLinear(inter, H, False, ctx)
        self.gate_up_proj: Linear | None = None  # set by fuse(): gate and up in one matmul

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, hooks: Hooks | None = None, rows=None) -> torch.Tensor:
        """x [T, H] -> [T, H]; ``rows`` (a split batch's ``RowSplit``) changes nothing: row by row."""
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj.gated(gate, up, self.numerics.triton)  # down_proj(silu_mul(gate, up)), fused where it can be


class LlamaDecoderLayer(SplitSteps, nn.Module):
    """``mlp``: what replaces the dense MLP (a ``layers.moe.MoeBlock``); it is called as ``mlp(x, hooks)``,
    or ``mlp(x, None, rows)`` on this rank's rows of a batch split by sequences (``meta.rows``)."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, ctx: ParallelContext, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.points = tuple(f"blocks.{layer_idx}.{p}" for p in ("resid_pre", "attn_out", "resid_mid", "mlp_out",
                                                                 "resid_post"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, ctx) if mlp is None else mlp

    def forward(self, h: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta, hooks: Hooks | None = None
                ) -> torch.Tensor:
        if hooks is None:
            h = h + self.self_attn(self.input_layernorm(h), cis, meta)  # resid_mid
            if meta.rows is not None:  # this rank's rows of a split batch: the experts gather them
                return h + self.mlp(self.post_attention_layernorm(h), None, meta.rows)
            return h + self.mlp(self.post_attention_layernorm(h))  # resid_post
        resid_pre, attn_out, resid_mid, mlp_out, resid_post = self.points
        h = hooks(resid_pre, h)
        h = hooks(resid_mid, h + hooks(attn_out, self.self_attn(self.input_layernorm(h), cis, meta)))
        return hooks(resid_post, h + hooks(mlp_out, self.mlp(self.post_attention_layernorm(h), hooks)))


class LlamaModel(ScoringModel):
    """Final hidden states for a packed batch; ``head_params()`` feeds the log-prob head. Its
    layers compute under the ``config.Numerics`` the engine hands it (``set_numerics``)."""

    caps = ModelCaps(context=True, hooks=True, tensor_parallel=True)

    def __init__(self, cfg: LlamaConfig, rope_freq_factors: torch.Tensor | None = None,
                 ctx: ParallelContext | None = None) -> None:
        """``ctx``: this rank's tensor-parallel group (None: one rank, the whole model)."""
        super().__init__()
        self.config = cfg
        self.ctx = ctx = ctx or ParallelContext(blocks=num_blocks(*cfg.split_widths))
        self.vocab_grid = vocab_chunk_width(cfg.vocab_size)
        self.vocab_range = self.vocab_range_of(cfg, ctx)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, *self.vocab_range)
        self.layers = nn.ModuleList(self.make_layer(cfg, i, ctx) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = self.make_rotary(rope_freq_factors)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.hidden_size, self.vocab_range, ctx)

    @property
    def cuda_graphs(self) -> bool:
        """``ScoringModel.cuda_graphs``, and not under LongRoPE, whose length check reads the
        positions on the host."""
        return super().cuda_graphs and getattr(self.rotary, "max_positions", None) is None

    def make_rotary(self, freq_factors: torch.Tensor | None = None) -> RotaryEmbedding:
        """The rotary table (a family with another rotary overrides this: ``models.qwen3_vl``);
        made again on the real device at load (its buffers are not in the checkpoint)."""
        cfg = self.config
        return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, freq_factors)

    def make_layer(self, cfg: LlamaConfig, layer_idx: int, ctx: ParallelContext) -> nn.Module:
        """Block ``layer_idx`` (a family with another MLP overrides this: ``models.moe``)."""
        return LlamaDecoderLayer(cfg, layer_idx, ctx)

    @staticmethod
    def vocab_range_of(cfg: LlamaConfig, ctx: ParallelContext) -> tuple[int, int]:
        """The vocabulary ids [start, end) of this rank's embedding and LM head rows."""
        return vocab_shard(cfg.vocab_size, vocab_chunk_width(cfg.vocab_size), ctx.rank, ctx.size)

    @staticmethod
    def interleave_rope_weights(cfg: LlamaConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint (rotate-half) q/k rows -> the interleaved layout ``apply_rotary`` expects."""
        out = dict(state)
        rot = rotary_dim(cfg.head_dim, cfg.rope_scaling)  # Phi-4-mini: partial rotation
        for name, w in state.items():  # per head, so a rank's shard of heads permutes the same way
            if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                out[name] = to_interleaved(w, w.shape[0] // cfg.head_dim, rot)
            elif ".self_attn.q_norm." in name or ".self_attn.k_norm." in name:
                out[name] = to_interleaved(w, w.shape[0] // cfg.head_dim)  # one head, or all (OLMoE)
        return out

    def fuse_projections(self) -> None:
        """At load: q/k/v and gate/up as single matmuls where their weights allow (plain dense
        layers, and activation-quantized ones that quantize their input alike: one quantization
        pass, one GEMM; other packed layers stay apart). The old names remain as views."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
