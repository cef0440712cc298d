"""Hugging Face directories of the hybrid linear-attention Qwen families (``models.qwen3_next``):
Qwen3-Next (``qwen3_next``), Qwen3.5 (``qwen3_5_text``; the multimodal ``qwen3_5`` with its
``text_config``) and Qwen3.5 MoE (``qwen3_5_moe_text`` in ``qwen3_5_moe``).

Checkpoint keys as the hub ships them: ``model.layers.*`` (causal LM classes) or
``model.language_model.layers.*`` (``*ForConditionalGeneration``), ``lm_head.weight``; the vision
tower (``model.visual.*``) becomes ``models.qwen3_5_vision.VisionTower`` (under tensor parallelism
every rank reads it whole: the tower is replicated, not split); the multi-token-prediction head (``mtp.*``) is
not used for scoring and is skipped with one note; any other key is refused. Config options the native model
does not run are refused with their key named.

FP8 block checkpoints (``quantization_config.quant_method: "fp8"``, as Qwen ships
Qwen3-Next-80B-A3B-*-FP8 and the Qwen3.5 FP8 releases; ``loading.fp8_block``) keep every FP8
projection FP8 in memory, float activations: the attention q/k/v/o, the Gated DeltaNet projections,
the dense MLP, the shared expert and the experts (``FP8BlockExperts``). What is FP8 is what the
checkpoint stores (Qwen keeps ``in_proj_ba`` / ``in_proj_b`` / ``in_proj_a``, routers, gates and
lm_head float through ``modules_to_not_convert``; the conv, A_log, dt_bias and norms are float).
Qwen3-Next's fused FP8 ``in_proj_qkvz`` / ``in_proj_ba`` are cut by rows like the float ones: each
row keeps the scales of its block row (``FP8BlockLinear`` holds one row of scales per weight row).
Under tensor parallelism a rank reads its rows of each FP8 weight alone, kept FP8 the same way.
The vision tower's FP8 weights (where a checkpoint quantizes them) are dequantized at load: the
tower runs float weights and activations (``quantize_activations`` is the text model's).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..layers.fp8_block_linear import FP8BlockLinear
from ..layers.gated_delta import split_qwen3_next_projections
from ..layers.moe import MoeSpec
from ..layers.parallel_linear import held_ranges
from ..models.qwen3_5_vision import VisionConfig, vision_config
from ..models.qwen3_next import HybridConfig, HybridModel
from ..parallel.context import ParallelContext
from ..parallel.shard import check_experts, check_tp, num_blocks, vocab_chunk_width
from .checkpoint import check_weights_match, mapped_tensors
from .fp8_block import (
    dense_fp8,
    fp8_block_tensors,
    fp8_scheme,
    install_packed,
    is_fp8_block,
    split_packed,
    with_shapes,
)
from .gguf_archs import HYBRID_ARCHES, gguf_hybrid_config, gguf_hybrid_tensors
from .hf import read_config, stack_experts
from .registry import Family, Incoming, register
from .sharding import attention_layout, held_experts, rank_cut

log = logging.getLogger(__name__)

TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # multimodal: text_config inside
HYBRID_TYPES = TEXT_TYPES + tuple(WRAPPERS)
_SKIPPED = ("model.visual.", "mtp.")  # vision tower, multi-token prediction: not part of the text forward
_SPLIT = re.compile(r"(layers\.\d+\.linear_attn)\.(in_proj_qkvz|in_proj_ba)\.weight")


def _text_config(raw: dict) -> tuple[dict, str, str]:
    """(text config, its model_type, the prefix config keys are named with in errors)."""
    mtype = raw.get("model_type")
    if mtype in WRAPPERS:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise LogprobeError("config.text_config", f"model_type {mtype!r} needs a text_config object")
        ttype = text.get("model_type", WRAPPERS[mtype])
        if ttype != WRAPPERS[mtype]:
            raise LogprobeError("config.text_config.model_type", f"{ttype!r} inside {mtype!r}, expected "
                                f"{WRAPPERS[mtype]!r}")
        return text, ttype, "config.text_config."
    return raw, mtype, "config."


def _int(cfg: dict, key: str, where: str, default=None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise LogprobeError(f"{where}{key}", "is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise LogprobeError(f"{where}{key}", f"must be an integer, got {value!r}")
    return value


def hybrid_config(raw: dict) -> HybridConfig:
    """The native config of a hybrid Qwen checkpoint; refuses (naming the key) what it does not run."""
    cfg, mtype, where = _text_config(raw)
    _check_quantization(raw, cfg, mtype, where)
    if cfg.get("attention_bias"):
        raise LogprobeError(f"{where}attention_bias", f"true: bias on the attention projections is not in the "
                            f"native {mtype} model", "the released models have none")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise LogprobeError(f"{where}hidden_act", f"{cfg.get('hidden_act')!r}: the native {mtype} model runs silu")
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise LogprobeError(f"{where}rope_parameters", f"must be an object, got {params!r}")
    legacy = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default"))) or "default"
    if kind != "default":
        raise LogprobeError(f"{where}rope_parameters.rope_type", f"{kind!r} is not in the native {mtype} model",
                            "the released models use the default rotary")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    layers = _int(cfg, "num_hidden_layers", where)
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # transformers' default: full attention every full_attention_interval blocks
        every = _int(cfg, "full_attention_interval", where, 4)
        layer_types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    hidden, heads = _int(cfg, "hidden_size", where), _int(cfg, "num_attention_heads", where)
    moe, inter = _moe(cfg, mtype, where, layers)
    tie = raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    vision, image_token = _vision(raw, raw.get("model_type"), _int(cfg, "hidden_size", where))
    mrope = _mrope_section(params, mtype, where)
    try:
        return HybridConfig(
            vocab_size=_int(cfg, "vocab_size", where),
            hidden_size=hidden,
            num_layers=layers,
            layer_types=tuple(layer_types),
            num_heads=heads,
            num_kv_heads=_int(cfg, "num_key_value_heads", where, heads),
            head_dim=_int(cfg, "head_dim", where, hidden // heads),
            linear_num_key_heads=_int(cfg, "linear_num_key_heads", where, 16),
            linear_num_value_heads=_int(cfg, "linear_num_value_heads", where, 32),
            linear_key_head_dim=_int(cfg, "linear_key_head_dim", where, 128),
            linear_value_head_dim=_int(cfg, "linear_value_head_dim", where, 128),
            linear_conv_kernel_dim=_int(cfg, "linear_conv_kernel_dim", where, 4),
            intermediate_size=inter,
            partial_rotary_factor=partial,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None,
            tie_word_embeddings=bool(tie),
            max_position_embeddings=_int(cfg, "max_position_embeddings", where, 32768),
            moe=moe,
            family=mtype,
            mrope_section=mrope,
            vision=vision,
            image_token_id=image_token,
        )
    except LogprobeError as e:
        if e.field.startswith("config.") and where != "config.":  # name the key where it is: text_config
            raise LogprobeError(where + e.field.removeprefix("config."), e.problem, e.fix) from e
        raise


def _mrope_section(params: dict, mtype: str, where: str) -> tuple[int, int, int] | None:
    """Qwen3.5's interleaved multimodal rotary sections (transformers' default [11, 11, 10]); None
    for Qwen3-Next (text positions only)."""
    if mtype == "qwen3_next":
        return None
    if params.get("mrope_interleaved", True) is not True:
        raise LogprobeError(f"{where}rope_parameters.mrope_interleaved", f"{params['mrope_interleaved']!r}: the "
                            "native model runs the interleaved sections (as transformers' Qwen3.5 does)")
    section = params.get("mrope_section", [11, 11, 10])
    if not isinstance(section, list) or len(section) != 3 or not all(isinstance(x, int) and x >= 0 for x in section):
        raise LogprobeError(f"{where}rope_parameters.mrope_section", f"must be three integers, got {section!r}")
    return tuple(section)


def _vision(raw: dict, mtype: str, hidden: int) -> tuple[VisionConfig | None, int | None]:
    """The multimodal wrappers' vision tower and image token id (one outside the vocabulary refuses
    images, not the text: ``scoring.images``); (None, None) for text checkpoints."""
    if mtype not in WRAPPERS or raw.get("vision_config") is None:
        return None, None
    token = _int(raw, "image_token_id", "config.", 248056)
    vision = vision_config(raw["vision_config"])
    if vision.out_hidden_size != hidden:
        raise LogprobeError("config.vision_config.out_hidden_size", f"{vision.out_hidden_size}: the tower's "
                            f"tokens must have the text model's hidden_size {hidden}")
    return vision, token


def _check_quantization(raw: dict, cfg: dict, mtype: str, where: str) -> None:
    """FP8 block checkpoints (top-level ``quantization_config``, where transformers writes it) pass
    once ``fp8_block.fp8_scheme`` accepts their config; any other quantization is refused."""
    q = raw.get("quantization_config")
    if where != "config." and cfg.get("quantization_config") not in (None, q):
        raise LogprobeError(f"{where}quantization_config", "differs from the top-level quantization_config",
                            "give the checkpoint's quantization_config once, at the top level")
    if q is None:
        return
    if not is_fp8_block(raw):
        method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
        raise LogprobeError("quantization_config", f"a quantized ({method}) {mtype} checkpoint is not read natively "
                            "(FP8 block checkpoints, quant_method 'fp8', are)", "score a float (bf16) checkpoint")
    fp8_scheme(q)  # refuses (naming the key) a scheme not run exactly


def _moe(cfg: dict, mtype: str, where: str, layers: int) -> tuple[MoeSpec | None, int]:
    """(the MoE part or None, the dense MLP width: 0 where no block is dense)."""
    if mtype == "qwen3_5_text":
        return None, _int(cfg, "intermediate_size", where)
    experts = _int(cfg, "num_experts", where, 0)
    if mtype == "qwen3_next" and experts == 0:
        return None, _int(cfg, "intermediate_size", where)
    dense: tuple[int, ...] = ()
    if mtype == "qwen3_next":  # transformers' Qwen3NextDecoderLayer: which blocks are sparse
        step, only = _int(cfg, "decoder_sparse_step", where, 1) or 1, set(cfg.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    spec = MoeSpec(num_experts=experts, top_k=_int(cfg, "num_experts_per_tok", where),
                   intermediate_size=_int(cfg, "moe_intermediate_size", where),
                   norm_topk_prob=True if mtype == "qwen3_5_moe_text" else bool(cfg.get("norm_topk_prob", True)),
                   shared_intermediate_size=_int(cfg, "shared_expert_intermediate_size", where, 0),
                   dense_layers=dense)
    inter = _int(cfg, "intermediate_size", where) if dense else int(cfg.get("intermediate_size") or 0)
    return spec, inter


def hybrid_param_name(key: str, cfg: HybridConfig, where: str) -> str | None:
    """A checkpoint key -> the native parameter name (None: a tensor the text forward does not use)."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    if key == "lm_head.weight":
        return None if cfg.tie_word_embeddings else "lm_head.weight"
    if key.startswith("model.visual.") and cfg.vision is not None:
        return key.removeprefix("model.")  # the tower: visual.*
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix) and not key.startswith(_SKIPPED):
            name = key[len(prefix):]
            return name.replace(".linear_attn.conv1d.weight", ".linear_attn.conv_weight")
    if key.startswith(_SKIPPED):
        return None
    raise LogprobeError("model", f"unexpected tensor {key!r} in {where}")


def hybrid_tensors(path: Path, cfg: HybridConfig, raw: dict | None = None, quantize_activations: bool = False,
                   dense: bool = False, place=None):
    """Yield (native parameter name, tensor or packed layer) from the safetensors files of a hybrid
    checkpoint: conv weights [C, 1, K] -> [C, K], Qwen3-Next's fused projections cut into Qwen3.5's
    layout, experts stacked [E, out, in]. An FP8 block checkpoint (``raw``'s quantization_config)
    yields ``FP8BlockLinear`` layers and ``FP8BlockExperts`` (``ActQuantLinear`` with
    ``quantize_activations``); ``dense``: their dequantized float32 weights instead. ``place``: the
    model's (device, dtype), where float experts are stacked as read (``hf.stack_experts``)."""
    if raw is not None and is_fp8_block(raw):
        tensors = _fp8(path, cfg, fp8_scheme(raw["quantization_config"], quantize_activations))
        if dense:
            tensors = ((name, dense_fp8(w)) for name, w in tensors)
    else:
        tensors = _plain(path, cfg)
    yield from stack_experts(_split_fused(tensors, cfg), cfg, place=place)


def _fp8(path: Path, cfg: HybridConfig, scheme, cut=None):
    """(name, tensor or FP8 layer) of every used key of an FP8 block checkpoint (``_plain``'s names;
    ``cut``: a rank's reading, as ``_plain``'s)."""
    skipped: list[str] = []

    def name(key: str, file: str) -> str | None:
        out = hybrid_param_name(key, cfg, file)
        if out is None and key.startswith(_SKIPPED):
            skipped.append(key)
        return out

    for n, value in fp8_block_tensors(path, scheme, name, log, cut):
        if n.startswith("visual.") and not isinstance(value, torch.Tensor):
            value = value.rows()  # the vision tower: its FP8 weights dequantized, float activations
        yield n, _squeeze_conv(n, value)
    _note_skipped(path, skipped)


def _squeeze_conv(name: str, value):
    if name.endswith(".linear_attn.conv_weight") and value.dim() == 3:
        return value.squeeze(1)  # [C, 1, K] -> [C, K]
    return value


def _note_skipped(path: Path, skipped: list[str]) -> None:
    if skipped:
        kinds = sorted({k.split(".")[0] if k.startswith("mtp.") else "model.visual" for k in skipped})
        log.warning("%s: skipped %d tensors not used to score text (%s)", path.name, len(skipped), ", ".join(kinds))


def _plain(path: Path, cfg: HybridConfig, cut=None):
    """(name, tensor) of every used key; ``cut(name)``: None (read whole), ``SKIP`` (not read: another
    rank's experts) or a function of the safetensors slice (``loading.sharding.rank_cut``: only
    those bytes are read)."""
    skipped: list[str] = []

    def unmapped(key: str) -> None:
        if key.startswith(_SKIPPED):
            skipped.append(key)

    for name, value in mapped_tensors(path, lambda key, file: hybrid_param_name(key, cfg, file), cut, unmapped):
        yield name, _squeeze_conv(name, value)
    _note_skipped(path, skipped)


def _split_fused(tensors, cfg: HybridConfig):
    """Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` of a layer (once both are read) -> ``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors:
        m = _SPLIT.fullmatch(name)
        if m is None:
            yield name, value
            continue
        got = pending.setdefault(m.group(1), {})
        got[m.group(2)] = value
        if len(got) == 2:
            for part, w in _split_rows(got["in_proj_qkvz"], got["in_proj_ba"], cfg).items():
                yield f"{m.group(1)}.{part}.weight", w
            del pending[m.group(1)]
    for prefix, got in pending.items():
        raise LogprobeError("model", f"{prefix}: {sorted(got)[0]} without its partner "
                            f"({'in_proj_ba' if 'in_proj_qkvz' in got else 'in_proj_qkvz'}) in the checkpoint")


def _split_rows(qkvz, ba, cfg: HybridConfig) -> dict:
    """``split_qwen3_next_projections`` on row indices, then those rows taken from each weight:
    a float tensor's rows, or an FP8 layer's codes with their row scales (the same split)."""
    def rows(w) -> int:
        return w.out_features if isinstance(w, FP8BlockLinear) else _rows_of(w).shape[0]

    src = {"in_proj_qkv": qkvz, "in_proj_z": qkvz, "in_proj_b": ba, "in_proj_a": ba}
    index = split_qwen3_next_projections(torch.arange(rows(qkvz))[:, None], torch.arange(rows(ba))[:, None],
                                         cfg.linear_num_key_heads, cfg.linear_key_head_dim,
                                         cfg.linear_num_value_heads, cfg.linear_value_head_dim)  # [n, 1] each
    return {part: _take_rows(src[part], idx[:, 0]) for part, idx in index.items()}


def _rows_of(w):
    if not isinstance(w, torch.Tensor):  # ActQuantLinear: activation rounding on a fused-then-cut layer
        raise LogprobeError("quantize_activations", "Qwen3-Next's fused in_proj_qkvz / in_proj_ba with FP8 "
                            "activations is not run", "score with float activations (the default)")
    return w


def _take_rows(w, idx: torch.Tensor):
    if isinstance(w, FP8BlockLinear):  # row o keeps the scales of its block row
        return FP8BlockLinear(w.qweight[idx].contiguous(), w.scale[idx].contiguous(), w.block_cols)
    return _rows_of(w)[idx].contiguous()


def hybrid_parallel_context(cfg: HybridConfig, rank: int = 0, size: int = 1, group=None,
                            experts: int = 1, attention: str | None = None) -> ParallelContext:
    """A rank's context for a hybrid model (``loader.parallel_context``), after checking it splits
    ``size`` ways: the experts by ``experts`` groups (``shard.check_experts``), and by the
    attention layout (``sharding.attention_layout``): "data" (a mixture of experts with whole
    experts per rank, the default there: mixers and dense layers whole, only the vocabulary split)
    or "tensor": ``size`` dividing the attention heads (or kv heads, or a multiple of them), the
    linear-attention key and value heads, the hidden, intermediate and shared-expert sizes."""
    vocab_chunks = -(-cfg.vocab_size // vocab_chunk_width(cfg.vocab_size))
    if attention_layout(cfg, size, experts, attention) == "data":
        check_tp(size, size, vocab_chunks, size)  # (heads whole: only the vocabulary checked)
        check_experts(cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.hidden_size, size, experts)
        return ParallelContext(rank, size, group, num_blocks(*cfg.split_widths), experts, "data")
    check_tp(cfg.num_heads, cfg.num_kv_heads, vocab_chunks, size)
    for key, n in (("linear_num_value_heads", cfg.linear_num_value_heads),  # a multiple of the key heads
                   ("linear_num_key_heads", cfg.linear_num_key_heads),
                   ("intermediate_size", cfg.intermediate_size), ("hidden_size", cfg.hidden_size)):
        if n % size and not (key == "intermediate_size" and cfg.moe is not None and not cfg.moe.dense_layers):
            raise LogprobeError("tensor_parallel_size", f"{size} does not divide {key} {n} of {cfg.family}",
                                f"use a size that divides {key}")
    if cfg.moe is not None:
        check_experts(cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.hidden_size, size, experts)
        if cfg.moe.shared_intermediate_size % size:
            raise LogprobeError("tensor_parallel_size", f"{size} does not divide shared_expert_intermediate_size "
                                f"{cfg.moe.shared_intermediate_size} of {cfg.family}", "use a size that divides it")
    elif experts != 1:
        raise LogprobeError("expert_parallel_size", f"{experts}: {cfg.family} has no experts", "use 1")
    return ParallelContext(rank, size, group, num_blocks(*cfg.split_widths), experts, "tensor")


def hybrid_shard_tensors(path: Path, cfg: HybridConfig, ctx: ParallelContext, place=None):
    """``hybrid_tensors``, each cut to this rank's rows as its layers state them (``held_ranges`` of
    the rank's model on the meta device; the mixer's q/k/v rows and conv channels are three ranges):
    only those rows are read (``get_slice``), except Qwen3-Next's fused ``in_proj_qkvz`` /
    ``in_proj_ba``, read whole, split into Qwen3.5's layout, then cut (one layer at a time). An FP8
    block checkpoint: this rank's rows of each FP8 weight, kept FP8, each row with its block row's
    scales (``fp8_block.fp8_rows``), the fused ones cut as FP8 layers (``_take_rows``)."""
    raw = read_config(path)
    with torch.device("meta"):
        model = HybridModel(cfg, ctx)

    def cut(name: str):  # the vision tower's layers hold no rows of their own: read whole (replicated)
        return None if _SPLIT.fullmatch(name) else rank_cut(model, name)

    fp8 = is_fp8_block(raw)
    stream = _fp8(path, cfg, fp8_scheme(raw["quantization_config"]), cut) if fp8 else _plain(path, cfg, cut)
    for name, w in stack_experts(_split_fused(stream, cfg), cfg, held_experts(model), place):
        ranges = held_ranges(model, name)
        rows = w.out_features if isinstance(w, FP8BlockLinear) else w.shape[0]
        if ranges is not None and rows != sum(b - a for a, b in ranges):  # read whole: split from a fused one
            w = _take_rows(w, torch.cat([torch.arange(a, b) for a, b in ranges]))
        yield name, w


def build_hybrid(cfg: HybridConfig, tensors, device: torch.device, dtype: torch.dtype,
                 ctx: ParallelContext | None = None) -> HybridModel:
    """The native model from (name, tensor or packed layer) pairs: every parameter present with the
    shape the config implies, q/k rows permuted to the interleaved rotary layout (a packed layer's
    rows alike); packed layers (FP8 blocks) replace the Linear they stand for, packed experts the
    expert tensors. ``ctx``: this rank's tensor-parallel group; ``tensors`` then yields this rank's
    rows (``hybrid_shard_tensors``)."""
    state, packed, experts = split_packed(tensors, device, dtype)
    with torch.device("meta"):
        model = HybridModel(cfg, ctx)
    check_weights_match(model, with_shapes(state, packed, experts))
    interleave = lambda s: HybridModel.interleave_rope_weights(cfg, s)  # noqa: E731
    install_packed(model, state, packed, experts, interleave)
    model.load_state_dict(interleave(state), assign=True, strict=not (packed or experts))
    # non-persistent buffers were created on the meta device: make the rotary table for real
    model.rotary = model.make_rotary().to(device)
    model.fuse_projections()
    return model.eval()


def hybrid_units(name: str | None, item: Incoming, model, field: str) -> list[tuple[str, Incoming]] | None:
    """A weight update's tensors the loader reshapes (``loading.update.units``): ``conv1d.weight``
    [C, 1, K] -> ``conv_weight`` [C, K]; Qwen3-Next's ``in_proj_qkvz`` -> ``in_proj_qkv`` +
    ``in_proj_z`` and ``in_proj_ba`` -> ``in_proj_b`` + ``in_proj_a`` (rows picked as
    ``split_qwen3_next_projections`` picks them); None: any other tensor."""
    if name is None:
        return None
    if name.endswith(".linear_attn.conv_weight") and len(item.shape) == 3 and item.shape[1] == 1:
        return [(name, Incoming(item.name, (item.shape[0], item.shape[2]), item.dtype,
                                lambda: item.load().squeeze(1)))]
    m = _SPLIT.fullmatch(name)
    if m is None:
        return None
    cfg = model.config
    r, kd, vd = cfg.linear_num_value_heads // cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    want = cfg.linear_num_key_heads * ((2 * kd + 2 * r * vd) if m.group(2) == "in_proj_qkvz" else 2 * r)
    if len(item.shape) != 2 or item.shape[0] != want:
        raise LogprobeError(field, f"{item.name!r} has shape {item.shape}, the model's is ({want}, {cfg.hidden_size})")
    rows = torch.arange(want)[:, None]  # [want, 1]: which incoming row each part's row is
    qkvz, ba = (rows, torch.zeros(cfg.linear_num_key_heads * 2 * r, 1, dtype=rows.dtype)) \
        if m.group(2) == "in_proj_qkvz" else (torch.zeros(cfg.linear_num_key_heads * (2 * kd + 2 * r * vd), 1,
                                                          dtype=rows.dtype), rows)
    parts = split_qwen3_next_projections(qkvz, ba, cfg.linear_num_key_heads, kd, cfg.linear_num_value_heads, vd)
    keep = ("in_proj_qkv", "in_proj_z") if m.group(2) == "in_proj_qkvz" else ("in_proj_b", "in_proj_a")
    return [(f"{m.group(1)}.{part}.weight",
             Incoming(item.name, (len(parts[part]), item.shape[1]), item.dtype,
                      lambda idx=parts[part][:, 0]: item.load()[idx]))
            for part in keep]


FAMILY = register(Family(
    name="hybrid", title="Qwen3.5 / Qwen3-Next", config_class=HybridConfig, model_types=HYBRID_TYPES,
    config=lambda raw: (hybrid_config(raw), ""),
    model_class=lambda cfg: HybridModel,
    tensors=lambda path, cfg, raw, load: hybrid_tensors(path, cfg, raw, load.quantize_activations,
                                                        load.weights == "dense", load.place),  # FP8 too
    build=lambda cfg, tensors, load, ctx: build_hybrid(cfg, tensors, load.device, load.dtype, ctx),
    parallel_context=hybrid_parallel_context,
    shard_tensors=lambda path, cfg, ctx, load: None if ctx.size == 1 else hybrid_shard_tensors(path, cfg, ctx,
                                                                                                load.place),
    param_name=hybrid_param_name,
    gguf_archs=tuple(HYBRID_ARCHES),  # read whole, expanded, on one device (loading.gguf_archs)
    gguf_config=gguf_hybrid_config,
    gguf_tensors=lambda reader, arch, cfg, load: gguf_hybrid_tensors(reader, arch, cfg),
    units=hybrid_units,
    data_attention=True,  # the MoE variants: attention by data with whole experts per rank
    towers=("visual.",),  # Qwen3.5's vision tower: updated where sent (``loading.update``)
))
