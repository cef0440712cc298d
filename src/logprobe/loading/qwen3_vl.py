"""Hugging Face directories of Qwen3-VL (``qwen3_vl``: Qwen3 text blocks) and Qwen3-VL MoE
(``qwen3_vl_moe``: Qwen3-MoE blocks) with their ``text_config`` and ``vision_config``
(``models.qwen3_vl``).

The text config is read by the Llama family's reader (``hf.native_config``, as ``qwen3`` /
``qwen3_moe``), its rotary from ``rope_parameters`` (or the older ``rope_scaling`` and
``rope_theta``): the default rotary with the interleaved ``mrope_section``; the MoE router always
renormalises its top k (transformers' ``Qwen3VLMoeTextTopKRouter``). The vision config is Qwen3.5's
tower's with ``deepstack_visual_indexes`` (``qwen3_5_vision.vision_config``). What either does not
run is refused with its key named: the transformers backend has no causal-LM class for these
checkpoints, so nothing falls back to it.

Checkpoint keys: ``model.language_model.*`` (the text model), ``model.visual.*`` (the tower:
``visual.*``), ``lm_head.weight``; any other key is refused. Experts come as transformers holds them
in memory (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) or as the released
checkpoints store them, each matrix transposed ([E, H, 2I], [E, I, H]); as transformers' loader
does, a tensor already of the model's shape is taken as is (``expert_layout``). Quantized
checkpoints are refused.

Tensor parallelism: the text model splits as the Llama family's (and the MoE's experts, with
data-parallel attention where the experts are whole per rank); the tower is whole on every rank
(``qwen3_vl_shard_tensors``), each rank embedding the images of its pass, as Qwen3.5's.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..models.qwen3_5_vision import vision_config
from ..models.qwen3_vl import Qwen3VLConfig, qwen3_vl_model_class
from ..parallel.context import ParallelContext
from .checkpoint import SKIP, check_plain_dtype, open_files, tower_skipping_tensors
from .hf import native_config, stack_experts
from .llama import build_native, llama_parallel_context
from .registry import Family, Load, register
from .sharding import held_experts, rank_cut, read_cut

log = logging.getLogger(__name__)

# model_type -> (its text_config's model_type, the Llama family's reader of the same blocks)
WRAPPERS = {"qwen3_vl": ("qwen3_vl_text", "qwen3"), "qwen3_vl_moe": ("qwen3_vl_moe_text", "qwen3_moe")}
_TOWER = "model.visual."


def qwen3_vl_config(raw: dict) -> Qwen3VLConfig:
    """The native config of a Qwen3-VL checkpoint's config.json; refuses (naming the key) what the
    native model does not run."""
    mtype = raw.get("model_type")
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise LogprobeError("config.text_config", f"model_type {mtype!r} needs a text_config object")
    ttype, reader = WRAPPERS[mtype]
    if text.get("model_type", ttype) != ttype:
        raise LogprobeError("config.text_config.model_type", f"{text['model_type']!r} inside {mtype!r}, "
                            f"expected {ttype!r}")
    if raw.get("quantization_config") is not None or text.get("quantization_config") is not None:
        raise LogprobeError("quantization_config", f"a quantized {mtype} checkpoint is not read natively yet",
                            "score the float (bf16) checkpoint")
    theta, section = _mrope(text)
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    plain = {k: v for k, v in text.items() if k not in ("rope_scaling", "rope_theta")}
    plain.update(model_type=reader, tie_word_embeddings=bool(tie),
                 rope_parameters={"rope_type": "default", "rope_theta": theta})
    base, why = native_config(plain)
    if base is None:
        raise LogprobeError("config.text_config", f"{why} (of the {mtype} text model)",
                            "use a checkpoint as released")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    if base.moe is not None:  # Qwen3VLMoeTextTopKRouter: top-k weights always renormalised
        fields["moe"] = dataclasses.replace(base.moe, norm_topk_prob=True)
    vision, image_token = None, None
    if raw.get("vision_config") is not None:
        vision = vision_config(raw["vision_config"], deepstack=True)
        image_token = _int(raw, "image_token_id", 151655)
        if vision.out_hidden_size != base.hidden_size:
            raise LogprobeError("config.vision_config.out_hidden_size", f"{vision.out_hidden_size}: the tower's "
                                f"tokens must have the text model's hidden_size {base.hidden_size}")
        if len(vision.deepstack) > base.num_layers:
            raise LogprobeError("config.vision_config.deepstack_visual_indexes", f"{len(vision.deepstack)} "
                                f"deepstack features for {base.num_layers} text blocks")
    return Qwen3VLConfig(**fields, mrope_section=section, vision=vision, image_token_id=image_token, family=mtype)


def _int(raw: dict, key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LogprobeError(f"config.{key}", f"must be a token id, got {value!r}")
    return value


def _mrope(text: dict) -> tuple[float, tuple[int, int, int]]:
    """(rope_theta, mrope_section) of the text config: ``rope_parameters`` (transformers >= 5) or
    ``rope_scaling`` with ``rope_theta`` beside it; the default rotary, interleaved sections."""
    where = "config.text_config.rope_parameters"
    params = text.get("rope_parameters")
    if params is None:
        where, params = "config.text_config.rope_scaling", dict(text.get("rope_scaling") or {})
        params.setdefault("rope_theta", text.get("rope_theta", 5000000.0))
    if not isinstance(params, dict):
        raise LogprobeError(where, f"must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind != "default":
        raise LogprobeError(f"{where}.rope_type", f"{kind!r} is not in the native Qwen3-VL model",
                            "the released models use the default rotary")
    if params.get("mrope_interleaved", True) is not True:  # transformers' Qwen3-VL interleaves whatever it says
        raise LogprobeError(f"{where}.mrope_interleaved", f"{params['mrope_interleaved']!r}: Qwen3-VL's rotary "
                            "interleaves the sections (as transformers runs it)")
    section = params.get("mrope_section", [24, 20, 20])
    if not isinstance(section, list) or len(section) != 3 or not all(isinstance(x, int) and x >= 0 for x in section):
        raise LogprobeError(f"{where}.mrope_section", f"must be three integers, got {section!r}")
    theta = params.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise LogprobeError(f"{where}.rope_theta", f"must be a positive number, got {theta!r}")
    return float(theta), tuple(section)


def qwen3_vl_param_name(key: str, cfg: Qwen3VLConfig, where: str) -> str | None:
    """A checkpoint key -> the native parameter name (None: a tensor the model does not hold: a
    tied ``lm_head``, a rotary table, the tower of a config without ``vision_config``)."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    if key == "lm_head.weight":
        return None if cfg.tie_word_embeddings else "lm_head.weight"
    if key.startswith("model.language_model."):
        return key.removeprefix("model.language_model.")
    if key.startswith(_TOWER):
        return key.removeprefix("model.") if cfg.vision is not None else None
    raise LogprobeError("model", f"unexpected tensor {key!r} in {where}")


def expert_layout(name: str, w, cfg: Qwen3VLConfig):
    """A stacked expert tensor in the native layout: ``gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I]; the released checkpoints' [E, H, 2I] / [E, I, H] transposed. A tensor already of the
    native shape is taken as is (transformers' ``Transpose(check_dims=True)``: where H = 2I the two
    layouts look alike, and transformers reads such a tensor as it stands too). Other tensors pass.

    >>> import torch; from logprobe.layers.moe import MoeSpec
    >>> cfg = Qwen3VLConfig(100, 8, 16, 1, 2, 2, 4, moe=MoeSpec(2, 1, 3, True))  # E 2, H 8, I 3
    >>> [tuple(expert_layout(f"layers.0.mlp.experts.{n}", torch.zeros(s), cfg).shape)
    ...  for n, s in (("gate_up_proj", (2, 8, 6)), ("gate_up_proj", (2, 6, 8)), ("down_proj", (2, 3, 8)))]
    [(2, 6, 8), (2, 6, 8), (2, 8, 3)]
    """
    part = name.rpartition(".")[2]
    if cfg.moe is None or not name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        return w
    E, H, inter = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    native = (E, 2 * inter, H) if part == "gate_up_proj" else (E, H, inter)
    if tuple(w.shape) == native:
        return w
    if tuple(w.shape) == (E, native[2], native[1]):
        return w.transpose(1, 2).contiguous()
    raise LogprobeError("model", f"tensor {name} has shape {tuple(w.shape)}, the config implies {native} "
                        f"(or {(E, native[2], native[1])} as released)")


def qwen3_vl_tensors(path: Path, cfg: Qwen3VLConfig, load: Load):
    """(native name, tensor) of a float Qwen3-VL checkpoint, experts in the native layout and split
    (``hf.stack_experts``: gate_up_proj into gate and up)."""
    named = tower_skipping_tensors(path, lambda key, file: qwen3_vl_param_name(key, cfg, file), (_TOWER,),
                                   "the vision tower: the config has no vision_config", log)
    stream = ((name, expert_layout(name, w, cfg)) for name, w in named)
    yield from stack_experts(stream, cfg, place=load.place)


def qwen3_vl_shard_tensors(path: Path, cfg: Qwen3VLConfig, ctx: ParallelContext, load: Load):
    """This rank's slices of a float Qwen3-VL checkpoint (None at one rank: the whole model): the
    text model's as the Llama family's (``sharding.rank_cut``: only those bytes read; other ranks'
    experts not read), the tower whole (its layers hold no rows of their own: every rank runs it).
    Experts stored as released (transposed) are read whole, turned, then cut."""
    if ctx.size == 1:
        return None
    with torch.device("meta"):
        model = qwen3_vl_model_class(cfg)(cfg, ctx=ctx)

    def read():
        for f, st in open_files(path, prefetch=False):
            for key in st.keys():
                name = qwen3_vl_param_name(key, cfg, f.name)
                cut = None if name is None else rank_cut(model, name)
                if name is None or cut is SKIP:
                    continue
                shape = tuple(st.get_slice(key).get_shape())
                if expert_layout(name, torch.empty(shape, device="meta"), cfg).shape != shape:  # released layout
                    w = expert_layout(name, st.get_tensor(key), cfg)
                    w = w if cut is None else cut(w).contiguous()
                else:
                    w = read_cut(st, key, cut)
                check_plain_dtype(key, w, f.name)
                yield name, w

    return stack_experts(read(), cfg, held_experts(model), load.place)


FAMILY = register(Family(
    name="qwen3_vl", title="Qwen3-VL", config_class=Qwen3VLConfig, model_types=tuple(WRAPPERS),
    config=lambda raw: (qwen3_vl_config(raw), ""),
    model_class=qwen3_vl_model_class,
    tensors=lambda path, cfg, raw, load: qwen3_vl_tensors(path, cfg, load),
    build=lambda cfg, tensors, load, ctx: build_native(cfg, tensors, load.device, load.dtype, ctx=ctx,
                                                       model_class=qwen3_vl_model_class(cfg)),
    parallel_context=llama_parallel_context,
    shard_tensors=qwen3_vl_shard_tensors,
    param_name=qwen3_vl_param_name,
    data_attention=True,  # the MoE's blocks are the Llama family's: whole attention per rank
    towers=("visual.",),  # the vision tower: updated where sent (``loading.update``)
))
