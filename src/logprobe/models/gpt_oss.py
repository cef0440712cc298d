"""gpt-oss (``gpt_oss``), natively: gpt-oss-20b and gpt-oss-120b, float or MXFP4 experts
(``loading.gpt_oss``).

A packed batch is rows of token ids ([T]) with their positions and an ``AttentionMeta`` (see
``models.llama`` and ``layers.attention``). Per block l, with N(.) an RMSNorm whose gain is applied
in float32 before the one cast (transformers' ``GptOssRMSNorm``):

    h_0     = embed(ids)                             # embed
    h'_l    = h_l + Attn_l(N_in(h_l))                # resid_pre l, attn_out l, resid_mid l
    h_{l+1} = h'_l + MoE_l(N_post(h'_l))             # mlp_out l, resid_post l (router: blocks.l.router)
    out     = N_final(h_L)                           # final_norm: fed to the log-prob head

    Attn_l:  q, k, v = x Wq + bq, x Wk + bk, x Wv + bv; q, k rotated (YaRN); per query head h
             o_h = sum_j exp(s_hj) v_j / (exp(sink_h) + sum_j exp(s_hj)),  s_hj = q_h . k_j / sqrt(D),
             causal, and for a ``sliding_attention`` block only keys with q_pos - k_pos < sliding_window;
             out = o Wo + bo. ``sink_h`` is a learned logit per head (``sinks``) that takes a share of
             the softmax and gives no value.
    RoPE:    YaRN as transformers computes it (``models.deepseek.rotary_parameters``: float32 inverse
             frequencies blending interpolation and extrapolation, cos and sin scaled by the
             attention factor), one table for every block.
    MoE_l:   ``layers.moe_gpt_oss``: router with bias, top-k over logits then softmax over the k,
             experts with biases and the clamped SwiGLU (alpha, limit, the (up + 1) factor).

Sliding windows under chunking and prefix sharing as Gemma 3 (``models.gemma``):
``packed_attention`` applies each block's window per query against key positions, so a split never
changes which keys a row sees; the sinks join each row's softmax alone, so they do not either.

Tensor parallelism (``ctx``): attention as the Llama family's (``models.llama``): a rank holds its
query heads with their sinks and q bias rows, the kv heads they read with their k/v bias rows, and
rows of o_proj's output with their bias rows (``GatheredRowLinear``: each output and its bias
computed once, on one rank, then gathered). The router is whole on every rank. Experts: with
``ctx.experts`` 1 (``expert_parallel_size``) whole on every rank, each rank computing every expert
of every token; with ``ctx.experts`` = the TP size each rank holds E / TP whole experts and computes
the slots routed to them (``layers.moe_gpt_oss``). Either way the same products as one rank, so
deterministic mode has one rank's bits. With whole experts per rank attention is by default
data-parallel (``ctx.attention`` "data", as the Llama-family mixtures of experts): attention and
the norms whole on every rank, each rank running its share of the batch's sequences
(``ScoringModel.forward``, two micro-batches), the experts gathering every rank's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import LogprobeError
from ..kernels import triton_available
from ..kernels.rmsnorm import invariant_rmsnorm
from ..layers.activation import row_invariant
from ..layers.attention import AttentionMeta, packed_attention
from ..layers.hooks import Hooks
from ..layers.moe_gpt_oss import GptOssMoe, GptOssMoeSpec
from ..layers.norm import RMSNorm
from ..layers.numerics import NumericsUser
from ..layers.parallel_linear import ColumnParallelLinear, GatheredRowLinear, ParallelLMHead
from ..layers.rotary import apply_rotary_pair, to_interleaved
from ..parallel.context import ParallelContext
from ..parallel.shard import kv_heads, num_blocks, q_heads
from .base import FusedQKV, ScoringModel, SplitSteps
from .caps import ModelCaps
from .deepseek import rotary_parameters
from .gemma4 import keep_blocks

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(slots=True)
class GptOssConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each expert's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    layer_types: tuple[str, ...]
    sliding_window: int
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict | None = None  # None (default rotary) or YaRN's parameters
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    family: str = "gpt_oss"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, key in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                          ("intermediate_size", "intermediate_size"), ("num_layers", "num_hidden_layers"),
                          ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                          ("head_dim", "head_dim"), ("num_experts", "num_local_experts"),
                          ("top_k", "num_experts_per_tok"), ("sliding_window", "sliding_window"),
                          ("max_position_embeddings", "max_position_embeddings")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LogprobeError(f"config.{key}", f"must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise LogprobeError("config.num_key_value_heads",
                                f"{self.num_kv_heads} does not divide num_attention_heads {self.num_heads}")
        if self.head_dim % 2:
            raise LogprobeError("config.head_dim", f"must be even for RoPE, got {self.head_dim}")
        if self.top_k > self.num_experts:
            raise LogprobeError("config.num_experts_per_tok", f"{self.top_k} of num_local_experts {self.num_experts}")
        if len(self.layer_types) != self.num_layers:
            raise LogprobeError("config.layer_types", f"{len(self.layer_types)} entries for {self.num_layers} layers "
                                "(num_hidden_layers)")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise LogprobeError("config.layer_types", f"{t!r} is not a gpt-oss layer type",
                                    f"use {' or '.join(LAYER_TYPES)}")
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ("default", "yarn"):
            raise LogprobeError("config.rope_parameters.rope_type", f"{kind!r} is not in the native gpt_oss model",
                                "the released models use yarn")
        rotary_parameters(self.head_dim, self.rope_theta, self.rope_scaling)  # missing yarn keys named

    @property
    def moe(self) -> GptOssMoeSpec:
        return GptOssMoeSpec(self.num_experts, self.top_k, self.intermediate_size, self.swiglu_alpha,
                             self.swiglu_limit)


class GainRMSNorm(RMSNorm):
    """RMSNorm with the gain applied in float32 and one cast at the end (``GptOssRMSNorm``; the
    Llama norm casts before its gain). On CUDA the row-wise Triton kernel, computing in float32
    and rounding once (``round_normed=False``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.numerics.deterministic or self.numerics.triton) and x.is_cuda and triton_available():
            return invariant_rmsnorm(x, self.weight.float(), self.eps, round_normed=False)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class YarnRotary(nn.Module):
    """Rotations ``factor * exp(i * pos * freq)`` [T, D/2] complex64 (YaRN's cos/sin factor as the
    modulus, as transformers scales cos and sin)."""

    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        inv, self.attention_factor = rotary_parameters(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        # each row's cos/sin bits independent of T (a narrow table's tail rows would round otherwise)
        return row_invariant(lambda f: torch.polar(torch.full_like(f, self.attention_factor), f), freqs)


class GptOssAttention(FusedQKV, NumericsUser, nn.Module):
    def __init__(self, cfg: GptOssConfig, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which layer of a chunk's KV cache is ours
        q0, q1 = q_heads(cfg.num_heads, ctx.rank, ctx.size)  # this rank's query heads and the kv heads they read
        k0, k1 = kv_heads(cfg.num_heads, cfg.num_kv_heads, ctx.rank, ctx.size)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = cfg.sliding_window if sliding else None
        D, H, bias = cfg.head_dim, cfg.hidden_size, cfg.attention_bias
        self.q_proj = ColumnParallelLinear(H, cfg.num_heads * D, bias, ctx, rows=(q0 * D, q1 * D), head_dim=D)
        self.k_proj = ColumnParallelLinear(H, cfg.num_kv_heads * D, bias, ctx, rows=(k0 * D, k1 * D), head_dim=D)
        self.v_proj = ColumnParallelLinear(H, cfg.num_kv_heads * D, bias, ctx, rows=(k0 * D, k1 * D), head_dim=D)
        self.o_proj = GatheredRowLinear(cfg.num_heads * D, H, bias, ctx)  # bias rows with the output rows
        self.sinks = nn.Parameter(torch.zeros(q1 - q0), requires_grad=False)  # [Hq / TP] logits, this rank's heads
        self.tp_param_ranges = {"sinks": ((q0, q1),)}  # rows of the checkpoint's [Hq] (``held_ranges``)
        keep_blocks(self.q_proj, self.k_proj, self.v_proj)  # q | k | v fused block by block at every TP size

    def forward(self, x: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.project_qkv(x)  # [T, Nq], [T, Nkv], [T, Nkv]
        q = q.reshape(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_pair(q, k, cis, self.numerics.triton)
        o = packed_attention(q, k, v, meta, self.layer_idx, self.scale, self.sliding_window, self.sinks)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))  # [T, H]


class GptOssDecoderLayer(SplitSteps, nn.Module):
    """Attention and the MoE; ``mlp(x, None, rows)`` on this rank's rows of a batch split by
    sequences (``meta.rows``: data-parallel attention, attention built whole on ``ctx.attention_ctx``)."""

    def __init__(self, cfg: GptOssConfig, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.points = tuple(f"blocks.{layer_idx}.{p}" for p in ("resid_pre", "attn_out", "resid_mid", "mlp_out",
                                                                 "resid_post"))
        self.input_layernorm = GainRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, layer_idx, ctx.attention_ctx)
        self.post_attention_layernorm = GainRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoe(cfg.moe, cfg.hidden_size, f"blocks.{layer_idx}.router", ctx)

    def forward(self, h: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta, hooks: Hooks | None = None
                ) -> torch.Tensor:
        if hooks is None:
            h = h + self.self_attn(self.input_layernorm(h), cis, meta)
            if meta.rows is not None:  # this rank's rows of a split batch: the experts gather them
                return h + self.mlp(self.post_attention_layernorm(h), None, meta.rows)
            return h + self.mlp(self.post_attention_layernorm(h))
        resid_pre, attn_out, resid_mid, mlp_out, resid_post = self.points
        h = hooks(resid_pre, h)
        h = hooks(resid_mid, h + hooks(attn_out, self.self_attn(self.input_layernorm(h), cis, meta)))
        return hooks(resid_post, h + hooks(mlp_out, self.mlp(self.post_attention_layernorm(h), hooks)))


class GptOssModel(ScoringModel):
    """Final hidden states for a packed batch (``ScoringModel.forward``); ``head_params()`` feeds
    the log-prob head. ``ctx``: this rank's tensor-parallel group (None: one rank)."""

    caps = ModelCaps(context=True, hooks=True, tensor_parallel=True)

    def __init__(self, cfg: GptOssConfig, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.ctx = ctx = ctx or ParallelContext(blocks=num_blocks(cfg.num_heads, cfg.hidden_size))
        self.shard_vocab(cfg, ctx)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i, ctx) for i in range(cfg.num_layers))
        self.norm = GainRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = YarnRotary(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.hidden_size, self.vocab_range, ctx)
        self.router_points = frozenset(f"blocks.{i}.router" for i in range(cfg.num_layers))

    def make_rotary(self, device: torch.device | None = None) -> None:
        """The rotary table (a non-persistent buffer: made again on the real device at load)."""
        self.rotary = YarnRotary(self.config).to(device)

    @staticmethod
    def interleave_rope_weights(cfg: GptOssConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint (rotate-half) q/k rows and biases -> the interleaved layout ``apply_rotary`` expects."""
        out = dict(state)
        for name, w in state.items():
            if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                out[name] = to_interleaved(w, w.shape[0] // cfg.head_dim)
        return out

    def fuse_projections(self) -> None:
        for layer in self.layers:
            layer.self_attn.fuse()
