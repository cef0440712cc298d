"""GGUF files of the hybrid linear-attention Qwen families (``models.qwen3_next``) as llama.cpp's
converter writes them: ``qwen3next`` (Qwen3-Next), ``qwen35`` (Qwen3.5 dense) and ``qwen35moe``
(Qwen3.5 MoE). The converter's transforms are inverted exactly:

    GGUF tensor                       native parameter              inverse of the converter's step
    attn_norm / post_attention_norm   input_ / post_attention_      w - 1 (it baked in the 1 + w
    output_norm, attn_q/k_norm        layernorm, norm, q/k_norm     of the offset RMSNorms)
    ssm_a                             A_log                         log(-a) (it stored -exp(A_log))
    ssm_dt.bias                       dt_bias
    ssm_conv1d [C, K]                 conv_weight [C, K]
    attn_qkv / attn_gate              in_proj_qkv / in_proj_z
    ssm_beta / ssm_alpha (qwen35*)    in_proj_b / in_proj_a
    ssm_ba (qwen3next)                in_proj_b / in_proj_a         per key head [b (r rows) | a (r rows)]
    ssm_in + ssm_ba (old qwen3next)   the four projections          Qwen3-Next's fused layout, split
    ssm_norm, ssm_out                 norm (as stored), out_proj

``qwen35`` / ``qwen35moe`` files hold the value heads "tiled" (``[k0 v0, k1 v0, ..., k0 v1, ...]``,
the order ggml broadcasts in) where the checkpoint groups them by key head (``[k0 v0, k0 v1, ...,
k1 v0, ...]``) whenever there are more value than key heads: the v rows of attn_qkv and its conv
channels, attn_gate, ssm_beta/alpha, ssm_a, ssm_dt and the columns of ssm_out are put back.
Multi-token-prediction blocks past ``block_count - nextn_predict_layers`` are skipped. Quantized
tensors are expanded to the model dtype at load (these families run dense from GGUF).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..kernels.gguf_quants import GGML_TYPES, dequantize
from ..layers.gated_delta import split_qwen3_next_projections
from ..layers.moe import MoeSpec
from ..models.qwen3_next import HybridConfig
from .gguf import _field, _int_field

log = logging.getLogger(__name__)

HYBRID_ARCHES = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}

_NORMS = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
          "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_PLAIN = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj", "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# linear-attention tensors whose value heads qwen35 files tile: (native name, rows per head; None: see _untile)
_LINEAR = {"attn_qkv.weight": "in_proj_qkv.weight", "attn_gate.weight": "in_proj_z.weight",
           "ssm_beta.weight": "in_proj_b.weight", "ssm_alpha.weight": "in_proj_a.weight",
           "ssm_a": "A_log", "ssm_dt.bias": "dt_bias", "ssm_conv1d.weight": "conv_weight",
           "ssm_out.weight": "out_proj.weight"}
_FUSED = ("ssm_ba.weight", "ssm_in.weight")  # qwen3next: split once a layer's tensors are all read


def _need(reader, arch: str, key: str, path: Path) -> int:
    value = _int_field(reader, f"{arch}.{key}", path)
    if value is None:
        raise LogprobeError("model", f"{path.name} has no {arch}.{key}", f"the file is not a complete {arch} model")
    return value


def _refuse(path: Path, key: str, value, what: str):
    return LogprobeError("model", f"{path.name} sets {key} = {value!r} ({what}), which the native hybrid model "
                         "does not run: ignoring it would give a silently wrong model",
                         "logprobe reads qwen3next / qwen35 / qwen35moe GGUF files as llama.cpp's converter writes them")


def _check_keys(reader, arch: str, path: Path) -> None:
    """Refuse metadata that changes the function and has no place in the native model."""
    unused = (("rope.scaling.type", ("none",), "RoPE scaling"), ("rope.scaling.factor", (0, 1), "RoPE scaling"),
              ("attention.scale", (0,), "a custom attention scale"), ("attention.causal", (True,), "non-causal attention"),
              ("attention.sliding_window", (0,), "sliding-window attention"),
              ("expert_gating_func", (1,), "a non-softmax router"),
              ("expert_weights_scale", (0, 1), "scaled expert weights"),
              ("expert_group_count", (0, 1), "grouped expert routing"),
              ("logit_scale", (1,), "a logit scale"), ("embedding_scale", (1,), "an embedding scale"),
              ("final_logit_softcapping", (0,), "final logit soft-capping"))
    for suffix, ok, what in unused:
        key = f"{arch}.{suffix}"
        value = _field(reader, key)
        if value is not None and value not in ok:
            raise _refuse(path, key, value, what)
    norm = _field(reader, f"{arch}.expert_weights_norm")
    if norm is not None and not norm:  # llama.cpp renormalises the top k of these families
        raise _refuse(path, f"{arch}.expert_weights_norm", norm, "top-k weights not renormalised")


def _layer_types(reader, arch: str, path: Path, layers: int) -> tuple[str, ...]:
    """llama.cpp's rule: ``attention.recurrent_layers`` (per block) if present, else a full-attention
    block every ``full_attention_interval`` blocks (default 4)."""
    recurrent = _field(reader, f"{arch}.attention.recurrent_layers")
    if recurrent is not None:
        flags = list(recurrent)[:layers]
        return tuple("linear_attention" if f else "full_attention" for f in flags)
    every = _int_field(reader, f"{arch}.full_attention_interval", path, 4)
    if every < 1:
        raise _refuse(path, f"{arch}.full_attention_interval", every, "no attention pattern")
    return tuple("linear_attention" if (i + 1) % every else "full_attention" for i in range(layers))


def gguf_hybrid_config(reader, path: Path) -> HybridConfig:
    arch = _field(reader, "general.architecture")
    _check_keys(reader, arch, path)
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}  # outermost first
    if "token_embd.weight" not in shapes:
        raise LogprobeError("model", f"{path.name} has no token_embd.weight tensor")
    hidden, heads = _need(reader, arch, "embedding_length", path), _need(reader, arch, "attention.head_count", path)
    head_dim = _int_field(reader, f"{arch}.attention.key_length", path, hidden // heads)
    value_len = _int_field(reader, f"{arch}.attention.value_length", path, head_dim)
    if value_len != head_dim:
        raise _refuse(path, f"{arch}.attention.value_length", value_len, f"values narrower than the {head_dim} keys")
    rot = _int_field(reader, f"{arch}.rope.dimension_count", path, head_dim)  # llama.cpp: whole heads
    # qwen35's multimodal sections: for text every section's position is the token's, so plain rotary
    sections = _field(reader, f"{arch}.rope.dimension_sections")
    if sections is not None and (arch == "qwen3next" or 2 * sum(sections) != rot):
        raise _refuse(path, f"{arch}.rope.dimension_sections", sections, "sections not covering the rotary dims")
    nextn = _int_field(reader, f"{arch}.nextn_predict_layers", path, 0) or 0
    layers = _need(reader, arch, "block_count", path) - nextn
    hk, hv = _need(reader, arch, "ssm.group_count", path), _need(reader, arch, "ssm.time_step_rank", path)
    inner = _need(reader, arch, "ssm.inner_size", path)
    if inner % hv:
        raise _refuse(path, f"{arch}.ssm.inner_size", inner, f"not a multiple of {hv} value heads")
    moe = None
    routed = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes]
    if routed:
        first = routed[0]
        if f"blk.{first}.ffn_gate_up_exps.weight" in shapes:
            raise LogprobeError("model", f"{path.name}: tensor blk.{first}.ffn_gate_up_exps.weight (fused expert "
                                "gate/up) is not read", "convert with a llama.cpp that writes ffn_gate_exps / ffn_up_exps")
        shexp = shapes.get(f"blk.{first}.ffn_gate_shexp.weight")
        moe = MoeSpec(num_experts=_need(reader, arch, "expert_count", path),
                      top_k=_need(reader, arch, "expert_used_count", path),
                      intermediate_size=shapes[f"blk.{first}.ffn_gate_exps.weight"][1], norm_topk_prob=True,
                      shared_intermediate_size=shexp[0] if shexp else 0,
                      dense_layers=tuple(i for i in range(layers) if i not in routed))
    dense = next((shapes[f"blk.{i}.ffn_gate.weight"][0] for i in range(layers) if f"blk.{i}.ffn_gate.weight" in shapes), 0)
    cfg = HybridConfig(
        vocab_size=shapes["token_embd.weight"][0], hidden_size=hidden, num_layers=layers,
        layer_types=_layer_types(reader, arch, path, layers), num_heads=heads,
        num_kv_heads=_int_field(reader, f"{arch}.attention.head_count_kv", path, heads), head_dim=head_dim,
        linear_num_key_heads=hk, linear_num_value_heads=hv,
        linear_key_head_dim=_need(reader, arch, "ssm.state_size", path), linear_value_head_dim=inner // hv,
        linear_conv_kernel_dim=_need(reader, arch, "ssm.conv_kernel", path), intermediate_size=dense,
        partial_rotary_factor=rot / head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in shapes,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 32768)),
        moe=moe, family=HYBRID_ARCHES[arch])
    if cfg.rotary_dim != rot:
        raise _refuse(path, f"{arch}.rope.dimension_count", rot, f"not a whole part of the {head_dim}-wide heads")
    return cfg


def _untile(w: torch.Tensor, hk: int, hv: int, width: int, dim: int = 0) -> torch.Tensor:
    """qwen35's tiled value heads -> the checkpoint's key-head-grouped order along ``dim``: entry
    (j, i) of [r, Hk] (j-th value head of key head i) goes back to (i, j) of [Hk, r]; ``width``
    rows (or columns) per head."""
    if hk == hv:
        return w
    r = hv // hk
    w = w.movedim(dim, 0)
    rest = w.shape[1:]
    w = w.reshape(r, hk, width, *rest).transpose(0, 1).reshape(hv * width, *rest)  # [r, Hk, ...] -> [Hk, r, ...]
    return w.movedim(0, dim).contiguous()


def _linear_tensor(key: str, w: torch.Tensor, arch: str, cfg: HybridConfig) -> torch.Tensor:
    """One linear-attention tensor in the native layout (``_LINEAR``)."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    if key == "ssm_a":
        if (w >= 0).any():
            raise LogprobeError("model", "ssm_a holds a non-negative entry: llama.cpp's converter stores "
                                "-exp(A_log) < 0, so this file's decay cannot be read back")
        w = torch.log(-w.double()).float()
    if arch == "qwen3next":
        return w
    if key in ("attn_qkv.weight", "ssm_conv1d.weight"):  # only the v rows / channels are tiled
        return torch.cat([w[:2 * hk * dk], _untile(w[2 * hk * dk:], hk, hv, dv)])
    if key == "ssm_out.weight":
        return _untile(w, hk, hv, dv, dim=1)
    return _untile(w, hk, hv, dv if key == "attn_gate.weight" else 1)


def gguf_hybrid_tensors(reader, arch: str, cfg: HybridConfig):
    """Yield (native parameter name, float32 tensor) for ``build_hybrid``."""
    fused: dict[int, dict[str, torch.Tensor]] = {}
    skipped = 0
    for t in reader.tensors:
        type_id = int(t.tensor_type)
        if type_id not in GGML_TYPES:
            raise LogprobeError("model", f"tensor {t.name} has GGUF type {t.tensor_type.name}, which logprobe "
                                "does not read", "use a file with F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K or Q6_K tensors")
        shape = tuple(int(x) for x in reversed(t.shape))
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m and int(m.group(1)) >= cfg.num_layers:
            skipped += 1  # a multi-token-prediction block
            continue
        w = dequantize(t.data, type_id, shape)
        if t.name == "token_embd.weight":
            yield "embed_tokens.weight", w
        elif t.name == "output.weight":
            yield "lm_head.weight", w
        elif t.name == "output_norm.weight":
            yield "norm.weight", w - 1
        elif m is None:
            raise LogprobeError("model", f"unexpected tensor {t.name!r} in a {arch} GGUF file")
        else:
            i, key = int(m.group(1)), m.group(2)
            if key in _NORMS:
                yield f"layers.{i}.{_NORMS[key]}", w - 1
            elif key in _PLAIN:
                yield f"layers.{i}.{_PLAIN[key]}", w
            elif key == "ffn_gate_inp_shexp.weight":  # stored as a vector [H]
                yield f"layers.{i}.mlp.shared_expert_gate.weight", w.reshape(1, -1)
            elif key in _LINEAR:
                yield f"layers.{i}.linear_attn.{_LINEAR[key]}", _linear_tensor(key, w, arch, cfg)
            elif key in _FUSED and arch == "qwen3next":
                fused.setdefault(i, {})[key] = w
            else:
                raise LogprobeError("model", f"tensor {t.name!r} of a {arch} GGUF file has no place in the native "
                                    "model", "this file is not a qwen3next / qwen35 / qwen35moe model logprobe reads")
    yield from _split_fused(fused, cfg)
    if skipped:
        log.warning("skipped %d tensors of multi-token-prediction blocks (not used to score text)", skipped)


def _split_fused(fused: dict[int, dict[str, torch.Tensor]], cfg: HybridConfig):
    """qwen3next: ssm_ba (b and a rows per key head), and with the legacy ssm_in (the checkpoint's
    fused in_proj_qkvz) the qkv and z projections too."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    for i, got in fused.items():
        if "ssm_ba.weight" not in got:
            raise LogprobeError("model", f"blk.{i}.ssm_in.weight without blk.{i}.ssm_ba.weight")
        ba = got["ssm_ba.weight"]
        qkvz = got.get("ssm_in.weight")
        if qkvz is None:  # only ba: split it with an empty qkvz of the right shape
            qkvz = ba.new_zeros(hk * (2 * dk + 2 * (hv // hk) * dv), ba.shape[1])
        parts = split_qwen3_next_projections(qkvz, ba, hk, dk, hv, dv)
        for part in (("in_proj_qkv", "in_proj_z") if "ssm_in.weight" in got else ()) + ("in_proj_b", "in_proj_a"):
            yield f"layers.{i}.linear_attn.{part}.weight", parts[part].contiguous()
