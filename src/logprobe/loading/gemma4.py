"""Hugging Face directories of Gemma 4 (``models.gemma4``): the text models (``gemma4_text``,
``Gemma4ForCausalLM``) and the text tower of the multimodal ``gemma4`` checkpoints
(``Gemma4ForConditionalGeneration``; its ``text_config``).

Checkpoint keys as transformers 5 writes them: ``model.layers.*`` (text) or
``model.language_model.*`` (multimodal); the vision tower and its embedder (``vision_tower.*``,
``embed_vision.*``) are read where the config has its ``vision_config`` (``models.gemma4_vision``:
text scored given images; under tensor parallelism every rank reads them whole), the audio tower
and its embedder are skipped with one note. KV-shared blocks hold no key/value weights (any the
file has for them are skipped, as transformers does). ``lm_head.weight`` is read only when the
embeddings are untied.

Per-block attention shapes: ``per_layer_config`` (transformers' serialised form: layer index ->
``head_dim`` / ``num_key_value_heads``) or the release's ``global_head_dim`` (default 512) and
``num_global_key_value_heads`` (with ``attention_k_eq_v``) on full-attention blocks. Rotary:
``rope_parameters`` per layer type, ``default`` or ``proportional``. Config options the native model
does not run are refused with their key named.

Tensor parallelism (``gemma4_shard_tensors``): each rank reads the rows its layers hold
(``layers.parallel_linear.held_ranges``); ``gemma4_parallel_context`` refuses a size that does not
split every piece exactly, naming the key.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..layers.parallel_linear import held_ranges
from ..models.gemma4 import LAYER_TYPES, Gemma4Config, Gemma4Model
from ..models.gemma4_vision import Gemma4VisionConfig, gemma4_vision_config
from ..parallel.context import ParallelContext
from ..parallel.shard import check_tp, num_blocks, vocab_chunk_width
from .checkpoint import check_weights_match, tower_skipping_tensors
from .registry import Family, register

log = logging.getLogger(__name__)

TEXT_TYPE = "gemma4_text"
WRAPPER = "gemma4"
GEMMA4_TYPES = (TEXT_TYPE, WRAPPER)
_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
           "model.multi_modal_projector.")
_DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}
_VISION = ("model.vision_tower.", "model.embed_vision.")  # read where the config has its vision_config
_SHARED_SKIP = (".self_attn.k_proj.", ".self_attn.v_proj.", ".self_attn.k_norm.", ".self_attn.v_norm.")


def _text_config(raw: dict) -> tuple[dict, str]:
    if raw.get("model_type") == WRAPPER:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise LogprobeError("config.text_config", f"model_type {WRAPPER!r} needs a text_config object")
        if text.get("model_type", TEXT_TYPE) != TEXT_TYPE:
            raise LogprobeError("config.text_config.model_type", f"{text.get('model_type')!r} inside {WRAPPER!r}, "
                                f"expected {TEXT_TYPE!r}")
        return text, "config.text_config."
    return raw, "config."


def _num(cfg: dict, key: str, where: str, default, kind=int):
    value = cfg.get(key, default)
    if value is None:
        raise LogprobeError(f"{where}{key}", "is missing")
    ok = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise LogprobeError(f"{where}{key}", f"must be a{'n integer' if kind is int else ' number'}, got {value!r}")
    return value


def _refusals(cfg: dict, raw: dict, where: str) -> None:
    for c in (raw, cfg):
        q = c.get("quantization_config")
        if q is not None:
            method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
            raise LogprobeError("quantization_config", f"a quantized ({method}) Gemma 4 checkpoint is not read "
                                "natively yet", "score the unquantized (float) checkpoint")
    for key, why in (("enable_moe_block", "mixture-of-experts blocks are"), ("attention_bias", "attention bias is")):
        if cfg.get(key):
            raise LogprobeError(f"{where}{key}", f"true: {why} not in the native Gemma 4 model",
                                "score it on the transformers backend (a model without this option runs natively)")
    if cfg.get("use_bidirectional_attention") == "all":
        raise LogprobeError(f"{where}use_bidirectional_attention", "'all': the native Gemma 4 model is causal",
                            "score a causal language model")


def _rope(cfg: dict, where: str, types) -> dict:
    params = cfg.get("rope_parameters") or _DEFAULT_ROPE
    if not isinstance(params, dict) or not set(types) <= set(params):
        raise LogprobeError(f"{where}rope_parameters", f"must map {' and '.join(sorted(set(types)))} to their "
                            f"rotary parameters, got {params!r}")
    out = {}
    for t in set(types):
        p, key = params[t], f"{where}rope_parameters.{t}"
        kind = p.get("rope_type", "default") if isinstance(p, dict) else None
        if kind not in ("default", "proportional"):
            raise LogprobeError(f"{key}.rope_type", f"{kind!r} is not in the native Gemma 4 model",
                                "the released models use default and proportional")
        partial = float(p.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
        factor = float(p.get("factor", 1.0)) if kind == "proportional" else 1.0
        out[t] = (float(p.get("rope_theta", 10_000.0)), partial, factor)
    return out


def _layer_shapes(cfg: dict, where: str, types: list[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(head_dim, kv heads) per block, as ``Gemma4TextConfig.__post_init__`` resolves them."""
    dims = [_num(cfg, "head_dim", where, 256)] * len(types)
    kv = [_num(cfg, "num_key_value_heads", where, 4)] * len(types)
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        g_dim = _num(cfg, "global_head_dim", where, 512)
        g_kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v", False) else None
        per_layer = {i: {"head_dim": g_dim, **({"num_key_value_heads": g_kv} if g_kv is not None else {})}
                     for i, t in enumerate(types) if t == "full_attention"}
    if not isinstance(per_layer, dict):
        raise LogprobeError(f"{where}per_layer_config", f"must be an object, got {per_layer!r}")
    for idx, over in per_layer.items():
        key = f"{where}per_layer_config.{idx}"
        if not str(idx).isdigit() or int(idx) >= len(types) or not isinstance(over, dict):
            raise LogprobeError(key, "must be a layer index with an object of overrides")
        unknown = set(over) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise LogprobeError(f"{key}.{sorted(unknown)[0]}", "is not a per-layer option the native Gemma 4 model "
                                "runs", "only head_dim and num_key_value_heads may differ per layer")
        i = int(idx)
        dims[i] = _num(over, "head_dim", key + ".", dims[i])
        kv[i] = _num(over, "num_key_value_heads", key + ".", kv[i])
    return tuple(dims), tuple(kv)


def gemma4_config(raw: dict) -> Gemma4Config:
    """The native config of a Gemma 4 checkpoint; missing keys take ``Gemma4TextConfig``'s defaults."""
    cfg, where = _text_config(raw)
    _refusals(cfg, raw, where)
    layers = _num(cfg, "num_hidden_layers", where, 30)
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or not all(t in LAYER_TYPES for t in types):
        raise LogprobeError(f"{where}layer_types", f"must be a list of {' / '.join(LAYER_TYPES)}, got {types!r}")
    if types and types[-1] != "full_attention":  # transformers forces it (with a warning)
        log.warning("Gemma 4: the last layer is made full_attention, as transformers does")
        types = types[:-1] + ["full_attention"]
    vocab = _num(cfg, "vocab_size", where, 262_144)
    ple = cfg.get("hidden_size_per_layer_input", 256) or 0
    if ple and _num(cfg, "vocab_size_per_layer_input", where, 262_144) != vocab:
        raise LogprobeError(f"{where}vocab_size_per_layer_input", f"{cfg['vocab_size_per_layer_input']} differs "
                            f"from vocab_size {vocab}", "the released models use one vocabulary for both")
    dims, kv = _layer_shapes(cfg, where, types)
    rope = _rope(cfg, where, types)
    cap = cfg.get("final_logit_softcapping")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))):
        raise LogprobeError(f"{where}final_logit_softcapping", f"must be a number or null, got {cap!r}")
    vision, image_ids = _vision(raw, cfg, where)
    try:
        return Gemma4Config(
            vocab_size=vocab, hidden_size=_num(cfg, "hidden_size", where, 2304),
            intermediate_size=_num(cfg, "intermediate_size", where, 9216), num_layers=layers,
            num_heads=_num(cfg, "num_attention_heads", where, 8), layer_types=tuple(types), layer_head_dims=dims,
            layer_kv_heads=kv, sliding_window=_num(cfg, "sliding_window", where, 512), rope=rope,
            attention_k_eq_v=bool(cfg.get("attention_k_eq_v", False)),
            num_kv_shared_layers=_num(cfg, "num_kv_shared_layers", where, 0),
            use_double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)), ple_dim=int(ple),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            hidden_activation=str(cfg.get("hidden_activation", "gelu_pytorch_tanh")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))),
            final_logit_softcapping=float(cap) if cap is not None else None,
            max_position_embeddings=_num(cfg, "max_position_embeddings", where, 131_072),
            family=str(raw.get("model_type")), vision=vision, **image_ids)
    except LogprobeError as e:
        if e.field.startswith("config.") and where != "config.":  # name the key where it is: text_config
            raise LogprobeError(where + e.field.removeprefix("config."), e.problem, e.fix) from e
        raise


def _vision(raw: dict, cfg: dict, where: str) -> tuple[Gemma4VisionConfig | None, dict]:
    """The multimodal wrapper's vision tower, image token ids and how image runs attend; (None, {})
    for text checkpoints."""
    if raw.get("model_type") != WRAPPER or raw.get("vision_config") is None:
        return None, {}
    ids = {name: _num(raw, name, "config.", default) for name, default in
           (("image_token_id", 258_880), ("boi_token_id", 255_999), ("eoi_token_id", 258_882))}
    ids["pad_token_id"] = _num(cfg, "pad_token_id", where, 0)
    ids["vision_bidirectional"] = cfg.get("use_bidirectional_attention") == "vision"
    return gemma4_vision_config(raw["vision_config"], _num(cfg, "hidden_size", where, 2304)), ids


def gemma4_param_name(key: str, cfg: Gemma4Config, where: str) -> str | None:
    """A checkpoint key -> the native parameter name (None: a tensor the forward does not use)."""
    if key.endswith("rotary_emb.inv_freq") or key.endswith("embed_scale"):
        return None
    if key.startswith(_VISION) and cfg.vision is not None:
        return key.removeprefix("model.")
    if key.startswith(_TOWERS):
        return None
    if key == "lm_head.weight":
        return None if cfg.tie_word_embeddings else key
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix):
            name = key[len(prefix):]
            parts = name.split(".")
            if (parts[0] == "layers" and len(parts) > 2 and int(parts[1]) >= cfg.first_shared
                    and any(s in name for s in _SHARED_SKIP)):
                return None  # a KV-shared block's own key/value weights: unused, as in transformers
            return name
    raise LogprobeError("model", f"unexpected tensor {key!r} in {where}")


def gemma4_tensors(path: Path, cfg: Gemma4Config):
    """Yield (native parameter name, tensor) from the safetensors files."""
    what = "vision / audio towers" if cfg.vision is None else "audio tower"
    return tower_skipping_tensors(path, lambda key, file: gemma4_param_name(key, cfg, file), _TOWERS, what, log)


def gemma4_parallel_context(cfg: Gemma4Config, rank: int = 0, size: int = 1, group=None) -> ParallelContext:
    """A rank's context (``loader.parallel_context``), after checking every piece splits ``size`` ways:
    the query heads, each block's kv heads (divided, or replicated by a multiple), the vocabulary
    chunks, hidden_size, intermediate_size and hidden_size_per_layer_input; and that a KV-shared
    block's producer has its kv heads and head_dim (a rank reads the producer's heads as its own)."""
    chunks = -(-cfg.vocab_size // vocab_chunk_width(cfg.vocab_size))
    for i, kv in enumerate(cfg.layer_kv_heads):
        try:
            check_tp(cfg.num_heads, kv, chunks, size)
        except LogprobeError as e:
            raise LogprobeError(e.field, f"{e.problem} (layer {i}: num_key_value_heads {kv})", e.fix) from e
    for key, n in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size),
                   ("hidden_size_per_layer_input", cfg.ple_dim)):
        if n % size:
            raise LogprobeError("tensor_parallel_size", f"{size} does not divide {key} {n} of {cfg.family}",
                                f"use a size that divides {key}")
    shape = lambda i: (cfg.layer_kv_heads[i], cfg.layer_head_dims[i])  # noqa: E731
    for i, j in cfg.producers.items():
        if size > 1 and shape(i) != shape(j):
            raise LogprobeError("tensor_parallel_size", f"{size}: KV-shared layer {i} has num_key_value_heads / "
                                f"head_dim {cfg.layer_kv_heads[i]} / {cfg.layer_head_dims[i]}, its producer layer {j} "
                                f"{cfg.layer_kv_heads[j]} / {cfg.layer_head_dims[j]}", "use tensor_parallel_size 1")
    return ParallelContext(rank, size, group, num_blocks(*cfg.split_widths))


def gemma4_shard_tensors(path: Path, cfg: Gemma4Config, ctx: ParallelContext):
    """``gemma4_tensors``, each cut to the rows this rank's layers hold (whole where they hold all of it)."""
    with torch.device("meta"):
        model = Gemma4Model(cfg, ctx)
    for name, w in gemma4_tensors(path, cfg):
        ranges = held_ranges(model, name)  # None for the vision tower and embedder: read whole (replicated)
        yield name, w if ranges is None else torch.cat([w[a:b] for a, b in ranges])


def build_gemma4(cfg: Gemma4Config, tensors, device: torch.device, dtype: torch.dtype,
                 ctx: ParallelContext | None = None) -> Gemma4Model:
    """The native model from (name, tensor) pairs, q/k rows (and their norms) permuted to the
    interleaved rotary layout (o_proj columns too where values are the raw keys). ``ctx``: this
    rank's tensor-parallel group; ``tensors`` then yields its rows (``gemma4_shard_tensors``)."""
    state = {name: w.to(device=device, dtype=dtype) for name, w in tensors}
    with torch.device("meta"):
        model = Gemma4Model(cfg, ctx)
    check_weights_match(model, state)
    model.load_state_dict(Gemma4Model.interleave_rope_weights(cfg, state), assign=True, strict=True)
    model.make_rotary(device)
    model.fuse_projections()
    return model.eval()


FAMILY = register(Family(
    name="gemma4", title="Gemma 4", config_class=Gemma4Config, model_types=GEMMA4_TYPES,
    config=lambda raw: (gemma4_config(raw), ""),
    model_class=lambda cfg: Gemma4Model,
    tensors=lambda path, cfg, raw, load: gemma4_tensors(path, cfg),
    build=lambda cfg, tensors, load, ctx: build_gemma4(cfg, tensors, load.device, load.dtype, ctx),
    parallel_context=lambda cfg, rank, size, group, experts, attention: gemma4_parallel_context(cfg, rank, size,
                                                                                                 group),
    shard_tensors=lambda path, cfg, ctx, load: gemma4_shard_tensors(path, cfg, ctx),
    param_name=gemma4_param_name,
    experts=False,
    towers=("vision_tower.", "embed_vision."),  # the vision tower and embedder: updated where sent
    # transformers' buffers: a per-layer scalar; the vision tower's clip bounds and standardization
    buffers=(".layer_scalar", ".input_min", ".input_max", ".output_min", ".output_max", ".std_bias", ".std_scale"),
))
