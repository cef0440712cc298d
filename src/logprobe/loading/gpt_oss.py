"""Hugging Face directories of gpt-oss (``gpt_oss``, ``models.gpt_oss``): the hub's MXFP4
checkpoints and float (bf16) ones as transformers writes them after dequantizing.

Expert tensors, per layer (``model.layers.N.mlp.experts.``; E experts, hidden H, intermediate I):

    float:  gate_up_proj [E, H, 2I] (x @ W: columns alternate gate 0, up 0, gate 1, ...),
            down_proj [E, I, H]
    MXFP4:  gate_up_proj_blocks [E, 2I, H/32, 16] uint8 + gate_up_proj_scales [E, 2I, H/32] uint8
            (rows alternate gate / up), down_proj_blocks [E, H, I/32, 16] + down_proj_scales [E, H, I/32]
            (``kernels.mxfp4`` says how a block decodes)
    both:   gate_up_proj_bias [E, 2I] (alternating), down_proj_bias [E, H]

The native experts hold [E, out, in] with the gate rows first, then the up rows
(``layers.moe_gpt_oss``): float tensors are transposed and their gate/up columns split at load;
MXFP4 blocks stay packed (uint8 in memory, 4.25 bits a weight) with only their rows reordered, or
are expanded once to the model dtype with ``weights="dense"`` (the same numbers: every MXFP4 value
is exact in bf16). Weight updates move a trainer's float expert tensors with the same function
(``native_expert_layout``) and refuse a model whose experts are packed. Everything else (attention with biases and sinks, router, norms, embeddings,
``lm_head``) is a float tensor read as it is.

Config options the native model does not run are refused with their key named: a quantization
other than MXFP4, a rope type other than YaRN (or the default), a null ``sliding_window`` with
sliding blocks, layer types other than sliding/full attention.

Tensor parallelism (``gpt_oss_shard_tensors``): each rank reads the attention rows its layers hold
(its heads' q/k/v rows and biases and sinks, its rows of o_proj and its bias; ``held_ranges``), the
router whole, and every expert or, under expert parallelism, its E / TP experts (``models.gpt_oss``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..kernels.mxfp4 import check_scales, dequantize_mxfp4
from ..layers.moe_gpt_oss import Mxfp4Experts
from ..layers.parallel_linear import held_ranges
from ..models.gpt_oss import GptOssConfig, GptOssModel
from ..parallel.context import ParallelContext
from ..parallel.shard import check_tp, num_blocks, vocab_chunk_width
from .checkpoint import check_plain_dtype, check_weights_match, open_files
from .registry import Family, Incoming, register
from .sharding import attention_layout

log = logging.getLogger(__name__)

MODEL_TYPE = "gpt_oss"
_EXPERT_KEYS = ("gate_up_proj", "down_proj")
FLOAT_EXPERT_PARTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def is_mxfp4(raw: dict) -> bool:
    """A gpt-oss checkpoint whose experts are MXFP4 (kept packed at load by default)."""
    return _quantization(raw)


def _int(raw: dict, key: str, default=None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise LogprobeError(f"config.{key}", "is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise LogprobeError(f"config.{key}", f"must be an integer, got {value!r}")
    return value


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(theta, YaRN parameters or None): transformers 5's ``rope_parameters`` (theta inside) or the
    hub's ``rope_scaling`` + ``rope_theta``; transformers' gpt_oss defaults when both are absent."""
    key = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(key)
    if params is None and key == "rope_scaling" and "rope_scaling" in raw:
        params = {"rope_type": "default"}
    if params is None:
        params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096}
    if not isinstance(params, dict):
        raise LogprobeError(f"config.{key}", f"must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "yarn"):
        raise LogprobeError(f"config.{key}.rope_type", f"{kind!r} is not in the native gpt_oss model",
                            "the released models use yarn")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 150000.0)))
    if kind == "default":
        return theta, None
    return theta, {k: v for k, v in params.items() if k not in ("rope_theta", "type")} | {"rope_type": "yarn"}


def _quantization(raw: dict) -> bool:
    """True for an MXFP4 checkpoint; other quantizations refused."""
    q = raw.get("quantization_config")
    if q is None:
        return False
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "mxfp4":
        raise LogprobeError("quantization_config.quant_method", f"{method!r}: a gpt_oss checkpoint is read natively "
                            "as MXFP4 (the hub's) or float", "score the MXFP4 or the bf16 checkpoint")
    return True


def gpt_oss_config(raw: dict) -> GptOssConfig:
    """The native config of a gpt-oss checkpoint; missing keys take transformers' ``GptOssConfig``
    defaults; what the native model does not run is refused, key named."""
    _quantization(raw)
    layers = _int(raw, "num_hidden_layers", 36)
    layer_types = raw.get("layer_types")
    if layer_types is None:  # transformers' default: even blocks slide, odd ones are full
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(layer_types, list):
        raise LogprobeError("config.layer_types", f"must be a list, got {layer_types!r}")
    window = raw.get("sliding_window", 128)
    if window is None:
        if "sliding_attention" in layer_types:
            raise LogprobeError("config.sliding_window", "is null, but layer_types has sliding_attention blocks")
        window = 1 << 62
    elif isinstance(window, bool) or not isinstance(window, int):
        raise LogprobeError("config.sliding_window", f"must be an integer, got {window!r}")
    theta, scaling = _rope(raw)
    hidden, heads = _int(raw, "hidden_size", 2880), _int(raw, "num_attention_heads", 64)
    head_dim = raw.get("head_dim") or hidden // heads
    for key in ("swiglu_alpha", "swiglu_limit", "rms_norm_eps"):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise LogprobeError(f"config.{key}", f"must be a number, got {value!r}")
    return GptOssConfig(
        vocab_size=_int(raw, "vocab_size", 201088),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", 2880),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_int(raw, "num_key_value_heads", 8),
        head_dim=int(head_dim),
        num_experts=_int(raw, "num_local_experts", 128),
        top_k=_int(raw, "num_experts_per_tok", 4),
        layer_types=tuple(layer_types),
        sliding_window=window,
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(raw.get("attention_bias", True)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=_int(raw, "max_position_embeddings", 131072),
    )


def gpt_oss_param_name(key: str, cfg: GptOssConfig, where: str) -> str | None:
    """A checkpoint key -> the native name (MXFP4 parts keep their ``_blocks`` / ``_scales``
    suffix; None: a tensor the forward does not use)."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    if key == "lm_head.weight":
        return None if cfg.tie_word_embeddings else "lm_head.weight"
    if key.startswith("model."):
        return key[len("model."):]
    raise LogprobeError("model", f"unexpected tensor {key!r} in {where}")


def gpt_oss_tensors(path: Path, cfg: GptOssConfig):
    """Yield (name, tensor) from the safetensors files: float tensors checked as such, MXFP4 blocks
    and scales as uint8."""

    for f, st in open_files(path):
        for key in st.keys():
            name = gpt_oss_param_name(key, cfg, f.name)
            if name is None:
                continue
            value = st.get_tensor(key)
            if name.endswith(("_blocks", "_scales")) and ".mlp.experts." in name:
                if value.dtype != torch.uint8:
                    raise LogprobeError("model", f"tensor {key!r} in {f.name} is {value.dtype}, MXFP4 blocks "
                                        "and scales are uint8")
                if name.endswith("_scales"):
                    check_scales(value, key)
            else:
                check_plain_dtype(key, value, f.name)
            yield name, value


def gpt_oss_parallel_context(cfg: GptOssConfig, rank: int = 0, size: int = 1, group=None,
                             experts: int = 1, attention: str | None = None) -> ParallelContext:
    """A rank's context (``loader.parallel_context``), after checking the experts split ``experts``
    ways: 1 (whole on every rank) or the TP size (E / TP whole experts a rank; gpt-oss does not
    split an expert's rows), and the attention layout (``sharding.attention_layout``: "data" by
    default with whole experts per rank, attention whole on every rank and only the vocabulary
    split; "tensor": query heads, kv heads divided or replicated by a multiple, vocabulary chunks,
    hidden size checked against ``size``)."""
    if isinstance(experts, bool) or not isinstance(experts, int) or experts not in (1, size):
        raise LogprobeError("expert_parallel_size", f"{experts!r}: {cfg.family} keeps each expert whole on a rank",
                            f"use 1 (every expert on every rank) or the tensor_parallel_size {size} (E / {size} "
                            "experts a rank)")
    if cfg.num_experts % experts:
        raise LogprobeError("expert_parallel_size", f"{experts} does not divide num_local_experts {cfg.num_experts}",
                            "use 1, or a tensor_parallel_size dividing the experts")
    vocab_chunks = -(-cfg.vocab_size // vocab_chunk_width(cfg.vocab_size))
    layout = attention_layout(cfg, size, experts, attention)
    if layout == "data":  # attention whole on every rank: only the vocabulary splits
        check_tp(size, size, vocab_chunks, size)
    else:
        check_tp(cfg.num_heads, cfg.num_kv_heads, vocab_chunks, size)
        if cfg.hidden_size % size:
            raise LogprobeError("tensor_parallel_size", f"{size} does not divide hidden_size {cfg.hidden_size} of "
                                f"{cfg.family}", "use a size that divides hidden_size")
    return ParallelContext(rank, size, group, num_blocks(cfg.num_heads, cfg.hidden_size), experts, layout)


def gpt_oss_shard_tensors(path: Path, cfg: GptOssConfig, ctx: ParallelContext):
    """``gpt_oss_tensors``, each cut to what this rank's layers hold: attention rows (``held_ranges``),
    the experts it holds (every expert tensor is [E, ...]: float, MXFP4 blocks and scales, biases),
    the rest whole (norms, router) or by vocabulary (embeddings, head)."""
    with torch.device("meta"):
        model = GptOssModel(cfg, ctx)
    for name, w in gpt_oss_tensors(path, cfg):
        if ".mlp.experts." in name:
            experts = model.get_submodule(name.partition(".mlp.experts.")[0] + ".mlp.experts")
            yield name, w[experts.first_expert:experts.first_expert + experts.num_experts]
            continue
        ranges = held_ranges(model, name)
        yield name, w if ranges is None else torch.cat([w[a:b] for a, b in ranges])


def _gate_up_rows(w: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with rows alternating gate / up -> gate rows, then up rows."""
    return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)


def native_expert_layout(part: str, w: torch.Tensor) -> torch.Tensor:
    """A float expert tensor of the checkpoint (``part``: its name after ``.mlp.experts.``) in the
    native layout (module docstring): gate_up_proj [E, H, 2I] -> [E, 2I, H] gate rows then up
    rows, down_proj [E, I, H] -> [E, H, I], gate_up_proj_bias [E, 2I] -> gate then up; down_proj_bias
    as it is. Only rows move: the values are the checkpoint's, bit for bit (loading and weight
    updates both use it; on a meta tensor it gives the native shape).

    >>> native_expert_layout("gate_up_proj_bias", torch.tensor([[0., 10., 1., 11.]]))
    tensor([[ 0.,  1., 10., 11.]])
    >>> tuple(native_expert_layout("gate_up_proj", torch.empty(4, 64, 32, device="meta")).shape)
    (4, 32, 64)
    """
    if part == "gate_up_proj_bias":
        return _gate_up_rows(w)
    if part == "gate_up_proj":
        return _gate_up_rows(w.transpose(1, 2))  # [E, H, 2I] -> [E, 2I, H]
    if part == "down_proj":
        return w.transpose(1, 2)  # [E, I, H] -> [E, H, I]
    if part == "down_proj_bias":
        return w
    raise LogprobeError("model", f"unexpected expert tensor {part!r}")


def mark_packed(model: GptOssModel) -> None:
    """Mark ``model`` (on the meta device, a driver's weightless model) as holding MXFP4 experts,
    as its workers do after loading an MXFP4 checkpoint: what a weight update checks before it
    sends anything."""
    for layer in model.layers:
        experts = layer.mlp.experts
        for name in _EXPERT_KEYS:
            E, rows, cols = getattr(experts, name).shape
            experts.set_packed(name, Mxfp4Experts(torch.empty(E, rows, cols // 32, 16, dtype=torch.uint8,
                                                              device="meta"),
                                                  torch.empty(E, rows, cols // 32, dtype=torch.uint8, device="meta")))


def _expert_tensor(name: str, w: torch.Tensor, device: torch.device, dtype: torch.dtype, state: dict,
                   halves: dict) -> None:
    """One checkpoint expert tensor, on ``device``, into the native layout (module docstring): a
    float one into ``state`` (model dtype), an MXFP4 part into ``halves[name] = [blocks, scales]``."""
    prefix, _, part = name.rpartition(".mlp.experts.")
    w = w.to(device)
    if part in FLOAT_EXPERT_PARTS:
        state[name] = native_expert_layout(part, w).to(dtype).contiguous()
    elif part.endswith(("_blocks", "_scales")) and part.rsplit("_", 1)[0] in _EXPERT_KEYS:
        proj = part.rsplit("_", 1)[0]
        slot = halves.setdefault(f"{prefix}.mlp.experts.{proj}", [None, None])
        slot[part.endswith("_scales")] = (_gate_up_rows(w) if proj == "gate_up_proj" else w).contiguous()
    else:
        raise LogprobeError("model", f"unexpected expert tensor {name!r}")


def _check_halves(halves: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: [blocks, scales]} -> {name: (blocks, scales)}, each pair complete and of fitting shapes."""
    for name, (blocks, scales) in halves.items():
        if blocks is None or scales is None:
            raise LogprobeError("model", f"{name}: MXFP4 needs both {name}_blocks and {name}_scales")
        if blocks.dim() != 4 or tuple(blocks.shape[:3]) != tuple(scales.shape) or blocks.shape[3] != 16:
            raise LogprobeError("model", f"{name}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do "
                                "not fit [E, out, in/32, 16] and [E, out, in/32]")
    return {n: (b, s) for n, (b, s) in halves.items()}


def build_gpt_oss(cfg: GptOssConfig, tensors, device: torch.device, dtype: torch.dtype,
                  weights: str = "packed", ctx: ParallelContext | None = None) -> GptOssModel:
    """The native model from (name, tensor) pairs. MXFP4 experts stay packed (``weights="packed"``)
    or are expanded to ``dtype`` once (``"dense"``); every parameter must be present with the shape
    the config implies; q/k rows and biases permuted to the interleaved rotary layout. ``ctx``: this
    rank's tensor-parallel group; ``tensors`` then yields its rows (``gpt_oss_shard_tensors``)."""
    state, halves = {}, {}
    for name, w in tensors:  # each moved to the device as it comes (host memory: one tensor at a time)
        if ".mlp.experts." in name:
            _expert_tensor(name, w, device, dtype, state, halves)
        else:
            state[name] = w.to(device=device, dtype=dtype)
    packed = _check_halves(halves)
    if weights == "dense":  # one expert at a time, on the device
        for name in list(packed):
            blocks, scales = packed.pop(name)
            w = torch.empty(blocks.shape[0], blocks.shape[1], blocks.shape[2] * 32, dtype=dtype, device=device)
            for e in range(blocks.shape[0]):
                w[e] = dequantize_mxfp4(blocks[e], scales[e])
            state[name] = w
    with torch.device("meta"):
        model = GptOssModel(cfg, ctx)
    # a packed matrix is checked as the [E, out, in] parameter it replaces
    stand_ins = {name: torch.empty(b.shape[0], b.shape[1], b.shape[2] * 32, device="meta")
                 for name, (b, _) in packed.items()}
    check_weights_match(model, {**state, **stand_ins})
    model.load_state_dict(GptOssModel.interleave_rope_weights(cfg, state), assign=True, strict=False)
    for name, (blocks, scales) in packed.items():
        parent, _, child = name.rpartition(".")
        experts = Mxfp4Experts(blocks, scales)
        experts.compute_dtype = dtype
        model.get_submodule(parent).set_packed(child, experts)
    model.make_rotary(device)  # non-persistent buffers were created on the meta device
    model.fuse_projections()
    if packed:
        log.info("gpt_oss: %d MXFP4 expert matrices kept packed", len(packed))
    return model.eval()


def gpt_oss_units(name: str | None, item: Incoming, model, field: str) -> list[tuple[str | None, Incoming]]:
    """A weight update's tensor as its loader makes it (``loading.update.units``): a float expert
    tensor in transformers' layout (``gate_up_proj`` [E, H, 2I] with gate / up columns alternating,
    ``down_proj`` [E, I, H], their biases) moved into the native one (``native_expert_layout``:
    whole [E, ...] units, rows only moved); MXFP4 parts refused (updates take the trainer's float
    weights); any other tensor as it is."""
    if name is None:
        return [(name, item)]
    cfg = model.config
    part = name.rpartition(".mlp.experts.")[2] if ".mlp.experts." in name else None
    if part is None:
        return [(name, item)]
    if part.endswith(("_blocks", "_scales")):
        raise LogprobeError(field, f"{item.name!r} is an MXFP4 part: weight updates take float expert tensors",
                            "send the float (bf16) expert weights as transformers holds them (experts.gate_up_proj "
                            "[E, H, 2I], experts.down_proj [E, I, H])")
    E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    want = {"gate_up_proj": (E, H, 2 * inter), "down_proj": (E, inter, H), "gate_up_proj_bias": (E, 2 * inter),
            "down_proj_bias": (E, H)}.get(part)
    if want is None or part not in FLOAT_EXPERT_PARTS:
        return [(name, item)]  # not a weight of the model: refused by name in ``update.check``
    if item.shape != want:
        raise LogprobeError(field, f"{item.name!r} has shape {item.shape}, the model's is {want} (transformers' "
                            "layout)")
    shape = tuple(native_expert_layout(part, torch.empty(want, device="meta")).shape)
    return [(name, Incoming(item.name, shape, item.dtype, lambda: native_expert_layout(part, item.load())))]


def _describe(model: GptOssModel, raw: dict | None) -> None:
    if raw is not None and is_mxfp4(raw):
        mark_packed(model)  # as the workers hold the experts: what a weight update checks first


FAMILY = register(Family(
    name="gpt_oss", title="gpt-oss", config_class=GptOssConfig, model_types=(MODEL_TYPE,),
    config=lambda raw: (gpt_oss_config(raw), ""),
    model_class=lambda cfg: GptOssModel,
    tensors=lambda path, cfg, raw, load: gpt_oss_tensors(path, cfg),
    build=lambda cfg, tensors, load, ctx: build_gpt_oss(cfg, tensors, load.device, load.dtype, load.weights, ctx=ctx),
    parallel_context=gpt_oss_parallel_context,
    shard_tensors=lambda path, cfg, ctx, load: gpt_oss_shard_tensors(path, cfg, ctx),
    param_name=gpt_oss_param_name,
    describe=_describe,
    whole_experts=True,
    data_attention=True,
    units=gpt_oss_units,
))
