"""Hugging Face directories of Gemma 3 (``models.gemma``): the text models (``gemma3_text``,
``Gemma3ForCausalLM``: Gemma 3 1B, 270M) and the text tower of the multimodal ``gemma3`` checkpoints
(``Gemma3ForConditionalGeneration``: 4B, 12B, 27B; its ``text_config``).

Checkpoint keys as transformers 5 writes them (``model.layers.*``, or ``model.language_model.*``
for the multimodal class) and as the hub's multimodal checkpoints ship them
(``language_model.model.*``, ``language_model.lm_head.weight``); the vision tower and the
multimodal projector (``vision_tower.*``, ``multi_modal_projector.*``) are read where the config
has its ``vision_config`` (``models.gemma3_vision``: text scored given images; under tensor
parallelism every rank reads them whole: replicated, not split), but for SigLIP's pooling
head, which Gemma 3 never reads; any other key is refused. ``lm_head.weight`` is read only when the
embeddings are untied (Gemma 3 ties them).

Rotary bases: ``rope_parameters`` per layer type (transformers 5: ``full_attention`` and
``sliding_attention``, each default or linear), or the hub's ``rope_theta`` (full blocks, with
``rope_scaling``) and ``rope_local_base_freq`` (sliding blocks). ``final_logit_softcapping`` goes to
the log-prob head. Config options the native model does not run are refused with their key named.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..layers.parallel_linear import held_ranges
from ..models.gemma import LAYER_TYPES, GemmaConfig, GemmaModel
from ..models.gemma3_vision import SiglipConfig, siglip_config
from ..parallel.context import ParallelContext
from ..parallel.shard import check_tp, num_blocks, vocab_chunk_width
from .checkpoint import check_weights_match, tower_skipping_tensors
from .gguf_gemma import gguf_gemma_config, gguf_gemma_tensors
from .registry import Family, register

log = logging.getLogger(__name__)

TEXT_TYPE = "gemma3_text"
WRAPPER = "gemma3"  # multimodal: text_config inside
GEMMA_TYPES = (TEXT_TYPE, WRAPPER)
_SKIPPED = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")
_POOLING_HEAD = "vision_tower.head."  # SigLIP's pooling head: Gemma 3 reads the last hidden state
_TOWERS = ("vision_tower.", "multi_modal_projector.")  # the native names of the tower and projector


def _text_config(raw: dict) -> tuple[dict, str]:
    """(text config, the prefix its keys are named with in errors)."""
    if raw.get("model_type") == WRAPPER:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise LogprobeError("config.text_config", f"model_type {WRAPPER!r} needs a text_config object")
        ttype = text.get("model_type", TEXT_TYPE)
        if ttype != TEXT_TYPE:
            raise LogprobeError("config.text_config.model_type", f"{ttype!r} inside {WRAPPER!r}, expected "
                                f"{TEXT_TYPE!r}")
        return text, "config.text_config."
    return raw, "config."


def _int(cfg: dict, key: str, where: str, default=None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise LogprobeError(f"{where}{key}", "is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise LogprobeError(f"{where}{key}", f"must be an integer, got {value!r}")
    return value


def _rope_one(params, key: str, default_theta: float) -> tuple[float, dict | None]:
    """(theta, scaling or None) of one layer type's rotary parameters."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise LogprobeError(key, f"must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear"):
        raise LogprobeError(f"{key}.rope_type", f"{kind!r} is not in the native Gemma 3 model",
                            "the released models use the default rotary (linear scaling on full-attention blocks)")
    theta = float(params.get("rope_theta", default_theta))
    if kind == "default":
        return theta, None
    if "factor" not in params:
        raise LogprobeError(f"{key}.factor", "is missing (linear rope scaling)")
    return theta, {"rope_type": "linear", "factor": float(params["factor"])}


def _rope(cfg: dict, where: str) -> tuple[float, dict | None, float, dict | None]:
    """(full theta, full scaling, sliding theta, sliding scaling), transformers' defaults 1e6 / 1e4."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not set(params) <= set(LAYER_TYPES):
            raise LogprobeError(f"{where}rope_parameters", "must map full_attention and sliding_attention to their "
                                f"rotary parameters, got {params!r}")
        full = _rope_one(params.get("full_attention"), f"{where}rope_parameters.full_attention",
                         float(cfg.get("rope_theta", 1_000_000.0)))
        local = _rope_one(params.get("sliding_attention"), f"{where}rope_parameters.sliding_attention",
                          float(cfg.get("rope_local_base_freq", 10_000.0)))
        return (*full, *local)
    scaling = dict(cfg.get("rope_scaling") or {})
    scaling["rope_theta"] = cfg.get("rope_theta", 1_000_000.0)
    full = _rope_one(scaling, f"{where}rope_scaling", 1_000_000.0)
    return (*full, float(cfg.get("rope_local_base_freq", 10_000.0)), None)


def gemma_config(raw: dict) -> GemmaConfig:
    """The native config of a Gemma 3 checkpoint; refuses (naming the key) what it does not run.
    Missing keys take transformers' ``Gemma3TextConfig`` defaults."""
    cfg, where = _text_config(raw)
    mtype = str(raw.get("model_type"))
    for key, c in (("quantization_config", raw), ("quantization_config", cfg)):
        if c.get(key) is not None:
            method = (c[key] or {}).get("quant_method", "?") if isinstance(c[key], dict) else "?"
            raise LogprobeError(key, f"a quantized ({method}) {mtype} checkpoint is not read natively yet",
                                "score the unquantized (float) checkpoint")
    if cfg.get("attn_logit_softcapping") is not None:
        raise LogprobeError(f"{where}attn_logit_softcapping", f"{cfg['attn_logit_softcapping']!r}: attention logit "
                            "soft-capping is not in the native Gemma 3 model",
                            "the released Gemma 3 models set it to null")
    cap = cfg.get("final_logit_softcapping")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))):
        raise LogprobeError(f"{where}final_logit_softcapping", f"must be a number or null, got {cap!r}")
    if cfg.get("use_bidirectional_attention"):
        raise LogprobeError(f"{where}use_bidirectional_attention", "true: the native Gemma 3 model is causal",
                            "score a causal language model")
    if cfg.get("attention_bias"):
        raise LogprobeError(f"{where}attention_bias", "true: bias on the attention projections is not in the "
                            "native Gemma 3 model", "the released models have none")
    layers = _int(cfg, "num_hidden_layers", where, 26)
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # transformers' default: every sliding_window_pattern-th block is full
        key = "sliding_window_pattern" if "sliding_window_pattern" in cfg else "_sliding_window_pattern"
        every = _int(cfg, key, where, 6)
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if not isinstance(layer_types, list):
        raise LogprobeError(f"{where}layer_types", f"must be a list, got {layer_types!r}")
    window = cfg.get("sliding_window", 4096)
    if window is None and "sliding_attention" in layer_types:
        raise LogprobeError(f"{where}sliding_window", "is null, but layer_types has sliding_attention blocks")
    theta, scaling, local_theta, local_scaling = _rope(cfg, where)
    hidden, heads = _int(cfg, "hidden_size", where, 2304), _int(cfg, "num_attention_heads", where, 8)
    tie = raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)):
        raise LogprobeError(f"{where}query_pre_attn_scalar", f"must be a number, got {scalar!r}")
    vision, image_ids = _vision(raw, hidden)
    try:
        return GemmaConfig(
            vocab_size=_int(cfg, "vocab_size", where, 262_208),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size", where, 9216),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_int(cfg, "num_key_value_heads", where, 4),
            head_dim=_int(cfg, "head_dim", where, 256),
            layer_types=tuple(layer_types),
            sliding_window=_int(cfg, "sliding_window", where, 4096) if window is not None else 1 << 62,
            query_pre_attn_scalar=float(scalar),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            rope_local_scaling=local_scaling,
            hidden_activation=str(cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=_int(cfg, "max_position_embeddings", where, 131_072),
            final_logit_softcapping=float(cap) if cap is not None else None,
            family=mtype,
            vision=vision,
            **image_ids,
        )
    except LogprobeError as e:
        if e.field.startswith("config.") and where != "config.":  # name the key where it is: text_config
            raise LogprobeError(where + e.field.removeprefix("config."), e.problem, e.fix) from e
        raise


def _vision(raw: dict, hidden: int) -> tuple[SiglipConfig | None, dict]:
    """The multimodal wrapper's vision tower and image token ids (an image token outside the
    vocabulary refuses images, not the text: ``scoring.work``); (None, {}) for text checkpoints."""
    if raw.get("model_type") != WRAPPER or raw.get("vision_config") is None:
        return None, {}
    ids = {}
    for name, keys, default in (("image_token_id", ("image_token_index", "image_token_id"), 262_144),
                                ("boi_token_id", ("boi_token_index", "boi_token_id"), 255_999),
                                ("eoi_token_id", ("eoi_token_index", "eoi_token_id"), 256_000)):
        key = next((k for k in keys if raw.get(k) is not None), keys[0])
        ids[name] = _int(raw, key, "config.", default)
    return siglip_config(raw["vision_config"], _int(raw, "mm_tokens_per_image", "config.", 256), hidden), ids


def gemma_param_name(key: str, cfg: GemmaConfig, where: str) -> str | None:
    """A checkpoint key -> the native parameter name (None: a tensor the forward does not use)."""
    if key.endswith("rotary_emb.inv_freq") or key.endswith("embed_scale"):
        return None
    if key in _LM_HEADS:
        return None if cfg.tie_word_embeddings else "lm_head.weight"
    if key.startswith(_SKIPPED):
        # transformers 5's names (vision_tower.embeddings...) or the hub's (vision_tower.vision_model.embeddings...)
        name = key.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.", 1)
        return name if cfg.vision is not None and not name.startswith(_POOLING_HEAD) else None
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    raise LogprobeError("model", f"unexpected tensor {key!r} in {where}")


def gemma_tensors(path: Path, cfg: GemmaConfig):
    """Yield (native parameter name, tensor) from the safetensors files."""
    what = "vision tower, multimodal projector" if cfg.vision is None else "the vision tower's pooling head"
    return tower_skipping_tensors(path, lambda key, file: gemma_param_name(key, cfg, file), _SKIPPED, what, log)


def gemma_parallel_context(cfg: GemmaConfig, rank: int = 0, size: int = 1, group=None) -> ParallelContext:
    """A rank's context (``loader.parallel_context``), after checking the model splits ``size`` ways
    (as the Llama family: heads, kv heads, vocabulary chunks, hidden and intermediate sizes)."""
    check_tp(cfg.num_heads, cfg.num_kv_heads, -(-cfg.vocab_size // vocab_chunk_width(cfg.vocab_size)), size)
    for key, n in (("intermediate_size", cfg.intermediate_size), ("hidden_size", cfg.hidden_size)):
        if n % size:
            raise LogprobeError("tensor_parallel_size", f"{size} does not divide {key} {n} of {cfg.family}",
                                f"use a size that divides {key}")
    return ParallelContext(rank, size, group, num_blocks(*cfg.split_widths))


def gemma_shard_tensors(path: Path, cfg: GemmaConfig, ctx: ParallelContext):
    """``gemma_tensors``, each cut to the rows this rank's layers hold (``held_ranges`` of the rank's
    model on the meta device; whole where they hold all of it: the vision tower and projector)."""
    with torch.device("meta"):
        model = GemmaModel(cfg, ctx)
    for name, w in gemma_tensors(path, cfg):
        ranges = held_ranges(model, name)  # None for the vision tower and projector: read whole
        if ranges is not None:
            w = torch.cat([w[a:b] for a, b in ranges])
        yield name, w


def build_gemma(cfg: GemmaConfig, tensors, device: torch.device, dtype: torch.dtype,
                ctx: ParallelContext | None = None) -> GemmaModel:
    """The native model from (name, tensor) pairs: every parameter present with the shape the config
    implies, q/k rows (and q/k norm weights) permuted to the interleaved rotary layout. ``ctx``: this
    rank's tensor-parallel group; ``tensors`` then yields this rank's rows (``gemma_shard_tensors``)."""
    state = {name: w.to(device=device, dtype=dtype) for name, w in tensors}
    with torch.device("meta"):
        model = GemmaModel(cfg, ctx)
    check_weights_match(model, state)
    model.load_state_dict(GemmaModel.interleave_rope_weights(cfg, state), assign=True, strict=True)
    model.make_rotary(device)  # non-persistent buffers were created on the meta device
    model.fuse_projections()
    return model.eval()


FAMILY = register(Family(
    name="gemma", title="Gemma 3", config_class=GemmaConfig, model_types=GEMMA_TYPES,
    config=lambda raw: (gemma_config(raw), ""),
    model_class=lambda cfg: GemmaModel,
    tensors=lambda path, cfg, raw, load: gemma_tensors(path, cfg),
    build=lambda cfg, tensors, load, ctx: build_gemma(cfg, tensors, load.device, load.dtype, ctx),
    parallel_context=lambda cfg, rank, size, group, experts, attention: gemma_parallel_context(cfg, rank, size, group),
    shard_tensors=lambda path, cfg, ctx, load: gemma_shard_tensors(path, cfg, ctx),
    param_name=gemma_param_name,
    gguf_archs=("gemma3",),  # read whole, expanded, on one device (loading.gguf_gemma)
    gguf_config=gguf_gemma_config,
    gguf_tensors=lambda reader, arch, cfg, load: gguf_gemma_tensors(reader, cfg),
    experts=False,
    towers=_TOWERS,  # the vision tower and projector: updated where sent (``loading.update``)
))
