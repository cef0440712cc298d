"""Hugging Face directories of the Llama-style sigmoid-router MoE families: GLM-4.5 / 4.6 (``glm4_moe``,
``models.glm4_moe``) and MiniMax-M2 (``minimax_m2``, ``models.minimax_m2``).

Checkpoint keys as transformers and the hub write them. glm4_moe: ``mlp.experts.{e}.{gate,up,down}_proj``
(or transformers' in-memory ``experts.gate_up_proj``), ``mlp.shared_experts`` (-> ``mlp.shared_expert``),
``mlp.gate.e_score_correction_bias`` (-> ``mlp.e_score_correction_bias``); the router and its bias stay
float32 whatever the model dtype (transformers' ``_keep_in_fp32_modules_strict``). minimax_m2 (Mixtral's
names): ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate/up/down), ``block_sparse_moe.gate``,
``block_sparse_moe.e_score_correction_bias``; its router and bias take the model dtype, as transformers
loads them. Multi-token-prediction layers past ``num_hidden_layers`` are skipped with one note. Config
options the native models do not run are refused with their key named.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..layers.moe import MoeSpec
from ..models.glm4_moe import PartialRotaryConfig, PartialRotaryMoeModel
from ..models.minimax_m2 import sigmoid_model_class
from ..parallel.context import ParallelContext
from .checkpoint import check_weights_match, named_plain_tensors
from .deepseek import ROUTER_BIAS, _int, rank_reader
from .fp8_block import fp8_block_tensors, fp8_scheme, install_packed, is_fp8_block, split_packed, with_shapes
from .gguf_sigmoid_moe import SIGMOID_ARCHES, gguf_sigmoid_moe_config, gguf_sigmoid_moe_tensors
from .hf import stack_experts
from .llama import llama_parallel_context
from .registry import Family, register

log = logging.getLogger(__name__)

SIGMOID_MOE_TYPES = ("glm4_moe", "minimax_m2")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_MINIMAX_EXPERT = re.compile(r"(.*\.experts\.\d+\.)(w[123])(\.weight)")
_MINIMAX_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def model_class(cfg: PartialRotaryConfig) -> type[PartialRotaryMoeModel]:
    return sigmoid_model_class(cfg)


def _rope(raw: dict, mtype: str, head_dim: int) -> tuple[float, int]:
    """(rope_theta, rotary dims per head); only the default rotary (what the released models use)."""
    params = raw.get("rope_parameters")
    where = "config.rope_parameters"
    if params is None:
        params, where = dict(raw.get("rope_scaling") or {}), "config.rope_scaling"
    if not isinstance(params, dict):
        raise LogprobeError(where, f"must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind != "default":
        raise LogprobeError(f"{where}.rope_type", f"{kind!r} is not in the native {mtype} model",
                            "the released models use the default rotary")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 5000000.0 if mtype == "minimax_m2" else 10000.0)))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if mtype == "minimax_m2" and raw.get("rotary_dim") is not None and factor is None:
        return theta, _int(raw, "rotary_dim")
    if factor is None:
        factor = 0.5 if mtype == "glm4_moe" else 1.0  # Glm4MoeConfig's default
    return theta, int(head_dim * float(factor))


def _refuse(raw: dict, mtype: str, checks) -> None:
    for key, want, fix in checks:
        value = raw.get(key, want)
        if value != want:
            raise LogprobeError(f"config.{key}", f"{value!r}: the native {mtype} model runs {want!r} only", fix)


def sigmoid_moe_config(raw: dict) -> PartialRotaryConfig:
    """The native config of a glm4_moe / minimax_m2 checkpoint; refuses (naming the key) what it does not
    run. Missing keys take transformers' config defaults."""
    mtype = raw.get("model_type")
    if raw.get("quantization_config") is not None and not is_fp8_block(raw):
        method = (raw["quantization_config"] or {}).get("quant_method", "?") if isinstance(
            raw["quantization_config"], dict) else "?"
        raise LogprobeError("quantization_config", f"a quantized ({method}) {mtype} checkpoint is not read "
                            "natively (FP8 block checkpoints, quant_method 'fp8', are)", "score a float (bf16) checkpoint")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise LogprobeError("config.hidden_act", f"{raw.get('hidden_act')!r}: the native {mtype} model runs silu only")
    glm = mtype == "glm4_moe"
    d = (dict(vocab=151552, hidden=4096, inter=10944, layers=46, heads=96, kv=8, experts=128, k=8, eps=1e-5,
              pos=131072) if glm else
         dict(vocab=200064, hidden=3072, inter=1536, layers=62, heads=48, kv=8, experts=256, k=8, eps=1e-6,
              pos=196608))
    hidden, heads = _int(raw, "hidden_size", d["hidden"]), _int(raw, "num_attention_heads", d["heads"])
    head_dim = _int(raw, "head_dim", hidden // heads if glm else 128, null_ok=True) or hidden // heads
    theta, rot = _rope(raw, mtype, head_dim)
    layers = _int(raw, "num_hidden_layers", d["layers"])
    inter = _int(raw, "intermediate_size", d["inter"])
    if glm:
        experts = _int(raw, "n_routed_experts", d["experts"])
        moe_inter = _int(raw, "moe_intermediate_size", 1408)
        spec = MoeSpec(num_experts=experts, top_k=_int(raw, "num_experts_per_tok", d["k"]),
                       intermediate_size=moe_inter, norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                       shared_intermediate_size=moe_inter * (_int(raw, "n_shared_experts", 1, null_ok=True) or 0),
                       dense_layers=tuple(range(min(_int(raw, "first_k_dense_replace", 1), layers))),
                       router="sigmoid_grouped", n_group=_int(raw, "n_group", 1), topk_group=_int(raw, "topk_group", 1),
                       routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))
        qk_norm, qk_norm_full, bias = bool(raw.get("use_qk_norm", False)), False, bool(raw.get("attention_bias", False))
    else:
        # what MiniMaxM2's modeling file runs; the released config.json carries these keys too
        _refuse(raw, mtype, (("scoring_func", "sigmoid", "MiniMax-M2 scores experts with sigmoid"),
                             ("use_routing_bias", True, "MiniMax-M2 chooses experts with e_score_correction_bias"),
                             ("use_qk_norm", True, "MiniMax-M2 normalises q and k"),
                             ("qk_norm_type", "per_layer", "MiniMax-M2 normalises q and k over the whole projection"),
                             ("shared_intermediate_size", 0, "MiniMax-M2 has no shared expert"),
                             ("attention_bias", False, "MiniMax-M2's projections have no bias")))
        if raw.get("use_mtp") and raw.get("num_mtp_modules"):
            log.info("config.num_mtp_modules=%s: multi-token-prediction modules are not used to score text",
                     raw.get("num_mtp_modules"))
        attn_types = raw.get("attn_type_list")
        if attn_types is not None and any(t != 1 for t in attn_types):
            raise LogprobeError("config.attn_type_list", "has linear-attention blocks (0): the native minimax_m2 "
                                "model runs full attention (1) in every block", "MiniMax-M2's list is all 1")
        spec = MoeSpec(num_experts=_int(raw, "num_local_experts", d["experts"]),
                       top_k=_int(raw, "num_experts_per_tok", d["k"]), intermediate_size=inter, norm_topk_prob=True,
                       router="sigmoid_grouped")
        qk_norm, qk_norm_full, bias = False, True, False
    if raw.get("sliding_window") is not None:
        raise LogprobeError("config.sliding_window", f"{raw['sliding_window']!r}: {mtype} attends to every "
                            "earlier token in transformers", "remove the key")
    kv = _int(raw, "num_key_value_heads", d["kv"], null_ok=True) or heads
    return PartialRotaryConfig(
        vocab_size=_int(raw, "vocab_size", d["vocab"]), hidden_size=hidden, intermediate_size=inter,
        num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", d["eps"])), rope_theta=theta, rope_scaling=None,
        attention_bias=bias, qk_norm=qk_norm, qk_norm_full=qk_norm_full,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=_int(raw, "max_position_embeddings", d["pos"]), moe=spec,
        rotary_dim=rot, family=str(mtype))


def sigmoid_moe_param_name(key: str, cfg: PartialRotaryConfig, where: str) -> str | None:
    """A checkpoint key -> the native parameter name (None: unused: rotary tables, MTP layers)."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    if key == "lm_head.weight":
        return None if cfg.tie_word_embeddings else "lm_head.weight"
    m = _LAYER.match(key)
    if m is not None and int(m.group(1)) >= cfg.num_layers:
        return None  # an MTP layer
    if not key.startswith("model."):
        raise LogprobeError("model", f"unexpected tensor {key!r} in {where}")
    name = key[len("model."):]
    if cfg.family == "minimax_m2":
        name = name.replace(".block_sparse_moe.", ".mlp.")
        e = _MINIMAX_EXPERT.fullmatch(name)
        if e is not None:
            name = e.group(1) + _MINIMAX_PROJ[e.group(2)] + e.group(3)
        return name
    name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")


def sigmoid_moe_tensors(path: Path, cfg: PartialRotaryConfig, raw: dict | None = None,
                        quantize_activations: bool = False, cut=None, held: tuple[int, int] | None = None,
                        place=None):
    """Yield (native parameter name, tensor or packed layer), experts stacked [E, out, in]; an FP8
    block checkpoint (``loading.fp8_block``) yields its FP8 layers. ``cut`` / ``held``: a rank's
    reading (``loading.sharding.rank_cut``; FP8 weights by whole rows, ``fp8_block.fp8_rows``) and its experts [start, end);
    ``place``: the model's (device, dtype), where float experts are stacked as read (``hf.stack_experts``)."""
    if raw is not None and is_fp8_block(raw):
        scheme = fp8_scheme(raw["quantization_config"], quantize_activations)
        yield from stack_experts(fp8_block_tensors(path, scheme, lambda key, file: sigmoid_moe_param_name(key, cfg, file),
                                                   log, cut), cfg, held, place)
        return
    yield from stack_experts(_plain(path, cfg, cut), cfg, held, place)


def _plain(path: Path, cfg, cut=None):
    return named_plain_tensors(path, lambda key, file: sigmoid_moe_param_name(key, cfg, file), log, cut)


def build_sigmoid_moe(cfg: PartialRotaryConfig, tensors, device: torch.device, dtype: torch.dtype,
                      ctx: ParallelContext | None = None) -> PartialRotaryMoeModel:
    """The native model from (name, tensor) pairs: every parameter present with the shape the config
    implies, GLM's router in float32, q/k rows permuted to the interleaved layout on the rotary dims."""
    fp32 = (".mlp.gate.weight", ".mlp.e_score_correction_bias") if cfg.family == "glm4_moe" else ()
    state, packed, experts = split_packed(tensors, device, dtype, fp32)  # packed: FP8 block layers
    cls = model_class(cfg)
    with torch.device("meta"):
        model = cls(cfg, ctx=ctx)
    check_weights_match(model, with_shapes(state, packed, experts))
    install_packed(model, state, packed, experts, lambda s: cls.interleave_rope_weights(cfg, s))
    model.load_state_dict(cls.interleave_rope_weights(cfg, state), assign=True, strict=not (packed or experts))
    # non-persistent buffers were created on the meta device: make the rotary table for real
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta).to(device)
    model.fuse_projections()
    return model.eval()


FAMILY = register(Family(
    name="sigmoid_moe", title="GLM-4.5 / MiniMax-M2", config_class=PartialRotaryConfig,
    model_types=SIGMOID_MOE_TYPES,
    config=lambda raw: (sigmoid_moe_config(raw), ""),
    model_class=model_class,
    tensors=lambda path, cfg, raw, load: sigmoid_moe_tensors(path, cfg, raw, load.quantize_activations,
                                                             place=load.place),
    build=lambda cfg, tensors, load, ctx: build_sigmoid_moe(cfg, tensors, load.device, load.dtype, ctx),
    parallel_context=llama_parallel_context,
    shard_tensors=rank_reader(sigmoid_moe_tensors),
    param_name=sigmoid_moe_param_name,
    gguf_archs=tuple(SIGMOID_ARCHES),  # read whole, expanded, on one device (loading.gguf_sigmoid_moe)
    gguf_config=gguf_sigmoid_moe_config,
    gguf_tensors=lambda reader, arch, cfg, load: gguf_sigmoid_moe_tensors(reader, arch, cfg),
    data_attention=True,
    buffers=ROUTER_BIAS,
))
