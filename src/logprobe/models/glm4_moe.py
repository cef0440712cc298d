"""GLM-4.5 / GLM-4.6 (``glm4_moe``) natively: Llama blocks with partial rotary and DeepSeek-V3's router.

Transformers' ``Glm4MoeForCausalLM``, block by block (``models.moe`` blocks, ``models.llama`` hook points):

    h'_l    = h_l + Attn_l(RMSNorm(h_l))                      # resid_pre l, attn_out l, resid_mid l
    Attn    : q, k, v = W x (+ b when attention_bias);  q, k = RMSNorm_head(q), RMSNorm_head(k) when use_qk_norm
              rotary (rotate half) on the first r = head_dim * partial_rotary_factor dims of each head,
              the other head_dim - r dims pass unturned;  GQA softmax(q k^T / sqrt(head_dim)) v;  o_proj
    h_{l+1} = h'_l + MLP_l(RMSNorm(h'_l))                      # mlp_out l, resid_post l
    MLP_l   : dense SiLU MLP for l < first_k_dense_replace, else
              s = sigmoid(float32(G) float32(x)) (blocks.l.router), c = s + e_score_correction_bias,
              n_group groups (a group scores the sum of its 2 best c), the topk_group best groups kept,
              ids = top-k of c there, w = s[ids] / sum (norm_topk_prob) * routed_scaling_factor,
              sum_j w_j Expert_{ids_j}(x) + SharedExperts(x)    (``layers.moe.route_grouped``)

The rotation of the first r dims runs as everywhere in logprobe: those rows of the q/k projections
(and of a per-head q/k norm) are permuted to the interleaved layout at load (``to_interleaved_partial``),
and the pass-through pairs turn by frequency 0, a multiplication by exactly 1 (``PartialRotary``).
MiniMax-M2 (``models.minimax_m2``) shares the rotary part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import LogprobeError
from ..layers.rotary import rope_inv_freq, to_interleaved
from ..parallel.context import ParallelContext
from .caps import ModelCaps
from .llama import LlamaConfig
from .moe import MoeModel


@dataclass(slots=True)
class PartialRotaryConfig(LlamaConfig):
    """``LlamaConfig`` plus the rotary width: ``rotary_dim`` leading dims of each head turn (0: all)."""

    rotary_dim: int = 0
    family: str = "glm4_moe"

    def __post_init__(self) -> None:
        LlamaConfig.__post_init__(self)
        if self.rotary_dim == 0:
            self.rotary_dim = self.head_dim
        if not 2 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise LogprobeError("config.partial_rotary_factor", f"gives {self.rotary_dim} rotary dims of head_dim "
                                f"{self.head_dim}; they must be even and in [2, head_dim]")


class PartialRotary(nn.Module):
    """Rotations [T, head_dim / 2] (complex64): the first ``rot / 2`` pairs at the rotary frequencies
    of a ``rot``-dim rotary (transformers: ``base ** (-arange(0, rot, 2) / rot)``), the rest 1 exactly."""

    def __init__(self, head_dim: int, rot: int, theta: float) -> None:
        super().__init__()
        inv = rope_inv_freq(rot, theta, None)  # [rot / 2] float64
        inv = torch.cat([inv, inv.new_zeros((head_dim - rot) // 2)])
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        return torch.polar(torch.ones_like(freqs), freqs)


def to_interleaved_partial(w: torch.Tensor, n_head: int, rot: int) -> torch.Tensor:
    """Rows [n_head * D, ...] of a q/k projection (or its bias, or a q/k norm weight): in each head the
    first ``rot`` rows go from rotate-half to interleaved (``to_interleaved``), the rest stay."""
    D = w.shape[0] // n_head
    if rot == D:
        return to_interleaved(w, n_head)
    heads = w.reshape(n_head, D, *w.shape[1:])  # [n_head, D, ...]
    turned = to_interleaved(heads[:, :rot].reshape(n_head * rot, *w.shape[1:]), n_head)
    return torch.cat([turned.reshape(n_head, rot, *w.shape[1:]), heads[:, rot:]], 1).reshape(w.shape)


class PartialRotaryMoeModel(MoeModel):
    """``MoeModel`` whose rotary turns the first ``cfg.rotary_dim`` dims of each head (GLM-4.5, MiniMax-M2)."""

    caps = ModelCaps(context=True, hooks=True, tensor_parallel=True)

    def __init__(self, cfg: PartialRotaryConfig, rope_freq_factors=None, ctx: ParallelContext | None = None) -> None:
        super().__init__(cfg, None, ctx)
        self.rotary = PartialRotary(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta)

    @staticmethod
    def interleave_rope_weights(cfg: PartialRotaryConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint (rotate-half) rows -> the interleaved layout on each head's rotary dims."""
        out = dict(state)
        for name, w in state.items():
            if any(f".self_attn.{p}." in name for p in ("q_proj", "k_proj", "q_norm", "k_norm")):
                out[name] = to_interleaved_partial(w, w.shape[0] // cfg.head_dim, cfg.rotary_dim)
        return out


class Glm4MoeModel(PartialRotaryMoeModel):
    """GLM-4.5 / 4.6: the first ``first_k_dense_replace`` blocks dense (``cfg.moe.dense_layers``), then
    the sigmoid grouped router with an ungated shared expert (``MoeModel.make_layer``)."""
