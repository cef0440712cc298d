"""GGUF files of llama.cpp's ``gemma3`` architecture (Gemma 3 text models, the text tower of the
multimodal ones) onto the native ``models.gemma`` model.

The converter bakes ``1 + w`` into every norm (``attn_norm``, ``post_attention_norm``, ``ffn_norm`` =
pre-feedforward, ``post_ffw_norm``, ``attn_q_norm`` / ``attn_k_norm``, ``output_norm``): ``w - 1``
here. What llama.cpp takes from elsewhere than the checkpoint's config, read the same way:

    layer pattern    sliding blocks only when ``attention.sliding_window`` > 0; then block i slides
                     unless (i + 1) is a multiple of ``attention.sliding_window_pattern`` (default 6;
                     or a per-block list)
    attention scale  1 / sqrt(embedding_length / head_count) for the 62-block model (27B), else
                     1 / sqrt(head_dim): the released configs' ``query_pre_attn_scalar``
    rotary           ``rope.freq_base`` (+ linear ``rope.scaling.factor``) on full blocks,
                     ``rope.freq_base_swa`` (default 10000) unscaled on sliding blocks

``final_logit_softcapping`` is applied as stored. Tensors are expanded at load. llama.cpp's
converter drops the embedding rows past the tokenizer's vocabulary, so the log-softmax runs over
the file's rows (as llama.cpp's does).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import LogprobeError
from ..kernels.gguf_quants import GGML_TYPES, dequantize
from ..models.gemma import GemmaConfig
from .gguf import _field, _int_field

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
_FIX = "logprobe reads gemma3 GGUF files as llama.cpp's converter writes them"


def _need(reader, key: str, path: Path) -> int:
    value = _int_field(reader, f"gemma3.{key}", path)
    if value is None:
        raise LogprobeError("model", f"{path.name} has no gemma3.{key}", "the file is not a complete gemma3 model")
    return value


def _refuse(path: Path, key: str, value, what: str) -> LogprobeError:
    return LogprobeError("model", f"{path.name} sets gemma3.{key} = {value!r} ({what}), which the native Gemma 3 "
                         "model does not run: ignoring it would give a silently wrong model", _FIX)


def _layer_types(reader, path: Path, layers: int, window: int) -> tuple[str, ...]:
    if window <= 0:
        return ("full_attention",) * layers
    pattern = _field(reader, "gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per block: true = sliding
        if len(pattern) < layers:
            raise _refuse(path, "attention.sliding_window_pattern", pattern[:8], f"fewer entries than {layers} blocks")
        return tuple("sliding_attention" if p else "full_attention" for p in pattern[:layers])
    pattern = int(pattern)
    if pattern < 1:
        raise _refuse(path, "attention.sliding_window_pattern", pattern, "no period")
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))


def _rope_scaling(reader, path: Path) -> dict | None:
    kind = _field(reader, "gemma3.rope.scaling.type")
    factor = _field(reader, "gemma3.rope.scaling.factor")
    if kind not in (None, "none", "linear"):
        raise _refuse(path, "rope.scaling.type", kind, "RoPE scaling other than linear")
    if kind == "none" or factor is None or float(factor) in (0.0, 1.0):
        return None
    return {"rope_type": "linear", "factor": float(factor)}


def gguf_gemma_config(reader, path: Path) -> GemmaConfig:
    for key, ok, what in (("attn_logit_softcapping", (None, 0), "attention logit soft-capping"),
                          ("attention.scale", (None, 0), "a custom attention scale"),
                          ("attention.causal", (None, True), "non-causal attention")):
        value = _field(reader, f"gemma3.{key}")
        if value not in ok:
            raise _refuse(path, key, value, what)
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}  # outermost first
    if "token_embd.weight" not in shapes:
        raise LogprobeError("model", f"{path.name} has no token_embd.weight tensor")
    hidden, heads = _need(reader, "embedding_length", path), _need(reader, "attention.head_count", path)
    head_dim = _int_field(reader, "gemma3.attention.key_length", path, hidden // heads)
    for key in ("attention.value_length", "rope.dimension_count"):
        value = _int_field(reader, f"gemma3.{key}", path, head_dim)
        if value != head_dim:
            raise _refuse(path, key, value, f"not the {head_dim}-wide heads")
    layers = _need(reader, "block_count", path)
    window = _int_field(reader, "gemma3.attention.sliding_window", path, 0) or 0
    cap = _field(reader, "gemma3.final_logit_softcapping")
    return GemmaConfig(
        vocab_size=shapes["token_embd.weight"][0], hidden_size=hidden,
        intermediate_size=_need(reader, "feed_forward_length", path), num_layers=layers, num_heads=heads,
        num_kv_heads=_int_field(reader, "gemma3.attention.head_count_kv", path, heads), head_dim=head_dim,
        layer_types=_layer_types(reader, path, layers, window), sliding_window=window if window > 0 else 1 << 62,
        # llama.cpp's rule (by block count), which is the released configs' query_pre_attn_scalar
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        rms_norm_eps=float(_field(reader, "gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, "gemma3.rope.freq_base", 10000.0)), rope_scaling=_rope_scaling(reader, path),
        rope_local_theta=float(_field(reader, "gemma3.rope.freq_base_swa", 10000.0)), rope_local_scaling=None,
        tie_word_embeddings="output.weight" not in shapes,
        max_position_embeddings=int(_field(reader, "gemma3.context_length", 131072)),
        final_logit_softcapping=float(cap) if cap else None, family="gemma3_text")


def gguf_gemma_tensors(reader, cfg: GemmaConfig):
    """Yield (native parameter name, float32 tensor) for ``build_gemma``."""
    for t in reader.tensors:
        type_id = int(t.tensor_type)
        if type_id not in GGML_TYPES:
            raise LogprobeError("model", f"tensor {t.name} has GGUF type {t.tensor_type.name}, which logprobe "
                                "does not read", "use a file with F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K or Q6_K tensors")
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m is not None and m.group(2) in _LAYER and int(m.group(1)) < cfg.num_layers:
            name = f"layers.{m.group(1)}.{_LAYER[m.group(2)]}"
        elif m is None and t.name in _TOP:
            name = _TOP[t.name]
        else:
            raise LogprobeError("model", f"tensor {t.name!r} of a gemma3 GGUF file has no place in the native model",
                                _FIX)
        w = dequantize(t.data, type_id, tuple(int(x) for x in reversed(t.shape)))
        yield name, (w - 1 if name.endswith("norm.weight") else w)  # the converter's baked-in 1 + w
