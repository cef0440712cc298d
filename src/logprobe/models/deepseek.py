"""DeepSeek-V3-style models, natively (``deepseek_v3``: DeepSeek-V3 / V3.1, Kimi K2, Moonlight).

The residual stream is the Llama one; the token mixer is multi-head latent attention (MLA) and
every block from ``first_k_dense_replace`` on routes each token to experts:

    h_0     = embed(ids)                                  # embed
    h'_l    = h_l + MLA_l(RMSNorm(h_l))                   # resid_pre l, attn_out l, resid_mid l
    h_{l+1} = h'_l + MLP_l(RMSNorm(h'_l))                 # mlp_out l, resid_post l
    out     = RMSNorm(h_L)                                # final_norm: fed to the log-prob head

Multi-head latent attention, per token x (n heads; dims: nope + rope for q and k, v_head_dim for v):

    q       = W_qb RMSNorm(W_qa x)    (q_lora_rank set)   or   W_q x    (q_lora_rank null)
    q_h     = [q_h^nope | q_h^rope]                       per head: nope, then rope dims
    [c | k^rope] = W_kva x                                c: the compressed kv [kv_lora_rank]; k^rope: one shared key
    [k_h^nope | v_h] = (W_kvb RMSNorm(c))_h               per head: nope key dims, then v_head_dim value dims
    k_h     = [k_h^nope | rope(k^rope)],   q_h = [q_h^nope | rope(q_h^rope)]
    MLA(x)  = W_o concat_h softmax(q_h . k_h * scale) v_h
    scale   = (nope + rope)^-1/2, times mscale^2 with YaRN and mscale_all_dim,
              mscale = 0.1 * mscale_all_dim * ln(factor) + 1 (factor > 1)

The two latent norms use eps 1e-6 whatever ``rms_norm_eps`` says (as transformers builds them).
Rotary: YaRN's inverse frequencies and its cos/sin factor (``attention_factor``, 1 where mscale ==
mscale_all_dim) over the rope dims only. ``rope_interleave`` (the released checkpoints) means the
rope dims already pair (2j, 2j + 1), the layout ``layers.rotary.apply_rotary`` rotates; otherwise
the rope rows of W_q / W_qb (per head) and of W_kva are permuted to it at load (q and k alike, so
every q . k is unchanged).

Why k and v are materialised per head (no weight absorption): scoring is prefill only, where the
expanded form is the definition itself (exact, no reassociation of W_kvb into the query), and the
project's packed attention (shared prefixes, chunk caches, deterministic tiles) runs on it as it
is. The absorbed form only pays off when decoding against a long cache of latents. The value heads
are zero-padded to the q/k head dim (or q and k to v's if that is wider) so one ``packed_attention``
call serves both; zero columns change no attention weight and are sliced off the output.

MLP: a SwiGLU of ``intermediate_size`` in blocks ``0 .. first_k_dense_replace - 1``; in the others a
mixture of experts with DeepSeek's router (``layers.moe``, router ``sigmoid_grouped``): sigmoid
scores from a float32 router, a score-correction bias used to choose experts only, ``n_group``
groups of which the ``topk_group`` best survive, ``norm_topk_prob``, ``routed_scaling_factor``,
plus ``n_shared_experts * moe_intermediate_size`` wide shared SwiGLU added ungated:

    h_{l+1} = h'_l + sum_j w_j Expert_{ids_j}(x) + Shared_l(x),   x = RMSNorm(h'_l)   # router: blocks.l.router

The router point offers the sigmoid scores [T, E] (capture only). Float checkpoints only (FP8
block-quantized ones are refused).

Over several ranks MLA splits by heads: q_proj / q_b_proj and kv_b_proj are column-parallel (a
rank's heads' rows), o_proj gathered-row; the low-rank q_a_proj, kv_a_proj_with_mqa and their norms
are whole on every rank (they are shared by all heads, and small). Dense and shared MLPs split as
Llama's, the routed experts by ``ctx.experts`` (``layers.moe.Experts``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LogprobeError
from ..layers.activation import row_invariant
from ..layers.attention import AttentionMeta, packed_attention
from ..layers.hooks import Hooks
from ..layers.linear import Linear
from ..layers.moe import MoeBlock, MoeSpec
from ..layers.norm import RMSNorm
from ..layers.numerics import NumericsUser
from ..layers.parallel_linear import ColumnParallelLinear, GatheredRowLinear, ParallelLMHead
from ..layers.rotary import apply_rotary, rope_inv_freq, to_interleaved
from ..parallel.context import ParallelContext
from ..parallel.shard import num_blocks, q_heads
from .base import ScoringModel, SplitSteps
from .caps import ModelCaps
from .llama import LlamaMLP

LATENT_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with its default eps


@dataclass(slots=True)
class DeepseekConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense blocks' MLP
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe: MoeSpec
    first_k_dense_replace: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None (default rotary) or YaRN's parameters (rope_type "yarn")
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    family: str = "deepseek_v3"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, key in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                          ("intermediate_size", "intermediate_size"), ("num_layers", "num_hidden_layers"),
                          ("num_heads", "num_attention_heads"), ("kv_lora_rank", "kv_lora_rank"),
                          ("qk_rope_head_dim", "qk_rope_head_dim"), ("v_head_dim", "v_head_dim"),
                          ("max_position_embeddings", "max_position_embeddings")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LogprobeError(f"config.{key}", f"must be a positive integer, got {value!r}")
        if isinstance(self.qk_nope_head_dim, bool) or not isinstance(self.qk_nope_head_dim, int) \
                or self.qk_nope_head_dim < 0:
            raise LogprobeError("config.qk_nope_head_dim", f"must be a non-negative integer, got "
                                f"{self.qk_nope_head_dim!r}")
        if self.q_lora_rank is not None and (isinstance(self.q_lora_rank, bool) or not isinstance(self.q_lora_rank, int)
                                             or self.q_lora_rank < 1):
            raise LogprobeError("config.q_lora_rank", f"must be a positive integer or null, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise LogprobeError("config.qk_rope_head_dim", f"must be even for RoPE, got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise LogprobeError("config.first_k_dense_replace", f"{self.first_k_dense_replace} is not in "
                                f"0 .. num_hidden_layers ({self.num_layers})")
        rotary_parameters(self.qk_rope_head_dim, self.rope_theta, self.rope_scaling)  # refuses what it cannot run

    @property
    def split_widths(self) -> tuple[int, ...]:
        """The widths tensor parallelism cuts (``LlamaConfig.split_widths``): heads, hidden, the dense,
        expert and shared-expert intermediate sizes."""
        dense = self.intermediate_size if self.first_k_dense_replace else 0
        return tuple(w for w in (self.num_heads, self.hidden_size, dense, self.moe.intermediate_size,
                                 self.moe.shared_intermediate_size) if w)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """The softmax scale: (nope + rope)^-1/2, times mscale^2 with YaRN's ``mscale_all_dim``."""
        scale = self.qk_head_dim ** -0.5
        s = self.rope_scaling or {}
        if s.get("mscale_all_dim"):
            m = yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"]))
            scale = scale * m * m
        return scale


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1). DeepSeek-V3
    (factor 40, mscale_all_dim 1) multiplies its softmax scale by its square:

    >>> round(yarn_mscale(40.0, 1.0), 4), yarn_mscale(1.0, 1.0)
    (1.3689, 1.0)
    """
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_parameters(dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] float32, cos/sin factor) as transformers computes them: the
    default rotary, or YaRN (``_compute_yarn_parameters``, float32). Other rope types are refused."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"
    if kind == "default":
        return rope_inv_freq(dim, theta, None).float(), 1.0
    if kind != "yarn":
        raise LogprobeError("config.rope_parameters.rope_type", f"{kind!r} is not in the native deepseek_v3 "
                            "model", "the released models use yarn (or the default rotary)")
    s = scaling
    for key in ("factor", "original_max_position_embeddings"):
        if s.get(key) is None:
            raise LogprobeError(f"config.rope_parameters.{key}", "is missing (yarn needs it)")
    factor, old_ctx = float(s["factor"]), float(s["original_max_position_embeddings"])
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies kept), 0: interpolate (divided by factor)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class DeepseekRotary(nn.Module):
    """Rotations over the rope dims: ``factor * exp(i * pos * freq)`` [T, rope/2] complex64 (YaRN's
    cos/sin factor folded into the rotation's modulus, as transformers scales cos and sin)."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        inv, self.attention_factor = rotary_parameters(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rope/2]
        # each row's cos/sin bits independent of T (a narrow table's tail rows would round otherwise)
        return row_invariant(lambda f: torch.polar(torch.full_like(f, self.attention_factor), f), freqs)


def rotate(x: torch.Tensor, cis: torch.Tensor, triton: bool) -> torch.Tensor:
    """``apply_rotary`` with each element's bits independent of the shape on CPU: x [T, n, rope]
    (interleaved pairs) by cis [T, rope/2]. PyTorch's CPU complex multiply runs SIMD chunks and a
    scalar tail that round differently, and with rope/2 = 4 complex values per head where the tail
    falls moves with T and with the number of heads (a rank's at TP = 4: one); so on CPU the
    product is four real multiplies and two adds, each rounded once whatever the path. CUDA runs
    ``apply_rotary`` (no tail there).

    >>> x, cis = torch.randn(5, 4, 8), torch.polar(torch.full((5, 4), 1.3), torch.randn(5, 4))
    >>> torch.equal(rotate(x, cis, False)[:, 1:2], rotate(x[:, 1:2].contiguous(), cis, False))
    True
    """
    if x.is_cuda:
        return apply_rotary(x, cis, triton)
    T, n, D = x.shape
    pairs = x.float().reshape(T, n, D // 2, 2)  # [T, n, rope/2, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cis.real[:, None, :], cis.imag[:, None, :]  # [T, 1, rope/2]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(T, n, D).to(x.dtype)


class MultiHeadLatentAttention(NumericsUser, nn.Module):
    """MLA as in the module docstring, k and v expanded per head for ``packed_attention``."""

    def __init__(self, cfg: DeepseekConfig, layer_idx: int, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        ctx = ctx or ParallelContext()
        self.layer_idx = layer_idx
        H, n, bias = cfg.hidden_size, cfg.num_heads, cfg.attention_bias
        h0, h1 = q_heads(n, ctx.rank, ctx.size)  # this rank's heads
        self.num_heads, self.nope, self.rope, self.v_dim = h1 - h0, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank, self.scale = cfg.kv_lora_rank, cfg.scale
        Dq, Dkv = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim

        def heads_of(in_features: int, width: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(in_features, n * width, False, ctx, rows=(h0 * width, h1 * width), head_dim=width)

        if cfg.q_lora_rank is None:
            self.q_proj = heads_of(H, Dq)
        else:
            self.q_a_proj = Linear(H, cfg.q_lora_rank, bias)  # whole on every rank
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_EPS)
            self.q_b_proj = heads_of(cfg.q_lora_rank, Dq)
        self.q_lora = cfg.q_lora_rank is not None
        self.kv_a_proj_with_mqa = Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias)  # whole on every rank
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_EPS)
        self.kv_b_proj = heads_of(cfg.kv_lora_rank, Dkv)
        self.o_proj = GatheredRowLinear(n * cfg.v_head_dim, H, bias, ctx)

    def fuse(self) -> None:
        """Nothing to fuse: each projection reads a different input."""

    def forward(self, x: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        T, n, nope, rope, dv = x.shape[0], self.num_heads, self.nope, self.rope, self.v_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(T, n, nope + rope)  # [T, n, nope + rope]
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, rope], dim=-1)  # [T, r_kv], [T, rope]
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(T, n, nope + dv)  # [T, n, nope + dv]
        k_nope, v = kv.split([nope, dv], dim=-1)  # [T, n, nope], [T, n, dv]
        q_rope = rotate(q[..., nope:].contiguous(), cis, self.numerics.triton)  # [T, n, rope]
        k_rope = rotate(k_rope.contiguous().view(T, 1, rope), cis, self.numerics.triton)  # [T, 1, rope]
        q = torch.cat([q[..., :nope], q_rope], dim=-1)  # [T, n, D], D = nope + rope
        k = torch.cat([k_nope, k_rope.expand(T, n, rope)], dim=-1)  # [T, n, D]
        D = nope + rope
        width = max(D, dv)  # one head dim for q, k and v: zero-padded (see the module docstring)
        if D < width:
            q, k = F.pad(q, (0, width - D)), F.pad(k, (0, width - D))
        if dv < width:
            v = F.pad(v, (0, width - dv))
        o = packed_attention(q.contiguous(), k.contiguous(), v.contiguous(), meta, self.layer_idx, self.scale)
        return self.o_proj(o[..., :dv].reshape(T, n * dv))  # [T, H]


class DeepseekDecoderLayer(SplitSteps, nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.points = tuple(f"blocks.{layer_idx}.{p}" for p in ("resid_pre", "attn_out", "resid_mid", "mlp_out",
                                                                 "resid_post"))
        dense = ctx.attention_ctx  # whole on every rank under data-parallel attention
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(cfg, layer_idx, dense)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer_idx < cfg.first_k_dense_replace:
            self.mlp = LlamaMLP(cfg, dense)
        else:
            shared = None
            if cfg.moe.shared_intermediate_size:
                shared = LlamaMLP(dataclasses.replace(cfg, intermediate_size=cfg.moe.shared_intermediate_size), dense)
            self.mlp = MoeBlock(cfg.moe, cfg.hidden_size, f"blocks.{layer_idx}.router", shared, ctx)

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


class DeepseekModel(ScoringModel):
    """Final hidden states for a packed batch (``forward(input_ids [T], positions [T], meta, hooks)
    -> [T, H]``); ``head_params()`` feeds the log-prob head. ``ctx``: this rank's tensor-parallel
    group (None: one rank)."""

    caps = ModelCaps(context=True, hooks=True, tensor_parallel=True)

    def __init__(self, cfg: DeepseekConfig, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.ctx = ctx = ctx or ParallelContext(blocks=num_blocks(*cfg.split_widths))
        self.shard_vocab(cfg, ctx)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, ctx) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = DeepseekRotary(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.hidden_size, self.vocab_range, ctx)
        self.router_points = frozenset(m.router_point for m in self.modules() if isinstance(m, MoeBlock))

    @staticmethod
    def interleave_rope_weights(cfg: DeepseekConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rotate-half rope rows (``rope_interleave`` false) -> the interleaved layout ``apply_rotary``
        expects: each head's last ``qk_rope_head_dim`` rows of q_proj / q_b_proj, and the last
        ``qk_rope_head_dim`` rows of kv_a_proj_with_mqa (weight and bias). Interleaved checkpoints
        pass through."""
        if cfg.rope_interleave:
            return state
        out = dict(state)
        r = cfg.qk_rope_head_dim
        for name, w in state.items():
            if ".self_attn.q_proj." in name or ".self_attn.q_b_proj." in name:
                n = w.shape[0] // cfg.qk_head_dim  # all heads, or a rank's
                heads = w.reshape(n, cfg.qk_head_dim, *w.shape[1:])
                rot = to_interleaved(heads[:, cfg.qk_nope_head_dim:].reshape(-1, *w.shape[1:]), n)
                out[name] = torch.cat([heads[:, :cfg.qk_nope_head_dim],
                                       rot.reshape(n, r, *w.shape[1:])], dim=1).reshape(w.shape)
            elif ".self_attn.kv_a_proj_with_mqa." in name:
                out[name] = torch.cat([w[:cfg.kv_lora_rank], to_interleaved(w[cfg.kv_lora_rank:], 1)])
        return out

    def fuse_projections(self) -> None:
        """At load: the MLPs' gate/up as one matmul (shared experts' too); the old names remain views."""
        for layer in self.layers:
            layer.mlp.fuse()
