"""Hugging Face directories of DeepSeek-V3-style models (``models.deepseek``): ``deepseek_v3``
(DeepSeek-V3 / V3.1, Moonlight) and ``kimi_k2`` (Kimi K2: the same architecture under its own
model_type).

Checkpoint keys as transformers and the hub write them: ``model.layers.*``, ``model.embed_tokens``,
``model.norm``, ``lm_head.weight``; experts one matrix per expert (``experts.{e}.gate_proj``; stacked
[E, out, in] at load) or transformers' in-memory ``experts.gate_up_proj``; ``shared_experts`` and the
router's ``gate.e_score_correction_bias`` renamed to the native module. The multi-token-prediction
layers the released checkpoints append (``model.layers.{num_hidden_layers}...``,
``num_nextn_predict_layers``) are not part of the scoring forward and are skipped with one note. The
router (``mlp.gate.weight``) and its bias stay float32 whatever the model dtype, as transformers
keeps them. Config options the native model does not run are refused with their key named.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..layers.moe import MoeSpec
from ..models.deepseek import DeepseekConfig, DeepseekModel
from ..parallel.context import ParallelContext
from .checkpoint import check_weights_match, named_plain_tensors
from .fp8_block import fp8_block_tensors, fp8_scheme, install_packed, is_fp8_block, split_packed, with_shapes
from .gguf_deepseek import gguf_deepseek_config, gguf_deepseek_tensors
from .hf import read_config, stack_experts
from .llama import llama_parallel_context
from .registry import Family, Load, family_of, register
from .sharding import held_experts, rank_cut

log = logging.getLogger(__name__)

DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_FLOAT32 = (".mlp.gate.weight", ".mlp.e_score_correction_bias")  # the router: float32 in any model dtype


def _int(cfg: dict, key: str, default=None, null_ok: bool = False) -> int | None:
    value = cfg.get(key, default)
    if value is None and null_ok:
        return None
    if value is None:
        raise LogprobeError(f"config.{key}", "is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise LogprobeError(f"config.{key}", f"must be an integer, got {value!r}")
    return value


def _rope(cfg: dict) -> tuple[float, dict | None, str]:
    """(rope_theta, YaRN parameters or None, the key to name in errors)."""
    params = cfg.get("rope_parameters")  # transformers >= 5
    if params is not None:
        if not isinstance(params, dict):
            raise LogprobeError("config.rope_parameters", f"must be an object, got {params!r}")
        where = "config.rope_parameters"
    else:  # the hub's configs: rope_theta at the top, rope_scaling beside it
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        where = "config.rope_scaling"
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "yarn"):
        raise LogprobeError(f"{where}.rope_type", f"{kind!r} is not in the native deepseek_v3 model",
                            "the released models use yarn (or the default rotary)")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, None, where
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = "yarn"
    return theta, scaling, where


def deepseek_config(raw: dict) -> DeepseekConfig:
    """The native config of a DeepSeek-V3-style checkpoint; refuses (naming the key) what it does not run.
    Missing keys take transformers' ``DeepseekV3Config`` defaults."""
    mtype = raw.get("model_type")
    if raw.get("quantization_config") is not None and not is_fp8_block(raw):
        method = (raw["quantization_config"] or {}).get("quant_method", "?") if isinstance(
            raw["quantization_config"], dict) else "?"
        raise LogprobeError("quantization_config", f"a quantized ({method}) {mtype} checkpoint is not read natively "
                            "(FP8 block checkpoints, quant_method 'fp8', are)",
                            "score a float (bf16) checkpoint or the FP8 block one")
    refusals = (("topk_method", "noaux_tc", "the released models route with noaux_tc"),
                ("scoring_func", "sigmoid", "the released models score experts with sigmoid"),
                ("hidden_act", "silu", "the released models use silu"),
                ("moe_layer_freq", 1, "every block after first_k_dense_replace is a mixture of experts"))
    for key, want, fix in refusals:
        value = raw.get(key, want)
        if value != want and not (key == "hidden_act" and value == "swish"):
            raise LogprobeError(f"config.{key}", f"{value!r}: the native {mtype} model runs {want!r} only", fix)
    for key in ("ep_size",):
        if raw.get(key, 1) != 1:
            log.info("config.%s=%s ignored (one device holds every expert)", key, raw.get(key))
    heads = _int(raw, "num_attention_heads", 128)
    kv_heads = _int(raw, "num_key_value_heads", heads, null_ok=True) or heads
    if kv_heads != heads:
        raise LogprobeError("config.num_key_value_heads", f"{kv_heads} with {heads} attention heads: latent "
                            "attention expands k and v for every head", "use num_key_value_heads = "
                            "num_attention_heads (as the released models)")
    experts = _int(raw, "n_routed_experts", 256, null_ok=True)
    if not experts:
        raise LogprobeError("config.n_routed_experts", f"{experts!r}: the native {mtype} model needs routed experts")
    theta, scaling, _ = _rope(raw)
    layers = _int(raw, "num_hidden_layers", 61)
    moe_inter = _int(raw, "moe_intermediate_size", 2048)
    spec = MoeSpec(num_experts=experts, top_k=_int(raw, "num_experts_per_tok", 8),
                   intermediate_size=moe_inter,
                   norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                   shared_intermediate_size=moe_inter * (_int(raw, "n_shared_experts", 1, null_ok=True) or 0),
                   dense_layers=tuple(range(min(_int(raw, "first_k_dense_replace", 3), layers))),
                   router="sigmoid_grouped", n_group=_int(raw, "n_group", 8), topk_group=_int(raw, "topk_group", 4),
                   routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)))
    return DeepseekConfig(
        vocab_size=_int(raw, "vocab_size", 129280),
        hidden_size=_int(raw, "hidden_size", 7168),
        intermediate_size=_int(raw, "intermediate_size", 18432),
        num_layers=layers,
        num_heads=heads,
        q_lora_rank=_int(raw, "q_lora_rank", 1536, null_ok=True),
        kv_lora_rank=_int(raw, "kv_lora_rank", 512),
        qk_nope_head_dim=_int(raw, "qk_nope_head_dim", 128),
        qk_rope_head_dim=_int(raw, "qk_rope_head_dim", 64),
        v_head_dim=_int(raw, "v_head_dim", 128),
        moe=spec,
        first_k_dense_replace=_int(raw, "first_k_dense_replace", 3),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleave=bool(raw.get("rope_interleave", True)),
        attention_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=_int(raw, "max_position_embeddings", 4096),
        family=str(mtype),
    )


def deepseek_param_name(key: str, cfg: DeepseekConfig, where: str) -> str | None:
    """A checkpoint key -> the native parameter name (None: a tensor the scoring forward does not
    use: rotary tables, and the multi-token-prediction layers past ``num_hidden_layers``)."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    if key == "lm_head.weight":
        return None if cfg.tie_word_embeddings else "lm_head.weight"
    m = _LAYER.match(key)
    if m is not None and int(m.group(1)) >= cfg.num_layers:
        return None  # an MTP layer
    if key.startswith("model."):
        name = key[len("model."):]
        name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
    raise LogprobeError("model", f"unexpected tensor {key!r} in {where}")


def deepseek_tensors(path: Path, cfg: DeepseekConfig, raw: dict | None = None, quantize_activations: bool = False,
                     cut=None, held: tuple[int, int] | None = None, place=None):
    """Yield (native parameter name, tensor or packed layer) from the safetensors files, experts
    stacked [E, out, in]; an FP8 block checkpoint (``loading.fp8_block``) yields its FP8 layers.
    ``cut`` / ``held``: a rank's reading (``loading.sharding.rank_cut``; FP8 weights by whole rows, ``fp8_block.fp8_rows``) and its
    experts [start, end); ``place``: the model's (device, dtype) (``hf.stack_experts``)."""
    if raw is not None and is_fp8_block(raw):
        scheme = fp8_scheme(raw["quantization_config"], quantize_activations)
        yield from stack_experts(fp8_block_tensors(path, scheme, lambda key, file: deepseek_param_name(key, cfg, file),
                                                   log, cut), cfg, held, place)
        return
    yield from stack_experts(_plain(path, cfg, cut), cfg, held, place)


def _plain(path: Path, cfg, cut=None):
    return named_plain_tensors(path, lambda key, file: deepseek_param_name(key, cfg, file), log, cut)


def build_deepseek(cfg: DeepseekConfig, tensors, device: torch.device, dtype: torch.dtype,
                   ctx: ParallelContext | None = None) -> DeepseekModel:
    """The native model from (name, tensor) pairs: every parameter present with the shape the config
    implies, the router in float32, rope rows permuted to the interleaved layout where needed."""
    state, packed, experts = split_packed(tensors, device, dtype, _FLOAT32)  # packed: FP8 block layers
    with torch.device("meta"):
        model = DeepseekModel(cfg, ctx)
    check_weights_match(model, with_shapes(state, packed, experts))
    install_packed(model, state, packed, experts, lambda s: DeepseekModel.interleave_rope_weights(cfg, s))
    model.load_state_dict(DeepseekModel.interleave_rope_weights(cfg, state), assign=True,
                          strict=not (packed or experts))
    # non-persistent buffers were created on the meta device: make the rotary table for real
    model.rotary = type(model.rotary)(cfg).to(device)
    model.fuse_projections()
    return model.eval()


# The score-correction bias of the sigmoid routers (DeepSeek-V3, GLM-4.5, MiniMax-M2): a buffer in
# transformers that the trainer sets outside the gradient step (aux-loss-free load balancing).
ROUTER_BIAS = (".mlp.e_score_correction_bias",)


def rank_reader(read):
    """A family's ``shard_tensors`` from its whole reader ``read(path, cfg, raw, cut=, held=,
    place=)``: one rank reads the whole model (None); more read their slices, cut as the rank's
    model (built on the meta device) holds them, float or FP8 block."""
    def shard_tensors(path: Path, cfg, ctx: ParallelContext, load: Load):
        if ctx.size == 1:
            return None
        raw = read_config(path)  # float or FP8 block (the configs refuse other quantization)
        family = family_of(cfg)
        with torch.device("meta"):
            rank_model = family.model_class(cfg)(cfg, ctx=ctx)
        cut, held = (lambda name: rank_cut(rank_model, name)), held_experts(rank_model)
        return read(path, cfg, raw, cut=cut, held=held, place=load.place)
    return shard_tensors


FAMILY = register(Family(
    name="deepseek", title="DeepSeek", config_class=DeepseekConfig, model_types=DEEPSEEK_TYPES,
    config=lambda raw: (deepseek_config(raw), ""),
    model_class=lambda cfg: DeepseekModel,
    tensors=lambda path, cfg, raw, load: deepseek_tensors(path, cfg, raw, load.quantize_activations,
                                                          place=load.place),
    build=lambda cfg, tensors, load, ctx: build_deepseek(cfg, tensors, load.device, load.dtype, ctx),
    parallel_context=lambda cfg, rank, size, group, experts, attention: llama_parallel_context(
        cfg, rank, size, group, experts, attention, latent=True),
    shard_tensors=rank_reader(deepseek_tensors),
    param_name=deepseek_param_name,
    gguf_archs=("deepseek2",),  # read whole, expanded, on one device (loading.gguf_deepseek)
    gguf_config=gguf_deepseek_config,
    gguf_tensors=lambda reader, arch, cfg, load: gguf_deepseek_tensors(reader, cfg),
    data_attention=True,
    buffers=ROUTER_BIAS,
))
