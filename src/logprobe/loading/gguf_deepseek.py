"""GGUF files of llama.cpp's ``deepseek2`` architecture (DeepSeek-V3 / V3.1, Kimi K2, Moonlight as
its converter writes them) onto the native ``models.deepseek`` model.

What the converter does, undone here:

    GGUF                                  native                          note
    attn_q_a, attn_q_a_norm, attn_q_b     self_attn.q_a_proj, ...         or attn_q (q_lora_rank unset)
    attn_kv_a_mqa, attn_kv_a_norm         kv_a_proj_with_mqa, kv_a_layernorm
    attn_k_b [H, kv_lora, nope]           kv_b_proj rows per head:        newer files: k_b transposed
      + attn_v_b [H, v, kv_lora]            [k_nope (nope) | v (v)]       and v_b split out of kv_b
    attn_kv_b                             kv_b_proj                       older files: as the checkpoint
    exp_probs_b.bias                      mlp.e_score_correction_bias     (absent: zero, i.e. no bias)
    ffn_*_exps / ffn_*_shexp              mlp.experts.* / mlp.shared_expert.*

Metadata: ``leading_dense_block_count`` (first_k_dense_replace), ``q_lora_rank``, ``kv_lora_rank``,
``attention.key_length_mla`` / ``value_length_mla`` (older files: ``key_length`` / ``value_length``
are the per-head q/k and v widths), ``rope.dimension_count`` (the rope dims), ``expert_*`` (count,
used, shared count, feed-forward length, ``weights_scale`` = routed_scaling_factor, ``weights_norm``
= norm_topk_prob (absent: false, as llama.cpp reads it), ``group_count`` / ``group_used_count``),
``expert_gating_func`` must be sigmoid (2: the DeepSeek-V3 router; older softmax DeepSeek-V2 files
are refused), YaRN as ``rope.scaling.*`` with ``yarn_log_multiplier`` = 0.1 * mscale_all_dim (llama.cpp
takes YaRN's cos/sin factor as 1, i.e. mscale = mscale_all_dim). The rope dims run interleaved, as
llama.cpp rotates them (the released checkpoints' ``rope_interleave``). Multi-token-prediction
blocks past ``block_count - nextn_predict_layers`` are skipped. Tensors are expanded at load.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..kernels.gguf_quants import GGML_TYPES, dequantize
from ..layers.moe import MoeSpec
from ..models.deepseek import DeepseekConfig
from .gguf import _field, _int_field

log = logging.getLogger(__name__)

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight", "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.e_score_correction_bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj", "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
_TOP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
_FIX = "logprobe reads deepseek2 GGUF files of DeepSeek-V3-style models as llama.cpp's converter writes them"


def _need(reader, key: str, path: Path) -> int:
    value = _int_field(reader, f"deepseek2.{key}", path)
    if value is None:
        raise LogprobeError("model", f"{path.name} has no deepseek2.{key}", "the file is not a complete deepseek2 model")
    return value


def _refuse(path: Path, key: str, value, what: str) -> LogprobeError:
    return LogprobeError("model", f"{path.name} sets deepseek2.{key} = {value!r} ({what}), which the native "
                         "DeepSeek model does not run: ignoring it would give a silently wrong model", _FIX)


def _rope_scaling(reader, path: Path) -> dict | None:
    kind = _field(reader, "deepseek2.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise _refuse(path, "rope.scaling.type", kind, "RoPE scaling other than yarn")
    for key, ok in (("rope.scaling.yarn_ext_factor", (None, 1.0, -1.0)), ("rope.scaling.attn_factor", (None, 1.0)),
                    ("rope.scaling.yarn_attn_factor", (None, 1.0))):
        value = _field(reader, f"deepseek2.{key}")
        if value not in ok:
            raise _refuse(path, key, value, "a YaRN factor transformers' DeepSeek model does not have")
    log_mul = float(_field(reader, "deepseek2.rope.scaling.yarn_log_multiplier", 0.0))
    scaling = {"rope_type": "yarn", "factor": float(_field(reader, "deepseek2.rope.scaling.factor", 1.0)),
               "original_max_position_embeddings": _need(reader, "rope.scaling.original_context_length", path),
               "beta_fast": float(_field(reader, "deepseek2.rope.scaling.yarn_beta_fast", 32.0)),
               "beta_slow": float(_field(reader, "deepseek2.rope.scaling.yarn_beta_slow", 1.0))}
    if log_mul:  # the converter writes 0.1 * mscale_all_dim; llama.cpp's cos/sin factor is 1 (mscale = all_dim)
        scaling["mscale"] = scaling["mscale_all_dim"] = log_mul / 0.1
    else:
        scaling["attention_factor"] = 1.0
    return scaling


def _moe(reader, path: Path, layers: int, shapes: dict) -> MoeSpec:
    gating = _field(reader, "deepseek2.expert_gating_func")
    if gating != 2:  # llama.cpp's default for deepseek2 is softmax (DeepSeek-V2)
        raise _refuse(path, "expert_gating_func", gating, "not the sigmoid router of DeepSeek-V3")
    inter = _need(reader, "expert_feed_forward_length", path)
    dense = _int_field(reader, "deepseek2.leading_dense_block_count", path, 0)
    for i in range(dense, layers):
        if f"blk.{i}.ffn_gate_inp.weight" not in shapes:
            raise LogprobeError("model", f"{path.name}: block {i} has no router blk.{i}.ffn_gate_inp.weight, but "
                                f"deepseek2.leading_dense_block_count = {dense} makes it a mixture of experts", _FIX)
    return MoeSpec(num_experts=_need(reader, "expert_count", path), top_k=_need(reader, "expert_used_count", path),
                   intermediate_size=inter,
                   norm_topk_prob=bool(_field(reader, "deepseek2.expert_weights_norm", False)),
                   shared_intermediate_size=inter * (_int_field(reader, "deepseek2.expert_shared_count", path, 0) or 0),
                   dense_layers=tuple(range(min(dense, layers))), router="sigmoid_grouped",
                   n_group=_int_field(reader, "deepseek2.expert_group_count", path, 1) or 1,
                   topk_group=_int_field(reader, "deepseek2.expert_group_used_count", path, 1) or 1,
                   routed_scaling_factor=float(_field(reader, "deepseek2.expert_weights_scale", 1.0) or 1.0))


def gguf_deepseek_config(reader, path: Path) -> DeepseekConfig:
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}  # outermost first
    if "token_embd.weight" not in shapes:
        raise LogprobeError("model", f"{path.name} has no token_embd.weight tensor")
    heads = _need(reader, "attention.head_count", path)
    kv_heads = _int_field(reader, "deepseek2.attention.head_count_kv", path, heads)
    if kv_heads not in (1, heads):  # the converter writes 1 (latent attention as MQA)
        raise _refuse(path, "attention.head_count_kv", kv_heads, "grouped latent attention")
    rope = _need(reader, "rope.dimension_count", path)
    if _field(reader, "deepseek2.attention.key_length_mla") is not None:
        qk, v = _need(reader, "attention.key_length_mla", path), _need(reader, "attention.value_length_mla", path)
    else:  # files from before the absorbed-MLA layout: key/value length are the per-head widths
        qk, v = _need(reader, "attention.key_length", path), _need(reader, "attention.value_length", path)
    nextn = _int_field(reader, "deepseek2.nextn_predict_layers", path, 0) or 0
    layers = _need(reader, "block_count", path) - nextn
    moe = _moe(reader, path, layers, shapes)
    return DeepseekConfig(
        vocab_size=shapes["token_embd.weight"][0], hidden_size=_need(reader, "embedding_length", path),
        intermediate_size=_need(reader, "feed_forward_length", path), num_layers=layers, num_heads=heads,
        q_lora_rank=_int_field(reader, "deepseek2.attention.q_lora_rank", path, None) or None,
        kv_lora_rank=_need(reader, "attention.kv_lora_rank", path), qk_nope_head_dim=qk - rope,
        qk_rope_head_dim=rope, v_head_dim=v, moe=moe, first_k_dense_replace=len(moe.dense_layers),
        rms_norm_eps=float(_field(reader, "deepseek2.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, "deepseek2.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, path), rope_interleave=True,
        tie_word_embeddings="output.weight" not in shapes,
        max_position_embeddings=int(_field(reader, "deepseek2.context_length", 4096)), family="deepseek_v3")


def gguf_deepseek_tensors(reader, cfg: DeepseekConfig):
    """Yield (native parameter name, float32 tensor) for ``build_deepseek``."""
    split: dict[int, dict[str, torch.Tensor]] = {}
    biased: set[int] = set()
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
        elif m is not None and m.group(2) in ("attn_k_b.weight", "attn_v_b.weight"):
            split.setdefault(int(m.group(1)), {})[m.group(2)] = w
        elif m is not None and m.group(2) in _LAYER:
            biased.update([int(m.group(1))] if m.group(2) == "exp_probs_b.bias" else [])
            yield f"layers.{m.group(1)}.{_LAYER[m.group(2)]}", w
        else:
            raise LogprobeError("model", f"tensor {t.name!r} of a deepseek2 GGUF file has no place in the native "
                                "model", _FIX)
    for i, got in split.items():
        yield f"layers.{i}.self_attn.kv_b_proj.weight", _join_kv_b(got, i, cfg)
    for i in range(cfg.first_k_dense_replace, cfg.num_layers):
        if i not in biased:  # llama.cpp runs such a router without a correction bias
            yield f"layers.{i}.mlp.e_score_correction_bias", torch.zeros(cfg.moe.num_experts)
    if skipped:
        log.warning("skipped %d tensors of multi-token-prediction blocks (not used to score text)", skipped)


def _join_kv_b(got: dict[str, torch.Tensor], i: int, cfg: DeepseekConfig) -> torch.Tensor:
    """attn_k_b [H, kv_lora, nope] and attn_v_b [H, v, kv_lora] -> kv_b_proj [H * (nope + v), kv_lora]."""
    if len(got) != 2:
        have = next(iter(got))
        raise LogprobeError("model", f"blk.{i}.{have} without its partner "
                            f"blk.{i}.{'attn_v_b' if 'attn_k_b' in have else 'attn_k_b'}.weight", _FIX)
    k_b, v_b = got["attn_k_b.weight"], got["attn_v_b.weight"]
    H, r = cfg.num_heads, cfg.kv_lora_rank
    if tuple(k_b.shape) != (H, r, cfg.qk_nope_head_dim) or tuple(v_b.shape) != (H, cfg.v_head_dim, r):
        raise LogprobeError("model", f"blk.{i}.attn_k_b / attn_v_b have shapes {tuple(k_b.shape)} / "
                            f"{tuple(v_b.shape)}, the config implies {(H, r, cfg.qk_nope_head_dim)} / "
                            f"{(H, cfg.v_head_dim, r)}", _FIX)
    # [H, nope, kv_lora] ++ [H, v, kv_lora] -> [H, nope + v, kv_lora] -> rows per head
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, r).contiguous()
