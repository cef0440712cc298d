"""The hybrid linear-attention Qwen families, natively: Qwen3-Next (``qwen3_next``), Qwen3.5 dense
(``qwen3_5_text``, also the text model of the multimodal ``qwen3_5``) and Qwen3.5 MoE
(``qwen3_5_moe_text`` inside ``qwen3_5_moe``).

Their blocks interleave two token mixers, ``config.layer_types[l]`` saying which (the released
models: three linear-attention blocks before each full-attention one). The residual stream is the
Llama one, with RMSNorms that store an offset from one (``N(x) = x / rms(x) * (1 + w)``,
``layers.norm.OffsetRMSNorm``):

    h_0     = embed(ids)                                  # embed
    h'_l    = h_l + Mix_l(N(h_l))                         # resid_pre l, attn_out l, resid_mid l
    h_{l+1} = h'_l + MLP_l(N(h'_l))                       # mlp_out l, resid_post l
    out     = N(h_L)                                      # final_norm: fed to the log-prob head

Linear attention (Gated DeltaNet; the core is ``layers.linear_state.packed_gated_delta``, which
takes each packed segment's state from the ``AttentionMeta``: fresh, a chunk cache, or a shared
prefix's end):

    [q | k | v] = silu(conv1d(W_qkv x))                   causal depthwise conv, width K
    g = -exp(A_log) * softplus(W_a x + dt_bias),  beta = sigmoid(W_b x)
    o = GatedDeltaRule(q, k, v, g, beta)                  per value head, see layers.gated_delta
    Mix(x) = W_out (w * o / rms(o) * silu(W_z x))         per-head gated norm, weight as stored

Gated full attention (a Qwen3 attention whose q projection also yields a per-channel gate):

    [q_h | gate_h] = (W_q x)_h                            per head h: D query rows, then D gate rows
    q_h, k_h = N_q(q_h), N_k(k_h)                         (1 + w) RMSNorm per head
    q_h, k_h = rope(q_h[:r]) ++ q_h[r:], ...              partial rotary: first r = D * partial_rotary_factor dims
    Mix(x) = W_o (Attention(q, k, v) * sigmoid(gate))

Qwen3.5's multimodal rotary (``mrope_section``) rotates frequency bands by the temporal, height
and width positions; for text all three are the token's position, so it is the plain rotary above.
With images (``qwen3_5_vision``) the positions are [3, T] rows (``qwen3_5_vision.mrope_positions``,
``layers.rotary.MRotaryEmbedding``) and the image tokens' rows of h_0 are the vision tower's output
in place of their token embeddings (``ScoringModel.forward``'s ``images``).

MLP: a SwiGLU (Qwen3.5 dense; Qwen3-Next's ``mlp_only_layers``), or a routed mixture of experts
with a shared expert behind a sigmoid gate (``layers.moe.MoeBlock``): softmax in float32, top k,
renormalised over the k (Qwen3.5 MoE always; Qwen3-Next when ``norm_topk_prob``).

Checkpoints: Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` are cut into Qwen3.5's
``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` at load
(``layers.gated_delta.split_qwen3_next_projections``); the conv weight [C, 1, K] is kept [C, K]
(``conv_weight``); q/k rows are permuted to the interleaved rotary layout on their first r dims
(``interleave_rope_weights``).

Tensor parallelism lives in the layers, as Llama's: a rank holds its heads and its share of the
MLP, the residual stream is whole on every rank; the MoE variants split their experts by
``ctx.experts`` (``layers.moe``). With whole experts per rank their layout is by data by default
(``ctx.attention`` "data", as the Llama-family mixtures of experts): mixers, dense MLPs, shared
experts and norms whole on every rank, each rank running its share of the batch's sequences (a
sequence's linear-attention state stays on its rank; ``ScoringModel.forward``, two
micro-batches), the experts gathering every rank's rows. Split by heads, the mixer's rows: ``in_proj_qkv`` (and the conv's channels) its key heads of q
and of k and its value heads of v, three ranges (``SegmentedColumnLinear``); ``in_proj_z``,
``in_proj_a`` / ``in_proj_b``, A_log and dt_bias its value heads; ``out_proj`` and ``o_proj``
gathered-row layers. Gated attention's q_proj rows are its heads' 2 D blocks (query and gate); k/v
by kv head. Every head's core (conv, rule, gated norm, attention) sees only its own channels, and
every projection states its column blocks (``_state_blocks``), so deterministic mode's bits are
the same at every TP size dividing the column block count: checked on CPU (the reference rule,
tests/test_hybrid_tp.py). On CUDA fla-core's rule kernels grid per head, but their autotune keys
include the head counts (H, HV: Hk / TP, Hv / TP), so a split may pick other tiles: TP = 2 vs 1
bits there are not yet checked on a GPU (pinning fla's configs in deterministic mode would settle it).

Cuts: the engine shares prefixes and cuts long requests only at multiples of the rule's 64-token
chunk from a sequence's start (``caps.state_align``), where the chunked rule reproduces a whole
run's bits. On CUDA the rule and conv come from ``kernels.gated_delta`` (the float32 references
on CPU): fla-core's rule for bf16 / fp16 activations when it imports (else a batched PyTorch
rule, one chunk at a time in deterministic mode: ``gated_delta_kernels``), and the Triton conv (``kernels.short_conv``, which
computes each channel alone, so TP cannot move its bits either); every per-row norm (the (1 + w)
ones and the gated output norm) reduces each row alone (``kernels.rmsnorm``), so deterministic
mode's numbers do not depend on what is packed beside a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import LogprobeError
from ..kernels import triton_available
from ..kernels.gated_delta import gated_delta_kernels
from ..kernels.rmsnorm import gated_rmsnorm, gated_rmsnorm_reference, gated_rmsnorm_supports
from ..layers.activation import row_invariant
from ..layers.attention import AttentionMeta, packed_attention
from ..layers.gated_delta import CHUNK_SIZE, GatedRMSNorm, gated_rms_norm
from ..layers.hooks import Hooks
from ..layers.linear import Linear, fuse_linears
from ..layers.linear_state import DeltaInputs, packed_gated_delta
from ..layers.moe import MoeBlock, MoeSpec
from ..layers.norm import OffsetRMSNorm
from ..layers.numerics import NumericsUser
from ..layers.parallel_linear import (
    ColumnParallelLinear,
    GatheredRowLinear,
    ParallelLMHead,
    SegmentedColumnLinear,
)
from ..layers.rotary import MRotaryEmbedding, RotaryEmbedding, apply_rotary, rope_inv_freq
from ..parallel.context import ParallelContext
from ..parallel.shard import kv_heads, num_blocks, q_heads, shard_range
from .base import ScoringModel, SplitSteps
from .caps import ModelCaps
from .llama import LlamaMLP
from .qwen3_5_vision import QwenImages, VisionConfig, VisionTower

LAYER_TYPES = ("linear_attention", "full_attention")
_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"}


@dataclass(slots=True)
class HybridConfig:
    """The text model of a hybrid checkpoint (``loading.hybrid.hybrid_config`` reads it); errors
    name the checkpoint's config keys."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int  # full attention
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    intermediate_size: int = 0  # the dense MLP's width (0: every block is a mixture of experts)
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    moe: MoeSpec | None = None
    family: str = "qwen3_5_text"  # the text model_type
    # Qwen3.5's multimodal rotary (rope_parameters.mrope_section; None: the plain rotary), its vision
    # tower and the id of its image tokens (None: a text-only checkpoint)
    mrope_section: tuple[int, int, int] | None = None
    vision: VisionConfig | None = None
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LogprobeError(f"config.{_KEYS.get(name, name)}", f"must be a positive integer, got {value!r}")
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.num_layers:
            raise LogprobeError("config.layer_types", f"{len(self.layer_types)} entries for num_hidden_layers "
                                f"{self.num_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise LogprobeError("config.layer_types", f"unknown layer type {unknown[0]!r}",
                                f"the native model runs {' and '.join(LAYER_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise LogprobeError("config.num_key_value_heads",
                                f"{self.num_kv_heads} does not divide num_attention_heads {self.num_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise LogprobeError("config.linear_num_value_heads", f"{self.linear_num_value_heads} is not a multiple "
                                f"of linear_num_key_heads {self.linear_num_key_heads}")
        r = self.rotary_dim
        if not 0 < r <= self.head_dim or r % 2:
            raise LogprobeError("config.partial_rotary_factor", f"{self.partial_rotary_factor} of head_dim "
                                f"{self.head_dim} gives {r} rotary dims: must be even and in 2..head_dim")
        if self.moe is None and self.intermediate_size < 1:
            raise LogprobeError("config.intermediate_size", f"must be a positive integer, got {self.intermediate_size!r}")
        if self.moe is not None and self.moe.dense_layers and self.intermediate_size < 1:
            raise LogprobeError("config.intermediate_size", "dense blocks (mlp_only_layers / decoder_sparse_step) "
                                f"need a positive intermediate_size, got {self.intermediate_size!r}")
        rope_inv_freq(r, self.rope_theta, self.rope_scaling)  # rejects unknown rope types

    @property
    def split_widths(self) -> tuple[int, ...]:
        """The widths tensor parallelism cuts (``LlamaConfig.split_widths``): attention heads, hidden
        and intermediate sizes, the linear-attention key and value heads."""
        moe = () if self.moe is None else (self.moe.intermediate_size, self.moe.shared_intermediate_size)
        dense = self.intermediate_size if self.moe is None or self.moe.dense_layers else 0
        return (self.num_heads, self.hidden_size, *(w for w in (dense, *moe) if w),
                self.linear_num_key_heads, self.linear_num_value_heads)

    @property
    def rotary_dim(self) -> int:
        """Rotary dims at the start of each head (transformers: ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def dense_mlp(self, layer_idx: int) -> bool:
        return self.moe is None or layer_idx in self.moe.dense_layers


@dataclass(slots=True)
class _MlpWidths:  # what LlamaMLP reads of a config
    hidden_size: int
    intermediate_size: int


def _swiglu(hidden: int, inter: int, ctx: ParallelContext) -> LlamaMLP:
    """``down(silu(gate x) * up x)``: the dense MLP and the shared expert."""
    return LlamaMLP(_MlpWidths(hidden, inter), ctx)


def _state_blocks(*layers: Linear) -> None:
    """A layer holding a single column block states it (``col_blocks = [width]``), so the fused
    projection keeps every part's blocks (``fuse_linears`` keeps them only where all parts state
    them): in deterministic mode in_proj_b / in_proj_a's narrow blocks (Hv / S columns) are then
    products of one width at every TP size; as one product with the rest of the fused rows
    (TP = S), CPU BLAS gave those columns other bits."""
    for layer in layers:
        layer.col_blocks = layer.col_blocks or [layer.out_features]


def triton_norm_runs(x: torch.Tensor) -> bool:
    """Whether ``RowGatedRMSNorm`` runs its Triton kernels for ``x``: on CUDA with Triton (the tests
    patch this to run them under the CPU interpreter)."""
    return x.is_cuda and triton_available()


class RowGatedRMSNorm(NumericsUser, GatedRMSNorm):
    """``gated_delta.gated_rms_norm`` (weight as stored), each row reduced alone on CUDA: one Triton
    pass (``kernels.rmsnorm.gated_rmsnorm``: ``w * (o / rms(o)).to(o.dtype)``, the reference's
    rounding, times the float32 SiLU gate, rounded once), or for dtypes it does not take the norm
    through ``invariant_rmsnorm`` and the gate in PyTorch; PyTorch's own reduction there picks its
    layout by the number of rows, so a token's bits would depend on what is packed beside it."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if (self.numerics.deterministic or self.numerics.triton) and triton_norm_runs(x):
            if gated_rmsnorm_supports(x, z, self.weight):
                return gated_rmsnorm(x, z, self.weight, self.eps)  # z may be a strided view
            return gated_rmsnorm_reference(x, z, self.weight, self.eps)
        return gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaMixer(NumericsUser, nn.Module):
    """The linear-attention token mixer (checkpoint module ``linear_attn``): this rank's key and
    value heads (all of them with one rank). ``tp_param_ranges``: the rows of its own parameters'
    whole tensors it holds (``parallel_linear.held_ranges``)."""

    def __init__(self, cfg: HybridConfig, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which layer of a chunk cache's states is ours
        H, Hk, Hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        k0, k1 = shard_range(Hk, ctx.rank, ctx.size)
        v0, v1 = shard_range(Hv, ctx.rank, ctx.size)
        self.num_k_heads, self.num_v_heads = k1 - k0, v1 - v0
        self.head_k_dim, self.head_v_dim = Dk, Dv
        self.key_dim = self.num_k_heads * Dk
        self.value_dim = self.num_v_heads * Dv
        # rows [q | k | v]: this rank's key heads of q and of k, its value heads of v
        self.in_proj_qkv = SegmentedColumnLinear(H, [(Hk, Dk), (Hk, Dk), (Hv, Dv)], False, ctx)
        self.in_proj_z = ColumnParallelLinear(H, Hv * Dv, False, ctx, rows=(v0 * Dv, v1 * Dv), head_dim=Dv)
        self.in_proj_b = ColumnParallelLinear(H, Hv, False, ctx, rows=(v0, v1))
        self.in_proj_a = ColumnParallelLinear(H, Hv, False, ctx, rows=(v0, v1))
        conv_dim = self.in_proj_qkv.out_features
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, cfg.linear_conv_kernel_dim), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.tp_param_ranges = {"conv_weight": self.in_proj_qkv.tp_ranges, "A_log": ((v0, v1),),
                                "dt_bias": ((v0, v1),)}
        self.norm = RowGatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)  # one [Dv] weight for every head
        self.out_proj = GatheredRowLinear(Hv * Dv, H, False, ctx)
        _state_blocks(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        self.in_proj: Linear | None = None  # set by fuse(): qkv, z, b and a in one matmul

    def fuse(self) -> None:
        self.in_proj = fuse_linears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> mixed [T, C], z [T, Hv * Dv], b, a [T, Hv]. ``mixed`` and ``z`` may be views
        with a longer row stride (the fused projection's columns): the conv and the gated norm read
        them in place; the small b, a are copied out."""
        if self.in_proj is None:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        sizes = [self.in_proj_qkv.out_features, self.value_dim, self.num_v_heads, self.num_v_heads]  # this rank's
        mixed, z, b, a = self.in_proj(x).split(sizes, dim=-1)
        return mixed, z, b.contiguous(), a.contiguous()

    def forward(self, x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        T = x.shape[0]
        mixed, z, b, a = self.project(x)
        inputs = DeltaInputs(
            mixed=mixed, a=a, b=b,  # [T, C], [T, Hv], [T, Hv]
            conv_weight=self.conv_weight, A_log=self.A_log, dt_bias=self.dt_bias, key_dim=self.key_dim,
            num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads, head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim)
        num = self.numerics
        rule, conv = gated_delta_kernels(x.device, num.deterministic, num.triton, x.dtype)  # None: the reference
        kernels = {k: f for k, f in (("rule", rule), ("conv", conv)) if f is not None}
        o = packed_gated_delta(inputs, meta, self.layer_idx, **kernels)  # [T, Hv, Dv]
        z = z.view(T, self.num_v_heads, self.head_v_dim)  # [T, Hv, Dv]
        return self.out_proj(self.norm(o, z).reshape(T, self.value_dim))  # [T, H]


class GatedAttention(NumericsUser, nn.Module):
    """Full attention with a sigmoid output gate, q/k norms and partial rotary (module ``self_attn``):
    this rank's query heads and the kv heads they read (as ``LlamaAttention``)."""

    def __init__(self, cfg: HybridConfig, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        q0, q1 = q_heads(cfg.num_heads, ctx.rank, ctx.size)
        k0, k1 = kv_heads(cfg.num_heads, cfg.num_kv_heads, ctx.rank, ctx.size)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, k1 - k0, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.scale = cfg.head_dim**-0.5
        D, H = cfg.head_dim, cfg.hidden_size
        # per head: D query rows, then D gate rows (a rank's rows: its heads' 2 D blocks)
        self.q_proj = ColumnParallelLinear(H, cfg.num_heads * 2 * D, False, ctx, rows=(q0 * 2 * D, q1 * 2 * D),
                                           head_dim=2 * D)
        self.k_proj = ColumnParallelLinear(H, cfg.num_kv_heads * D, False, ctx, rows=(k0 * D, k1 * D), head_dim=D)
        self.v_proj = ColumnParallelLinear(H, cfg.num_kv_heads * D, False, ctx, rows=(k0 * D, k1 * D), head_dim=D)
        self.o_proj = GatheredRowLinear(cfg.num_heads * D, H, False, ctx)
        _state_blocks(self.q_proj, self.k_proj, self.v_proj)
        self.q_norm = OffsetRMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(D, cfg.rms_norm_eps)
        self.qkv_proj: Linear | None = None  # set by fuse(): q (with its gate), k, v in one matmul

    def fuse(self) -> None:
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def rotate(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        """Rotary on the first ``rotary_dim`` dims of each head (interleaved layout), the rest as is."""
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rotary(x, cis, self.numerics.triton)
        return torch.cat([apply_rotary(x[..., :r], cis, self.numerics.triton), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        if self.qkv_proj is not None:
            nq, nkv = self.q_proj.out_features, self.k_proj.out_features
            qg, k, v = self.qkv_proj(x).split([nq, nkv, nkv], dim=-1)  # [T, 2 Hq D], [T, Hkv D], [T, Hkv D]
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, gate = qg.reshape(T, self.num_heads, 2 * D).chunk(2, dim=-1)  # [T, Hq, D] each
        k = k.reshape(T, self.num_kv_heads, D)  # [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, D)
        q, k = self.rotate(self.q_norm(q), cis), self.rotate(self.k_norm(k), cis)
        o = packed_attention(q, k, v, meta, self.layer_idx, self.scale)  # [T, Hq, D]
        gate = row_invariant(torch.sigmoid, gate.reshape(T, self.num_heads * D))  # [T, Hq * D]
        return self.o_proj(o.reshape(T, self.num_heads * D) * gate)  # [T, H]


class HybridDecoderLayer(SplitSteps, nn.Module):
    """A linear-attention or gated-attention block, then a dense MLP or the MoE. Under
    data-parallel attention (``ctx.attention`` "data") the mixers, dense MLPs and shared experts
    are whole (``ctx.attention_ctx``) and ``mlp(x, None, rows)`` runs on this rank's rows of a
    batch split by sequences (``meta.rows``); ``steps`` (``SplitSteps``) for two micro-batches."""

    def __init__(self, cfg: HybridConfig, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__()
        dense = ctx.attention_ctx  # whole layers under data-parallel attention
        self.points = tuple(f"blocks.{layer_idx}.{p}" for p in ("resid_pre", "attn_out", "resid_mid", "mlp_out",
                                                                 "resid_post"))
        self.layer_type = cfg.layer_types[layer_idx]
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaMixer(cfg, layer_idx, dense)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx, dense)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.dense_mlp(layer_idx):
            self.mlp = _swiglu(cfg.hidden_size, cfg.intermediate_size, dense)
        else:
            spec = cfg.moe
            shared = _swiglu(cfg.hidden_size, spec.shared_intermediate_size, dense) \
                if spec.shared_intermediate_size else None
            self.mlp = MoeBlock(spec, cfg.hidden_size, f"blocks.{layer_idx}.router", shared, ctx)

    def mix(self, x: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        if self.layer_type == "linear_attention":
            return self.linear_attn(x, meta)
        return self.self_attn(x, cis, meta)

    def forward(self, h: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta, hooks: Hooks | None = None
                ) -> torch.Tensor:
        if hooks is None:
            h = h + self.mix(self.input_layernorm(h), cis, meta)  # resid_mid
            if meta.rows is not None:  # this rank's rows of a split batch: the experts gather them
                return h + self.mlp(self.post_attention_layernorm(h), None, meta.rows)
            return h + self.mlp(self.post_attention_layernorm(h))  # resid_post
        resid_pre, attn_out, resid_mid, mlp_out, resid_post = self.points
        h = hooks(resid_pre, h)
        h = hooks(resid_mid, h + hooks(attn_out, self.mix(self.input_layernorm(h), cis, meta)))
        return hooks(resid_post, h + hooks(mlp_out, self.mlp(self.post_attention_layernorm(h), hooks)))


class HybridModel(QwenImages, ScoringModel):
    """Final hidden states for a packed batch (``forward(input_ids [T], positions [T], meta, hooks)
    -> [T, H]``); ``head_params()`` feeds the log-prob head. ``ctx``: this rank's tensor-parallel
    group (None: one rank); mixture-of-experts blocks split their experts by ``ctx.experts``
    (``layers.moe.Experts``), the router whole on every rank."""

    # the chunked rule reproduces a whole run's bits only where a sequence is cut at a multiple of its chunk
    caps = ModelCaps(context=True, hooks=True, tensor_parallel=True, state_align=CHUNK_SIZE)
    # fla-core's autotuned rule kernels: imported at engine start so that the tuning tables reach
    # them before the first pass (``kernels.tuning``)
    autotuned_modules = ("fla.ops.gated_delta_rule",)

    def __init__(self, cfg: HybridConfig, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.ctx = ctx = ctx or ParallelContext(blocks=num_blocks(*cfg.split_widths))
        self.shard_vocab(cfg, ctx)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i, ctx) for i in range(cfg.num_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = self.make_rotary()
        # the vision tower, small, is whole on every rank (replicated, not split): each rank embeds
        # the images of its pass alike, so tensor parallelism gives the one-rank embeddings bitwise
        self.visual = VisionTower(cfg.vision) if cfg.vision is not None else None
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.hidden_size, self.vocab_range, ctx)
        self.router_points = frozenset(m.router_point for m in self.modules() if isinstance(m, MoeBlock))

    def make_rotary(self) -> RotaryEmbedding:
        cfg = self.config
        if cfg.mrope_section is None:
            return RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        return MRotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)

    @staticmethod
    def interleave_rope_weights(cfg: HybridConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint (rotate-half) q/k rows -> the interleaved layout ``apply_rotary`` expects, on
        the first ``rotary_dim`` dims of each head (q_proj's heads are 2 D rows: query, then gate)."""
        out = dict(state)
        for name, w in state.items():
            if ".self_attn.q_proj." in name:
                out[name] = _interleave_head_rows(w, 2 * cfg.head_dim, cfg.rotary_dim)
            elif any(f".self_attn.{p}." in name for p in ("k_proj", "q_norm", "k_norm")):
                out[name] = _interleave_head_rows(w, cfg.head_dim, cfg.rotary_dim)
        return out

    def fuse_projections(self) -> None:
        """At load: each mixer's input projections as one matmul, and the MLPs' gate/up (shared
        experts' too); the old names remain as views."""
        for layer in self.layers:
            (layer.linear_attn if layer.layer_type == "linear_attention" else layer.self_attn).fuse()
            layer.mlp.fuse()


def _interleave_head_rows(w: torch.Tensor, block: int, r: int) -> torch.Tensor:
    """Rows of ``w`` in heads of ``block`` rows: each head's first ``r`` rows from the rotate-half
    pairing (j with j + r/2) to the interleaved one (2j with 2j + 1); other rows unchanged."""
    n = w.shape[0] // block
    heads = w.reshape(n, block, *w.shape[1:])  # [n, block, ...]
    rot = heads[:, :r].reshape(n, 2, r // 2, *w.shape[1:]).transpose(1, 2).reshape(n, r, *w.shape[1:])
    return torch.cat([rot, heads[:, r:]], dim=1).reshape(w.shape)
