"""Hugging Face directories of GLM-4 dense (``glm4``, ``Glm4ForCausalLM``; ``models.glm4``).

Checkpoint keys as transformers writes them (``model.layers.*``, ``lm_head.weight``); each block's
fused ``mlp.gate_up_proj.weight`` [2 I, H] is split into ``gate_proj`` (the first I rows) and
``up_proj`` (weight updates cut it the same way: ``glm4_fused_parts``). Rotary: ``rope_parameters`` (transformers 5: ``rope_theta``, ``partial_rotary_factor``)
or the older top-level ``rope_theta`` / ``partial_rotary_factor``; transformers' default factor is
0.5. Config options the native model does not run are refused with their key named.

Tensor parallelism (``glm4_shard_tensors``): each rank reads the rows its layers hold
(``layers.parallel_linear.held_ranges``), ``gate_up_proj`` split into gate and up first.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..layers.parallel_linear import held_ranges
from ..models.glm4 import Glm4Config, Glm4Model
from ..parallel.context import ParallelContext
from ..parallel.shard import check_tp, num_blocks, vocab_chunk_width
from .checkpoint import check_weights_match, named_plain_tensors
from .registry import Family, register

log = logging.getLogger(__name__)

GLM4_TYPE = "glm4"
_ROPE_KINDS = ("default", "linear")


def _int(cfg: dict, key: str, default=None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise LogprobeError(f"config.{key}", "is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise LogprobeError(f"config.{key}", f"must be an integer, got {value!r}")
    return value


def _rope(cfg: dict) -> tuple[float, dict]:
    """(theta, scaling dict with the partial rotary factor) from rope_parameters or the top level."""
    params = cfg.get("rope_parameters")
    key = "config.rope_parameters"
    if params is None:
        params, key = dict(cfg.get("rope_scaling") or {}), "config.rope_scaling"
    if not isinstance(params, dict):
        raise LogprobeError(key, f"must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in _ROPE_KINDS:
        raise LogprobeError(f"{key}.rope_type", f"{kind!r} is not in the native glm4 model",
                            f"the released models use the default rotary ({', '.join(_ROPE_KINDS)} run natively)")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10_000.0)))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise LogprobeError(f"{key}.partial_rotary_factor", f"must be a number, got {factor!r}")
    scaling = {"rope_type": kind, "partial_rotary_factor": float(factor)}
    if kind == "linear":
        if "factor" not in params:
            raise LogprobeError(f"{key}.factor", "is missing (linear rope scaling)")
        scaling["factor"] = float(params["factor"])
    return theta, scaling


def glm4_config(raw: dict) -> Glm4Config:
    """The native config of a glm4 checkpoint; missing keys take transformers' ``Glm4Config`` defaults."""
    if raw.get("quantization_config") is not None:
        q = raw["quantization_config"]
        method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
        raise LogprobeError("quantization_config", f"a quantized ({method}) glm4 checkpoint is not read natively "
                            "yet", "score the unquantized (float) checkpoint")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise LogprobeError("config.hidden_act", f"{act!r} is not in the native glm4 model", "the released "
                            "models use silu")
    for key in ("sliding_window", "use_sliding_window"):
        if raw.get(key):
            raise LogprobeError(f"config.{key}", f"{raw[key]!r}: glm4 has no sliding window", "set it to null")
    theta, scaling = _rope(raw)
    hidden, heads = _int(raw, "hidden_size", 4096), _int(raw, "num_attention_heads", 32)
    head_dim = raw.get("head_dim") or hidden // heads
    return Glm4Config(
        vocab_size=_int(raw, "vocab_size", 151_552),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", 13_696),
        num_layers=_int(raw, "num_hidden_layers", 40),
        num_heads=heads,
        num_kv_heads=_int(raw, "num_key_value_heads", 2),
        head_dim=_int({"head_dim": head_dim}, "head_dim"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1.5625e-07)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(raw.get("attention_bias", True)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=_int(raw, "max_position_embeddings", 131_072),
    )


def glm4_param_name(key: str, cfg: Glm4Config, where: str) -> str | None:
    """A checkpoint key -> the native name (``gate_up_proj`` keeps its name: ``glm4_tensors`` splits it)."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    if key == "lm_head.weight":
        return None if cfg.tie_word_embeddings else key
    if key.startswith("model."):
        return key.removeprefix("model.")
    raise LogprobeError("model", f"unexpected tensor {key!r} in {where}")


def glm4_fused_parts(name: str, cfg: Glm4Config) -> list[tuple[str, int, int]] | None:
    """A native name of the fused ``layers.N.mlp.gate_up_proj.weight`` [2 I, H] -> its parts as
    (native name, first row, end row), gate first as ``Glm4MLP`` chunks it; None for any other
    name. Weight updates (``loading.update.units``) cut incoming tensors with it, as loading does.

    >>> from logprobe.models.glm4 import Glm4Config
    >>> cfg = Glm4Config(vocab_size=8, hidden_size=4, intermediate_size=6, num_layers=1, num_heads=1,
    ...                  num_kv_heads=1, head_dim=4)
    >>> glm4_fused_parts("layers.0.mlp.gate_up_proj.weight", cfg)
    [('layers.0.mlp.gate_proj.weight', 0, 6), ('layers.0.mlp.up_proj.weight', 6, 12)]
    """
    if not name.endswith(".mlp.gate_up_proj.weight"):
        return None
    inter = cfg.intermediate_size
    return [(name.replace("gate_up_proj", "gate_proj"), 0, inter), (name.replace("gate_up_proj", "up_proj"), inter,
                                                                      2 * inter)]


def glm4_tensors(path: Path, cfg: Glm4Config):
    """Yield (native parameter name, tensor) from the safetensors files, gate_up_proj split in two."""
    for name, w in named_plain_tensors(path, lambda key, where: glm4_param_name(key, cfg, where), log):
        if name.endswith(".mlp.gate_up_proj.weight"):
            if w.shape[0] != 2 * cfg.intermediate_size:
                raise LogprobeError("model", f"{name} has {w.shape[0]} rows, 2 * intermediate_size is "
                                    f"{2 * cfg.intermediate_size}")
            stem = name.removesuffix("gate_up_proj.weight")
            gate, up = w.chunk(2, dim=0)  # [I, H] each: gate first, as Glm4MLP's chunk
            yield stem + "gate_proj.weight", gate
            yield stem + "up_proj.weight", up
        else:
            yield name, w


def glm4_parallel_context(cfg: Glm4Config, rank: int = 0, size: int = 1, group=None) -> ParallelContext:
    """A rank's context (``loader.parallel_context``), after checking the model splits ``size`` ways
    as the Llama family: query heads, kv heads, vocabulary chunks, hidden and intermediate sizes."""
    check_tp(cfg.num_heads, cfg.num_kv_heads, -(-cfg.vocab_size // vocab_chunk_width(cfg.vocab_size)), size)
    for key, n in (("intermediate_size", cfg.intermediate_size), ("hidden_size", cfg.hidden_size)):
        if n % size:
            raise LogprobeError("tensor_parallel_size", f"{size} does not divide {key} {n} of {cfg.family}",
                                f"use a size that divides {key}")
    return ParallelContext(rank, size, group, num_blocks(*cfg.split_widths))


def glm4_shard_tensors(path: Path, cfg: Glm4Config, ctx: ParallelContext):
    """``glm4_tensors``, each cut to the rows this rank's layers hold (whole where they hold all of it)."""
    with torch.device("meta"):
        model = Glm4Model(cfg, ctx=ctx)
    for name, w in glm4_tensors(path, cfg):
        ranges = held_ranges(model, name)
        yield name, w if ranges is None else torch.cat([w[a:b] for a, b in ranges])


def build_glm4(cfg: Glm4Config, tensors, device: torch.device, dtype: torch.dtype,
               ctx: ParallelContext | None = None) -> Glm4Model:
    """The native model from (name, tensor) pairs: every parameter present with the shape the config
    implies. ``ctx``: this rank's tensor-parallel group; ``tensors`` then yields its rows
    (``glm4_shard_tensors``)."""
    state = {name: w.to(device=device, dtype=dtype) for name, w in tensors}
    with torch.device("meta"):
        model = Glm4Model(cfg, ctx=ctx)
    check_weights_match(model, state)
    model.load_state_dict(state, assign=True, strict=True)
    # non-persistent buffers were created on the meta device: make the rotary table for real
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    model.fuse_projections()
    return model.eval()


FAMILY = register(Family(
    name="glm4", title="GLM-4", config_class=Glm4Config, model_types=(GLM4_TYPE,),
    config=lambda raw: (glm4_config(raw), ""),
    model_class=lambda cfg: Glm4Model,
    tensors=lambda path, cfg, raw, load: glm4_tensors(path, cfg),
    build=lambda cfg, tensors, load, ctx: build_glm4(cfg, tensors, load.device, load.dtype, ctx),
    parallel_context=lambda cfg, rank, size, group, experts, attention: glm4_parallel_context(cfg, rank, size, group),
    shard_tensors=lambda path, cfg, ctx, load: glm4_shard_tensors(path, cfg, ctx),
    param_name=glm4_param_name,
    experts=False,
    fused=glm4_fused_parts,
))
