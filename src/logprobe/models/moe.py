"""Mixture-of-experts Llama-family models: Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE.

The same blocks as ``models.llama`` (attention, norms, hook points), with the dense MLP swapped
for a routed one (``layers.moe.MoeBlock``):

    h'_l    = h_l + Attn_l(RMSNorm(h_l))
    p_l     = softmax(float32(G_l x)),  x = RMSNorm(h'_l)              # router (blocks.l.router)
    h_{l+1} = h'_l + sum_{j < k} w_j Expert_{ids_j}(x)                  # mlp_out l
                   [+ sigmoid(g_l . x) * Shared_l(x)]                   # Qwen2-MoE

Family differences, all read from the config:
    Qwen2-MoE : qkv bias, shared expert with a sigmoid gate, norm_topk_prob (false by default)
    Qwen3-MoE : q/k RMSNorm per head, norm_topk_prob (true in the released models)
    Mixtral   : weights always renormalised over the top k, Mistral's sliding window
    OLMoE     : q/k RMSNorm over the whole projection (``qk_norm_full``), norm_topk_prob false
    Qwen-MoE ``mlp_only_layers`` / ``decoder_sparse_step``: those blocks keep a dense MLP.

Over several ranks the routed experts split by ``ctx.experts`` (expert parallelism) and, within an
expert group, by rows (``layers.moe``); the router is whole on every rank. Attention and the dense
/ shared MLPs either split as Llama's (``ctx.attention == "tensor"``: every rank ends with every
slot's output, bitwise one process's in deterministic mode) or, with whole experts per rank, stay
whole on every rank, each rank running them on its share of the batch's sequences
(``"data"``: ``ScoringModel.forward``, ``parallel.rows``, ``MoeBlock`` with ``rows``).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..layers.moe import MoeBlock
from ..layers.moe_gpt_oss import GptOssMoe
from ..parallel.context import ParallelContext
from .caps import ModelCaps
from .llama import LlamaConfig, LlamaDecoderLayer, LlamaMLP, LlamaModel


class MoeModel(LlamaModel):
    """``LlamaModel`` whose blocks (all but ``cfg.moe.dense_layers``) route each token to experts."""

    caps = ModelCaps(context=True, hooks=True, tensor_parallel=True)

    def __init__(self, cfg: LlamaConfig, rope_freq_factors=None, ctx: ParallelContext | None = None) -> None:
        super().__init__(cfg, rope_freq_factors, ctx)
        self.router_points = frozenset(m.router_point for m in self.modules() if isinstance(m, MoeBlock))

    def make_layer(self, cfg: LlamaConfig, layer_idx: int, ctx: ParallelContext) -> nn.Module:
        spec, dense = cfg.moe, ctx.attention_ctx  # dense: whole layers under data-parallel attention
        if layer_idx in spec.dense_layers:
            return LlamaDecoderLayer(cfg, layer_idx, dense)
        shared = None
        if spec.shared_intermediate_size:
            shared = LlamaMLP(dataclasses.replace(cfg, intermediate_size=spec.shared_intermediate_size), dense)
        mlp = MoeBlock(spec, cfg.hidden_size, f"blocks.{layer_idx}.router", shared, ctx)
        return LlamaDecoderLayer(cfg, layer_idx, dense, mlp=mlp)


def native_model_class(cfg: LlamaConfig) -> type[LlamaModel]:
    """The model family of a native config: dense Llama or mixture of experts."""
    return LlamaModel if cfg.moe is None else MoeModel


def routed_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(block index, MoE module) of every routed block of a native model, in layer order: the
    families' ``layers.moe.MoeBlock`` and gpt-oss's ``GptOssMoe``. Each hands its choice to
    ``Hooks.routing`` at its ``router_point`` (``blocks.l.router``) and has ``top_k`` and
    ``spec.num_experts``. DeepSeek-V3 with ``first_k_dense_replace=1`` over 4 blocks: [(1, ..),
    (2, ..), (3, ..)]; a dense model: []."""
    blocks = [m for m in model.modules() if isinstance(m, (MoeBlock, GptOssMoe))]
    return sorted(((int(m.router_point.split(".")[1]), m) for m in blocks), key=lambda b: b[0])
