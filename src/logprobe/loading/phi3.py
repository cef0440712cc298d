"""Phi-3 and Phi-4 (``model_type`` "phi3": Phi-3/3.5-mini, Phi-3-medium, Phi-4, Phi-4-mini) on the
native Llama model.

Phi-3 is a Llama-shaped decoder (RMSNorm, SiLU-gated MLP, grouped-query attention with RoPE, no
biases) whose checkpoints fuse q/k/v into ``qkv_proj`` ([Nq + 2 Nkv, H], q rows first) and gate/up
into ``gate_up_proj`` ([2I, H], gate rows first); ``split_fused`` cuts them apart at load, so the
native model runs them as it runs Llama (and fuses them again for its own matmuls).

* ``partial_rotary_factor`` (Phi-4-mini: 0.75): the first ``rotary_dim`` dims of each head turn
  (``layers.rotary``).
* ``sliding_window``: transformers masks with it whenever it is set (``create_sliding_window_causal_mask``
  in ``Phi3Model``), so it is applied as Mistral's is (a query sees its ``sliding_window`` latest keys).
* LongRoPE (``rope_type`` "longrope", also spelt "su" or "yarn" in old Phi-3 configs): transformers
  multiplies cos/sin by the attention factor and uses ``short_factor`` while ``max(position) + 1``
  <= ``original_max_position_embeddings``, ``long_factor`` for the whole sequence beyond it. The
  native model uses the short factors and refuses positions past the original length (when the two
  factor lists differ), so each sequence it scores gets exactly transformers' numbers for that
  sequence alone and no token's log-prob depends on how long its sequence is.
"""

from __future__ import annotations

import math

from ..errors import LogprobeError
from ..models.llama import LlamaConfig

FUSED = "phi3_fused"  # LlamaConfig.extra key: the checkpoint holds qkv_proj / gate_up_proj


def phi3_config(cfg: dict) -> tuple[LlamaConfig | None, str]:
    """LlamaConfig for a phi3 config the native model runs exactly, else (None, why)."""
    if cfg.get("hidden_act", "silu") != "silu":
        return None, f"hidden_act {cfg.get('hidden_act')!r} is not in the native Phi-3 model"
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    kind = "longrope" if kind in ("su", "yarn") else kind  # Phi3Config.convert_rope_params_to_dict
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    scaling: dict | None = None
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if not isinstance(params.get(key), list):
                return None, f"rope_scaling.{key} is missing (LongRoPE needs both factor lists)"
        # Phi3Config keeps a top-level original_max_position_embeddings (default 4096) over the dict's
        original = int(cfg.get("original_max_position_embeddings")
                       or params.get("original_max_position_embeddings") or 4096)
        factor = params.get("factor") or max_pos / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        scaling = {"rope_type": "longrope", "short_factor": list(params["short_factor"]),
                   "long_factor": list(params["long_factor"]), "original_max_position_embeddings": original,
                   "attention_factor": float(attention), "partial_rotary_factor": partial}
    elif kind != "default":
        return None, f"rope_scaling rope_type {kind!r} is not in the native Phi-3 model (default and longrope are)"
    elif partial != 1.0:
        scaling = {"rope_type": "default", "partial_rotary_factor": partial}
    sliding = cfg.get("sliding_window")
    try:
        lc = LlamaConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(sliding) if sliding else None,
            max_position_embeddings=max_pos,
            extra={FUSED: True},
        )
    except LogprobeError as e:  # e.g. a partial_rotary_factor giving an odd rotary width
        return None, f"{e.field}: {e.problem}"
    return lc, ""


def split_fused(tensors, cfg: LlamaConfig):
    """``layers.N.self_attn.qkv_proj.weight`` -> q_proj / k_proj / v_proj and
    ``layers.N.mlp.gate_up_proj.weight`` -> gate_proj / up_proj (each its own storage); other
    tensors pass through."""
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, w in tensors:
        if name.endswith(".self_attn.qkv_proj.weight"):
            if w.shape[0] != nq + 2 * nkv:
                raise LogprobeError("model", f"tensor {name} has {w.shape[0]} rows, the config implies {nq + 2 * nkv}")
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), w.split([nq, nkv, nkv])):
                yield name.replace("qkv_proj", part), rows.contiguous()
        elif name.endswith(".mlp.gate_up_proj.weight"):
            if w.shape[0] != 2 * cfg.intermediate_size:
                raise LogprobeError("model", f"tensor {name} has {w.shape[0]} rows, the config implies "
                                    f"{2 * cfg.intermediate_size}")
            gate, up = w.chunk(2)
            yield name.replace("gate_up_proj", "gate_proj"), gate.contiguous()
            yield name.replace("gate_up_proj", "up_proj"), up.contiguous()
        else:
            yield name, w


def fused_parts(name: str, cfg: LlamaConfig) -> list[tuple[str, int, int]] | None:
    """For a fused native name (``layers.N.self_attn.qkv_proj.weight``, ``layers.N.mlp.gate_up_proj.weight``)
    of a Phi-3 config: its parts as (native name, first row, end row); None for any other name.
    Weight updates (``loading.update.units``) cut incoming fused tensors with it."""
    if not cfg.extra.get(FUSED):
        return None
    nq, nkv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    if name.endswith(".self_attn.qkv_proj.weight"):
        return [(name.replace("qkv_proj", "q_proj"), 0, nq), (name.replace("qkv_proj", "k_proj"), nq, nq + nkv),
                (name.replace("qkv_proj", "v_proj"), nq + nkv, nq + 2 * nkv)]
    if name.endswith(".mlp.gate_up_proj.weight"):
        return [(name.replace("gate_up_proj", "gate_proj"), 0, inter),
                (name.replace("gate_up_proj", "up_proj"), inter, 2 * inter)]
    return None
