"""MiniMax-M2 (``minimax_m2``) natively: Llama blocks, full-projection q/k norm, partial rotary, a
sigmoid router with a score-correction bias and no shared expert.

Transformers' ``MiniMaxM2ForCausalLM``, block by block (``models.moe`` blocks, ``models.llama`` hook points):

    Attn    : q = RMSNorm_{Hq*D}(W_q x), k = RMSNorm_{Hkv*D}(W_k x)  (over the whole projection, as OLMoE),
              v = W_v x; rotary (rotate half) on the first ``rotary_dim`` dims of each head
              (``models.glm4_moe.PartialRotary``); GQA softmax(q k^T / sqrt(head_dim)) v; o_proj
    MoE     : logits = G x in the model dtype (the router is not kept in float32), s = sigmoid(float32(logits))
              (blocks.l.router), ids = top-k of s + e_score_correction_bias, w = s[ids] / sum(s[ids]),
              sum_j w_j Expert_{ids_j}(x)
              (``layers.moe.route_grouped`` with one group and routed_scaling_factor 1)

Every block is a mixture of experts; the experts are ``intermediate_size`` wide.
"""

from __future__ import annotations

from .glm4_moe import Glm4MoeModel, PartialRotaryConfig, PartialRotaryMoeModel


class MiniMaxM2Model(PartialRotaryMoeModel):
    """MiniMax-M2: ``cfg.qk_norm_full``, ``cfg.moe`` with ``router="sigmoid_grouped"``, ``n_group=1``."""


def sigmoid_model_class(cfg: PartialRotaryConfig) -> type[PartialRotaryMoeModel]:
    """The model class of a GLM-4.5 / MiniMax-M2 config (``cfg.family``)."""
    return MiniMaxM2Model if cfg.family == "minimax_m2" else Glm4MoeModel
