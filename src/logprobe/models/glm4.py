"""GLM-4 dense (``glm4``: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1) natively: Llama blocks with two more
norms and partial rotary on interleaved pairs.

Transformers' ``Glm4ForCausalLM``, block by block (hook points as ``models.llama``):

    a_l     = N_post_attn(Attn_l(N_in(h_l)))           # resid_pre l, attn_out l
    h'_l    = h_l + a_l                                # resid_mid l
    m_l     = N_post_mlp(MLP_l(N_post_attn_in(h'_l)))  # mlp_out l
    h_{l+1} = h'_l + m_l                               # resid_post l

    N:      plain RMSNorm (normalised in float32, cast back, then the gain), four per block:
            ``input_layernorm``, ``post_self_attn_layernorm``, ``post_attention_layernorm`` (before
            the MLP, despite its name) and ``post_mlp_layernorm``
    Attn_l: q, k, v = x W + b (``attention_bias``, on by default); rotary on the first
            r = head_dim * partial_rotary_factor dims of each head, as pairs (2i, 2i + 1) turned by
            theta^(-2i / r): the interleaved layout ``layers.rotary`` runs, so the checkpoint's
            q/k rows load as they are; GQA softmax(q k^T / sqrt(head_dim)) v; o_proj, no bias
    MLP_l:  down(silu(gate) * up), gate and up stored as one ``gate_up_proj`` [2 I, H] (gate first),
            split at load (``loading.glm4``)

Tensor parallelism as the Llama family (``LlamaModel``): a rank holds its query heads (their q/k/v
bias rows with them) and the kv heads they read, its share of the MLP; the four norms act on the
whole residual stream on every rank. ``loading.glm4.glm4_shard_tensors`` cuts a rank's rows after
splitting ``gate_up_proj``. Weight updates (``loading.update``) cut an incoming ``gate_up_proj``
the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layers.attention import AttentionMeta
from ..layers.hooks import Hooks
from ..layers.norm import RMSNorm
from ..parallel.context import ParallelContext
from .caps import ModelCaps
from .gemma4 import keep_blocks
from .llama import LlamaConfig, LlamaDecoderLayer, LlamaModel


@dataclass(slots=True)
class Glm4Config(LlamaConfig):
    """``LlamaConfig`` of a GLM-4 dense model: partial rotation is ``rope_scaling["partial_rotary_factor"]``."""

    family: str = "glm4"


class Glm4DecoderLayer(LlamaDecoderLayer):
    """A Llama block with the attention and MLP outputs normed before they join the residual stream."""

    steps = None  # its own forward (a dense family: never split by sequences)

    def __init__(self, cfg: Glm4Config, layer_idx: int, ctx: ParallelContext) -> None:
        super().__init__(cfg, layer_idx, ctx)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        attn = self.self_attn  # q | k | v fused block by block at every TP size
        keep_blocks(attn.q_proj, attn.k_proj, attn.v_proj, self.mlp.gate_proj, self.mlp.up_proj)

    def forward(self, h: torch.Tensor, cis: torch.Tensor, meta: AttentionMeta, hooks: Hooks | None = None
                ) -> torch.Tensor:
        if hooks is None:
            h = h + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(h), cis, meta))
            return h + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h)))
        resid_pre, attn_out, resid_mid, mlp_out, resid_post = self.points
        h = hooks(resid_pre, h)
        a = self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(h), cis, meta))
        h = hooks(resid_mid, h + hooks(attn_out, a))
        m = self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h), hooks))
        return hooks(resid_post, h + hooks(mlp_out, m))


class Glm4Model(LlamaModel):
    """``LlamaModel`` with GLM-4 blocks; the rotary pairs are already interleaved in the checkpoint."""

    caps = ModelCaps(context=True, hooks=True, tensor_parallel=True)

    def make_layer(self, cfg: Glm4Config, layer_idx: int, ctx: ParallelContext) -> nn.Module:
        return Glm4DecoderLayer(cfg, layer_idx, ctx)

    @staticmethod
    def interleave_rope_weights(cfg: Glm4Config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """GLM-4 turns pairs (2i, 2i + 1) of the rotary dims, the layout ``apply_rotary`` expects:
        nothing to permute."""
        return dict(state)
