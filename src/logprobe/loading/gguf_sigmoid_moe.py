"""GGUF files of llama.cpp's ``glm4moe`` (GLM-4.5 / 4.6) and ``minimax-m2`` (MiniMax-M2) architectures
onto the native partial-rotary sigmoid-router MoE models (``models.glm4_moe``, ``models.minimax_m2``).

The converter renames and stacks, nothing more: q/k rows stay in the checkpoint's rotate-half layout
(llama.cpp rotates these architectures NeoX-style on the first ``rope.dimension_count`` dims), the
experts become 3-D ``ffn_{gate,up,down}_exps``, the score-correction bias ``exp_probs_b``, GLM's
post-attention norm ``post_attention_norm`` and MiniMax's ``ffn_norm``. From the metadata: the router
(``expert_gating_func`` sigmoid), ``expert_weights_norm`` / ``expert_weights_scale`` (GLM's
norm_topk_prob / routed_scaling_factor), ``expert_group_count`` / ``expert_group_used_count``,
``leading_dense_block_count``, ``expert_shared_count``; blocks past ``block_count -
nextn_predict_layers`` (GLM's multi-token prediction) are skipped. Tensors are expanded at load.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ..errors import LogprobeError
from ..kernels.gguf_quants import GGML_TYPES, dequantize
from ..layers.moe import MoeSpec
from ..models.glm4_moe import PartialRotaryConfig
from .gguf import _field, _int_field

log = logging.getLogger(__name__)

SIGMOID_ARCHES = {"glm4moe": "glm4_moe", "minimax-m2": "minimax_m2"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.e_score_correction_bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj", "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
for _p, _n in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
    _LAYER.update({f"{_p}.weight": f"self_attn.{_n}.weight", f"{_p}.bias": f"self_attn.{_n}.bias"})
_TOP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
_FIX = "logprobe reads glm4moe / minimax-m2 GGUF files as llama.cpp's converter writes them"


def _need(reader, arch: str, key: str, path: Path) -> int:
    value = _int_field(reader, f"{arch}.{key}", path)
    if value is None:
        raise LogprobeError("model", f"{path.name} has no {arch}.{key}", f"the file is not a complete {arch} model")
    return value


def _refuse(path: Path, key: str, value, what: str) -> LogprobeError:
    return LogprobeError("model", f"{path.name} sets {key} = {value!r} ({what}), which the native model does not "
                         "run: ignoring it would give a silently wrong model", _FIX)


def _check_keys(reader, arch: str, path: Path) -> None:
    unused = (("rope.scaling.type", (None, "none"), "RoPE scaling"), ("rope.scaling.factor", (None, 0, 1), "RoPE scaling"),
              ("attention.scale", (None, 0), "a custom attention scale"),
              ("attention.sliding_window", (None, 0), "sliding-window attention"),
              ("attention.causal", (None, True), "non-causal attention"),
              ("expert_gating_func", (2,) if arch == "glm4moe" else (None, 2), "a router other than sigmoid"))
    for suffix, ok, what in unused:
        value = _field(reader, f"{arch}.{suffix}")
        if value not in ok:
            raise _refuse(path, f"{arch}.{suffix}", value, what)
    if arch == "minimax-m2":  # llama.cpp runs it renormalised, unscaled, ungrouped
        for suffix, ok in (("expert_weights_scale", (None, 0, 1)), ("expert_group_count", (None, 0, 1)),
                           ("expert_weights_norm", (None, True)), ("expert_shared_count", (None, 0))):
            value = _field(reader, f"{arch}.{suffix}")
            if value not in ok:
                raise _refuse(path, f"{arch}.{suffix}", value, "not MiniMax-M2's router")


def gguf_sigmoid_moe_config(reader, path: Path) -> PartialRotaryConfig:
    arch = _field(reader, "general.architecture")
    _check_keys(reader, arch, path)
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}  # outermost first
    if "token_embd.weight" not in shapes:
        raise LogprobeError("model", f"{path.name} has no token_embd.weight tensor")
    hidden, heads = _need(reader, arch, "embedding_length", path), _need(reader, arch, "attention.head_count", path)
    head_dim = _int_field(reader, f"{arch}.attention.key_length", path, hidden // heads)
    if _int_field(reader, f"{arch}.attention.value_length", path, head_dim) != head_dim:
        raise _refuse(path, f"{arch}.attention.value_length", _field(reader, f"{arch}.attention.value_length"),
                      f"values not {head_dim} wide like the keys")
    layers = _need(reader, arch, "block_count", path) - (_int_field(reader, f"{arch}.nextn_predict_layers", path, 0) or 0)
    glm = arch == "glm4moe"
    moe_inter = _need(reader, arch, "expert_feed_forward_length", path)
    moe = MoeSpec(num_experts=_need(reader, arch, "expert_count", path),
                  top_k=_need(reader, arch, "expert_used_count", path), intermediate_size=moe_inter,
                  norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", not glm)),
                  shared_intermediate_size=moe_inter * (_int_field(reader, f"{arch}.expert_shared_count", path, 0) or 0),
                  dense_layers=tuple(range(min(_int_field(reader, f"{arch}.leading_dense_block_count", path, 0) or 0,
                                               layers))),
                  router="sigmoid_grouped", n_group=_int_field(reader, f"{arch}.expert_group_count", path, 1) or 1,
                  topk_group=_int_field(reader, f"{arch}.expert_group_used_count", path, 1) or 1,
                  routed_scaling_factor=float(_field(reader, f"{arch}.expert_weights_scale", 1.0) or 1.0))
    first = moe.dense_layers[-1] + 1 if moe.dense_layers else 0
    return PartialRotaryConfig(
        vocab_size=shapes["token_embd.weight"][0], hidden_size=hidden,
        intermediate_size=_int_field(reader, f"{arch}.feed_forward_length", path, moe_inter) if glm else moe_inter,
        num_layers=layers, num_heads=heads,
        num_kv_heads=_int_field(reader, f"{arch}.attention.head_count_kv", path, heads), head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)), rope_scaling=None,
        attention_bias=f"blk.{first}.attn_q.bias" in shapes, qk_norm=glm and f"blk.{first}.attn_q_norm.weight" in shapes,
        qk_norm_full=not glm, tie_word_embeddings="output.weight" not in shapes,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 131072)), moe=moe,
        rotary_dim=_int_field(reader, f"{arch}.rope.dimension_count", path, head_dim), family=SIGMOID_ARCHES[arch])


def gguf_sigmoid_moe_tensors(reader, arch: str, cfg: PartialRotaryConfig):
    """Yield (native parameter name, float32 tensor) for ``build_sigmoid_moe``."""
    skipped = 0
    for t in reader.tensors:
        type_id = int(t.tensor_type)
        if type_id not in GGML_TYPES:
            raise LogprobeError("model", f"tensor {t.name} has GGUF type {t.tensor_type.name}, which logprobe "
                                "does not read", "use a file with F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K or Q6_K tensors")
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m and int(m.group(1)) >= cfg.num_layers:
            skipped += 1  # a multi-token-prediction block
            continue
        w = dequantize(t.data, type_id, tuple(int(x) for x in reversed(t.shape)))
        if m is None and t.name in _TOP:
            yield _TOP[t.name], w
        elif m is not None and m.group(2) in _LAYER:
            yield f"layers.{m.group(1)}.{_LAYER[m.group(2)]}", w
        else:
            raise LogprobeError("model", f"tensor {t.name!r} of a {arch} GGUF file has no place in the native "
                                "model", _FIX)
    if skipped:
        log.warning("skipped %d tensors of multi-token-prediction blocks (not used to score text)", skipped)
