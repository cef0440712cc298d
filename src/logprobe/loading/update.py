"""New weights for a loaded native model, in place and all or nothing (RL: the trainer's policy).

Names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``), as
``named_parameters()`` / ``state_dict()`` of the trainer's model or a safetensors checkpoint give
them. Every tensor is checked (a known name, not seen before, a float dtype, the exact shape,
finite values: no NaN or inf, none beyond the model's dtype) before any weight changes, so a bad
name, shape or value leaves the old weights in force:

    named tensors --check each--> (native name, tensor) ... all present? --> copy into the model

    a list / dict (every tensor already in memory): check all of them first, then copy each one
        in place: no extra memory;
    an iterator (a stream: tensors made one at a time): each is checked and converted to the
        model's dtype and device as it comes (staged), the stream's own tensor is dropped, and
        the staged ones are copied in once the stream ended complete: at most one more copy of
        the weights, on the model's device, and never the stream collected twice;
    a safetensors file or directory: names, dtypes and shapes come from the headers, so all are
        checked before one tensor is read; then each tensor is read and checked for finite values,
        then read again and copied, one at a time (twice the reads, no extra memory).

Families (``registry.Family``, each registered beside its loader: ``loading.families``): the
family of the model's config gives its loader's own name mapping (``param_name``: the same tensors
the loader skips are ignored, e.g. multi-token-prediction layers), its rotary row
permutation (``interleave``), the fused tensors its loader cuts by rows (``fused``: q/k/v and
gate/up), the tensors it reshapes (``units``: a conv weight squeezed, fused mixer projections cut,
experts moved from transformers' layout into the native one, whole [E, ...] tensors where
``whole_experts``), its weights transformers holds as buffers (``buffers``) and its vision
tower's (``towers``, e.g. ``model.visual.*``: taken where sent, the others kept: a trainer
may freeze the tower); routers held in float32 stay float32. A model held as FP8 blocks takes FP8
blocks (codes and ``weight_scale_inv``, as its checkpoint stores them: ``loading.update_fp8``).
Other packed-quantized models are refused (GGUF, compressed-tensors, FP8 with quantized
activations), and so is a model holding MXFP4-packed experts: a trainer sends float (bf16) weights, and writing
them into MXFP4 blocks would mean requantizing, which scores other weights than the trainer's; the
error names the tensor and the fix (load with ``weights="dense"``: MXFP4 values are exact in the
model dtype, so the scores do not change, and updates then take float weights exactly).

Mixture-of-experts models take experts one by one (``model.layers.N.mlp.experts.{e}.gate_proj.weight``,
as checkpoints store them, ``block_sparse_moe`` names too) or stacked, as transformers holds
them in memory (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); see ``units``.
A missing tensor is named as the trainer sends it (``sent_names``). Split over ranks, each expert
goes to the ranks that hold it (its owner, and replicas of hot ones), each its rows of it
(``rank_part``: ``Experts.held``).

Weights transformers holds as buffers (the sigmoid routers' ``gate.e_score_correction_bias``, a
per-layer ``layer_scalar``: ``Family.buffers``) are not in a trainer's ``named_parameters()``: taken
when sent (``state_dict()``, or ``named_parameters()`` with ``named_buffers()``, whose rotary tables
are ignored), kept, with a warning naming them, when none is sent (``check_complete``).

Tensor/data-parallel scorers: the driver checks each tensor against its weightless (meta) model,
cuts the ranks' slices (each rank's layers state theirs: ``loading.sharding``, the loader's split) and sends them to the
workers, which stage them (``StagedWeights``), all confirm, then all copy in (``update_workers``).
Under torchrun a rank's shard takes its own slice of each whole tensor (``rank_slice``).

Each tensor becomes what the loader makes of the same checkpoint tensor (``.to(dtype, device)``,
q/k rows to the interleaved RoPE layout), so scores equal those of a fresh load of the new
weights, bitwise. A tied model's ``lm_head.weight`` is its embedding: given, it is checked for
shape and ignored (as the loader ignores it on disk).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..errors import LogprobeError, WeightsUnavailable
from ..layers.moe import ExpertMatrices
from ..layers.moe_gpt_oss import Mxfp4Experts
from ..layers.parallel_linear import held_ranges
from ..layers.quant_linear import PackedEmbedding, PackedWeight
from .checkpoint import _EXPERT, safetensors_files
from .loader import parallel_context
from .registry import Family, Incoming, family_of
from .update_fp8 import (
    FP8_LAYERS,
    SCALE,
    check_fp8_item,
    check_fp8_model,
    fp8_names,
    fp8_slots,
    fp8_value,
    held_float_message,
    holds_fp8,
    is_fp8_slot,
    scale_weight_name,
    spell_scale,
    whole_fp8_slots,
    whole_rows,
)

log = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_STACKED = re.compile(r"layers\.\d+\.mlp\.experts\.(gate_proj|up_proj|down_proj)")  # [E, out, in] parameters
_UNIT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.(\d+)")  # one expert's unit
_DERIVED = ("inv_freq", ".embed_scale")  # non-persistent buffers of transformers' models (``native_name``)
# Native renames of transformers' names, undone to name a missing weight as the trainer sends it.
_RENAMES = ((".mlp.shared_expert.", ".mlp.shared_experts."),
            (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"))
_SAFETENSORS_FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                       "F8_E4M3": torch.float8_e4m3fn}  # FP8 codes: taken by a model held FP8 (``update_fp8``)


@dataclass(frozen=True, slots=True)
class Applied:
    """What an update did: ``tensors`` copied in; ``kept``: the weights transformers holds as
    buffers that it left as they were (none of them was sent: ``check_complete``), named as a
    trainer sends them (``model.layers.1.mlp.gate.e_score_correction_bias``)."""

    tensors: int
    kept: tuple[str, ...] = ()


def family(model) -> Family:
    """The ``registry.Family`` of a loaded native model (by its config); refuses the transformers
    backend."""
    found = family_of(getattr(model, "config", None))
    if found is None:
        raise LogprobeError("model", f"{type(model).__name__} (the transformers backend) has no weight update",
                            "use a native model (a Hugging Face directory of a native family, or a GGUF file)")
    return found


def weight_slots(model) -> dict[str, torch.Tensor]:
    """Native parameter name -> the live parameter it is copied into (q/k/v and gate/up are views
    of their fused weight, so writing them writes the fused matmul too): exactly the names a
    checkpoint of this model holds. A mixture of experts' stacked ``layers.N.mlp.experts.gate_proj``
    [E, out, in] is E units ``layers.N.mlp.experts.gate_proj.{e}`` (views [out, in]). A
    tensor-parallel shard's parameters are its slices. Refuses models whose weights cannot take
    float tensors."""
    family(model)
    check_fp8_model(model)
    for name, m in model.named_modules():
        if type(m) in FP8_LAYERS:  # FP8 blocks take FP8 blocks (``update_fp8``)
            continue
        if isinstance(m, (PackedWeight, PackedEmbedding, ExpertMatrices)):
            raise LogprobeError("model", f"{name} holds packed-quantized weights ({type(m).__name__}): float "
                                "tensors cannot be written into quantized blocks exactly",
                                "load the float checkpoint, or reload the scorer from the new quantized file")
        if isinstance(m, Mxfp4Experts):
            raise LogprobeError("model", f"model.{name} is held MXFP4-packed (an MXFP4 checkpoint loaded packed): "
                                "float weights from a trainer cannot be written into its blocks without "
                                "requantizing them, which would score other weights than the trainer's",
                                "load the checkpoint with load_model(path, weights='dense') and give that to "
                                "Scorer (the experts expanded to the model dtype: every MXFP4 value is exact "
                                "there, the scores unchanged), or load the bf16 checkpoint (the way under tensor "
                                "parallelism and for the server); updates then take the trainer's float weights "
                                "exactly")
    return _slots(model, list(full_slots(model, names=True)))


def whole_slots(model) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """What a sender's tensors must be, the whole model's slots (a shard's, or the driver's meta
    model's, are parts or none), and the weights held as FP8 blocks (native name -> block: read
    off the layers, or off the checkpoint for a parallel scorer's driver: ``fp8_held``). FP8
    weights are their two checkpoint halves there (``update_fp8.whole_fp8_slots``)."""
    held = getattr(model, "fp8_held", None)
    if callable(held):  # the driver's: read off the checkpoint once (``loader.describe_model``)
        model.fp8_held = held = held()
    if not held and not holds_fp8(model):  # a float model: its own slots (one rank), else the whole model's
        return (weight_slots(model) if model.ctx.size == 1 else full_slots(model)), {}
    named = full_slots(model, names=True)
    held = held or fp8_names(model, list(named))
    plain = {n: t for n, t in full_slots(model).items() if n not in held and n.rpartition(".")[0] not in held}
    return plain | whole_fp8_slots(named, held), held


def full_slots(model, names: bool = False) -> dict[str, torch.Tensor]:
    """The slots of the whole (unsplit) model of ``model``'s family and config, on the meta device:
    the shapes a checkpoint's tensors must have (``names``: its parameter names -> meta tensors)."""
    with torch.device("meta"):
        whole = family(model).build_meta(model.config, None)
    return dict(whole.state_dict()) if names else _slots(whole, list(whole.state_dict()))


def _tensor(model, name: str) -> torch.Tensor:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def _slots(model, names: list[str]) -> dict[str, torch.Tensor]:
    slots, whole = {}, family(model).whole_experts
    for n in names:
        if (fp8 := fp8_slots(model, n)) is not None:  # codes and scales, each a slot
            slots.update(fp8)
        elif _STACKED.fullmatch(n) and not whole:  # [E, out, in]: one unit per expert held, by its id
            p = _tensor(model, n)
            ids = getattr(model.get_submodule(n.rpartition(".")[0]), "expert_ids", range(p.shape[0]))
            slots.update({f"{n}.{e}": p[i] for i, e in enumerate(ids)})
        else:
            slots[n] = _tensor(model, n)
    return slots


def rank_slice(name: str, value: torch.Tensor, model) -> torch.Tensor:
    """``model``'s rank's part of slot ``name``'s whole tensor (the rows its layers hold, as the
    loader reads them: ``loading.sharding``; several row ranges for a segmented layer, e.g. a
    Gated DeltaNet's q/k/v rows and conv channels), as its own contiguous storage; the tensor
    itself with one rank."""
    if model.ctx.size == 1:
        return value
    ranges = held_ranges(model, name)
    if ranges is None:
        return value
    return torch.cat([value[a:b] for a, b in ranges]).clone(memory_format=torch.contiguous_format)


def rank_part(name: str, value: torch.Tensor, model) -> torch.Tensor | None:
    """``rank_slice``, and for an expert's unit (``layers.N.mlp.experts.gate_proj.{e}``) the rows of
    it the rank holds (``Experts.held``: whole experts, or a share of each's rows), None where the
    rank does not hold expert e (another rank's: under a placement of replicas, every rank holding
    it takes it):

        ranks 0, 1 of TP = EP = 2, 4 experts:  gate_proj.3 -> None on rank 0, the whole [I, H] on rank 1
        TP = 2, EP = 1 (each expert split):    gate_proj.3 -> rows [0, I/2) on rank 0, [I/2, I) on rank 1
    """
    if value.dtype == torch.float8_e4m3fn:  # FP8 codes cut as their bytes
        part = rank_part(name, value.view(torch.uint8), model)
        return None if part is None else part.view(torch.float8_e4m3fn)
    name = name.removesuffix(SCALE)  # an FP8 weight's row scales: its rows, as of its codes
    m = _UNIT.fullmatch(name)
    if m is None or model.ctx.size == 1:
        return rank_slice(name, value, model)
    experts = model.get_submodule(m.group(1))
    if int(m.group(3)) not in experts.expert_ids:
        return None
    _, (a, b) = experts.held(m.group(2))
    return value[a:b].clone(memory_format=torch.contiguous_format)


def native_name(hf_name: str, model) -> str | None:
    """A Hugging Face name -> the native parameter name, by the family loader's own mapping
    (``Family.param_name``); None: a tensor the model does
    not hold (rotary ``inv_freq``, a tied model's ``lm_head.weight``, multi-token-prediction
    layers, a vision tower). An unknown name comes back as given and fails the slot lookup.
    transformers' tables computed from the config, which ``named_buffers()`` holds beside the
    buffers that are weights (``rotary_emb.original_inv_freq``, an ``embed_scale``), are
    ignored: the native model computes its own from the same config."""
    if hf_name.endswith(_DERIVED):
        return None
    try:
        return family(model).param_name(hf_name, model.config, "update")
    except LogprobeError as e:
        if e.field != "model":
            raise
        return hf_name


def units(item: Incoming, model, field: str) -> list[tuple[str | None, Incoming]]:
    """An incoming tensor as (slot name, piece) pairs: one pair, except tensors the loader cuts or
    reshapes (fused q/k/v and gate/up: ``Family.fused``; a conv weight, fused mixer projections,
    experts in transformers' layout: ``Family.units``, whole expert stacks where ``whole_experts``)
    and a mixture of experts' tensors, which land one expert at a time:

        layers.N.mlp.experts.{e}.gate_proj.weight [I, H]   -> unit layers.N.mlp.experts.gate_proj.{e}
        layers.N.mlp.experts.gate_proj / up_proj / down_proj [E, out, in]  -> E units
        layers.N.mlp.experts.gate_up_proj [E, 2I, H] (transformers' in-memory name)
                                         -> gate_proj.{e} = [e, :I], up_proj.{e} = [e, I:]
    """
    if item.dtype == torch.float8_e4m3fn or scale_weight_name(item.name) is not None:
        return fp8_units(item, model, field)
    name = native_name(item.name, model)
    cfg, fam = model.config, family(model)
    if name is not None and (parts := fam.fused(name, cfg)) is not None:  # fused q/k/v, gate/up
        if len(item.shape) != 2 or item.shape[0] != parts[-1][2]:
            raise LogprobeError(field, f"{item.name!r} has shape {item.shape}, the model's is "
                                f"{(parts[-1][2], cfg.hidden_size)}")
        return [(part, Incoming(item.name, (b - a, item.shape[1]), item.dtype, lambda a=a, b=b: item.load()[a:b]))
                for part, a, b in parts]
    if (split := fam.units(name, item, model, field)) is not None:  # reshaped as its loader reshapes them
        return split
    moe = getattr(cfg, "moe", None)
    if name is None or moe is None:
        return [(name, item)]
    if m := _EXPERT.fullmatch(name):
        return [(f"{m.group(1)}.{m.group(3)}.{m.group(2)}", item)]
    if len(item.shape) != 3:
        return [(name, item)]
    E, rows, cols = item.shape
    stacked = name.endswith(".experts.gate_up_proj") or _STACKED.fullmatch(name)
    if stacked and E != moe.num_experts:
        raise LogprobeError(field, f"{item.name!r} has shape {item.shape}: {E} experts, the model has "
                            f"{moe.num_experts}")
    if name.endswith(".experts.gate_up_proj") and rows % 2 == 0:
        half, base = rows // 2, name.removesuffix("gate_up_proj")
        return [(f"{base}{proj}.{e}", Incoming(item.name, (half, cols), item.dtype,
                                               lambda e=e, k=k: item.load()[e, k * half:(k + 1) * half]))
                for e in range(E) for k, proj in enumerate(("gate_proj", "up_proj"))]
    if _STACKED.fullmatch(name):
        return [(f"{name}.{e}", Incoming(item.name, (rows, cols), item.dtype, lambda e=e: item.load()[e]))
                for e in range(E)]
    return [(name, item)]


def fp8_units(item: Incoming, model, field: str) -> list[tuple[str | None, Incoming]]:
    """An FP8 block model's halves (``update_fp8``): ``<m>.weight`` codes and ``<m>.weight_scale_inv``
    -> (slot, item), one expert at a time as checkpoints store them; a tensor the float path would
    cut or reshape is refused."""
    weight = scale_weight_name(item.name) or item.name
    name = native_name(weight, model)
    if name is None:
        return [(None, item)]
    if m := _EXPERT.fullmatch(name):
        name = f"{m.group(1)}.{m.group(3)}.{m.group(2)}"
    elif (family(model).fused(name, model.config) is not None
          or family(model).units(name, item, model, field) is not None or len(item.shape) != 2):
        raise LogprobeError(field, f"{item.name!r} {item.shape}: FP8 blocks are taken one matrix at a time, as "
                            "an FP8 block checkpoint stores them (no fused, reshaped or stacked tensors)",
                            "send each module's weight and weight_scale_inv, experts one by one")
    return [(name + SCALE if scale_weight_name(item.name) is not None else name, item)]


def check(name: str | None, item: Incoming, model: nn.Module, slots: dict[str, torch.Tensor],
          seen: dict[str, str], field: str) -> str | None:
    """``name`` (the unit ``item`` goes to) if the item is valid, None if it is ignored; raises
    naming it otherwise. ``seen``: the units checked so far -> the names they came as."""
    if name is None:
        embed = tuple(slots["embed_tokens.weight"].shape)
        if item.name == "lm_head.weight" and item.shape != embed:
            raise LogprobeError(field, f"lm_head.weight has shape {item.shape}, the model's (tied) embedding is "
                                f"{embed}")
        return None
    if name not in slots:
        raise LogprobeError(field, f"{item.name!r} is not a weight of this model",
                            "send the Hugging Face names of the same architecture (model.layers.N...)")
    if name in seen:
        raise LogprobeError(field, f"{item.name!r} is given twice"
                            + (f" ({name} again)" if not name.endswith(item.name.removeprefix("model.")) else ""))
    if is_fp8_slot(slots[name], name):
        check_fp8_item(name, item, field)
    elif item.dtype == torch.float8_e4m3fn:
        raise LogprobeError(field, held_float_message(item, name), "send the float weight")
    elif item.dtype not in _FLOATS:
        raise LogprobeError(field, f"{item.name!r} is {str(item.dtype).removeprefix('torch.')}: weight updates "
                            "take float tensors (float32, bfloat16, float16)",
                            "quantized tensors cannot be written into this model exactly")
    want = tuple(slots[name].shape)
    if item.shape != want:
        part = "" if name.endswith(item.name.removeprefix("model.")) else f" for {name}"
        raise LogprobeError(field, f"{item.name!r} has shape {item.shape}{part}, the model's is {want}")
    seen[name] = item.name
    return name


def check_finite(name: str, value: torch.Tensor, slot: torch.Tensor, field: str) -> None:
    """Refuse ``value`` (incoming tensor ``name``) if it holds a NaN or an infinity, or a value that
    becomes one in the model's dtype (float32 -> float16 beyond 65504): such weights turn every
    score into NaN."""
    bad = int(fp8_nans(value).sum() if value.dtype == torch.float8_e4m3fn else (~torch.isfinite(value)).sum())
    if bad:
        raise LogprobeError(field, f"{name!r} holds {bad} non-finite value{'s' * (bad != 1)} (NaN or inf)",
                            "send finite weights (a diverged trainer step would make every score NaN)")
    if value.numel() and slot.dtype != value.dtype and not torch.isfinite(value.abs().amax().to(slot.dtype)):
        raise LogprobeError(field, f"{name!r} holds values beyond the range of the model's "
                            f"{str(slot.dtype).removeprefix('torch.')} (largest {value.abs().amax().item():.4g})",
                            "send weights that fit the model's dtype")


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` lies in ``b``'s storage (a converted or cut part that is still the incoming
    tensor: a stream may write its next tensor there)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def fp8_nans(codes: torch.Tensor) -> torch.Tensor:
    """Which float8 e4m3fn codes are NaN, read from their bytes: e4m3fn has no infinities and one
    NaN pattern, every exponent and mantissa bit set (0x7F, 0xFF with the sign). Converting 1 GB
    of codes to float32 to ask ``isfinite`` took seconds on a server's CPU.

    >>> fp8_nans(torch.tensor([0x7F, 0xFF, 0x7E, 0x00, 0x80], dtype=torch.uint8).view(torch.float8_e4m3fn)).tolist()
    [True, True, False, False, False]
    """
    return (codes.view(torch.uint8) & 0x7F) == 0x7F


def check_complete(model, slots: dict[str, torch.Tensor], seen: Mapping[str, str] | set[str],
                   field: str) -> list[str]:
    """Refuse an update that leaves a weight of ``slots`` out of ``seen``, naming the tensors as the
    trainer sends them (``sent_names``). Weights transformers holds as buffers (``Family.buffers``:
    the routers' ``gate.e_score_correction_bias``, a per-layer ``layer_scalar``) are not in a trainer's
    ``named_parameters()``: all of them left out, they keep their values and come back (the slot
    names), for the caller to say so; some sent and some not would mix two policies, and is refused.

        sigmoid router, named_parameters() sent -> ["layers.1.mlp.e_score_correction_bias", ...] kept
        named_parameters() + named_buffers()  -> []
        layer 1's experts.gate_up_proj left out -> "1 weight missing: model.layers.1.mlp.experts.gate_up_proj"

    A vision tower's weights (``Family.towers``) are taken where sent and keep their values where
    not, one by one: a trainer that freezes the tower sends the text model alone, and scores then
    run the loaded tower (they are not counted in the return value, which is about buffers).
    """
    buffers = buffer_slots(model, slots)
    kept = [n for n in buffers if n not in seen]
    kept = kept if len(kept) == len(buffers) else []
    towers = set(tower_slots(model, slots))
    missing = sent_names(model, [n for n in slots if n not in seen and n not in kept and n not in towers], seen)
    if missing:
        raise LogprobeError(field, f"{len(missing)} weight{'s' * (len(missing) != 1)} missing: "
                            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}",
                            "send every weight of the model (a partial update would mix two policies)")
    return kept


def tower_slots(model, slots) -> list[str]:
    """The names of ``slots`` of the model's vision tower (``Family.towers``, e.g. ``visual.*``)."""
    prefixes = family(model).towers
    return [n for n in slots if prefixes and n.startswith(prefixes)]


def buffer_slots(model, slots) -> list[str]:
    """The names of ``slots`` that transformers holds as buffers (``Family.buffers``), in order."""
    ends = family(model).buffers
    return [n for n in slots if ends and n.endswith(ends)]


def sent_names(model, missing: list[str], seen: Mapping[str, str] | set[str] = ()) -> list[str]:
    """Slot names -> the names a trainer sends for them: transformers' spelling (the prefix the
    sender used, ``model.`` or a multimodal model's ``model.language_model.``, read off ``seen``'s
    names; the family's renames undone, when its own mapping takes the name back:
    ``mlp.shared_experts``, ``mlp.gate.e_score_correction_bias``); an expert stack left out whole as
    the stacked tensors transformers holds, single experts by their checkpoint names:

        layers.1.mlp.experts.{gate,up}_proj.{0..E-1} -> model.layers.1.mlp.experts.gate_up_proj
        layers.1.mlp.experts.down_proj.3 alone        -> model.layers.1.mlp.experts.3.down_proj.weight

    A model held FP8 names experts one by one (its checkpoints' layout), scales as theirs:
    ``layers.1.mlp.experts.gate_proj.3:scale_inv`` -> ``model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv``.
    """
    units: dict[tuple[str, str], list[str]] = {}
    for n in missing:
        if m := _UNIT.fullmatch(n):
            units.setdefault((m.group(1), m.group(2)), []).append(m.group(3))
    experts = getattr(getattr(model.config, "moe", None), "num_experts", 0)
    whole = set() if holds_fp8(model) else {key for key, ids in units.items() if len(ids) == experts}
    prefix = _sender_prefix(seen)
    out: list[str] = []
    for n in missing:
        if n.endswith(SCALE):
            out.append(spell_scale(sent_names(model, [n.removesuffix(SCALE)], seen)[0]))
            continue
        m = _UNIT.fullmatch(n)
        if m is None:
            out.append(_hf_spelling(model, n, prefix))
            continue
        base, proj, e = m.groups()
        if proj in ("gate_proj", "up_proj") and {(base, "gate_proj"), (base, "up_proj")} <= whole:
            name = f"{prefix}{base}.gate_up_proj"
        else:
            name = f"{prefix}{base}.{proj}" if (base, proj) in whole else f"{prefix}{base}.{e}.{proj}.weight"
        if name not in out:
            out.append(name)
    return out


def _sender_prefix(seen: Mapping[str, str] | set[str]) -> str:
    """What the sender put before a text block's name (``model.``, ``model.language_model.``; a
    vision tower's ``model.vision_tower.`` is another prefix's, not this one)."""
    for slot, sent in (seen.items() if isinstance(seen, Mapping) else ()):
        if slot.startswith("layers.") and sent.endswith(f".{slot}") and sent.startswith("model."):
            return sent[:-len(slot)]
    return "model."


def _hf_spelling(model, name: str, prefix: str) -> str:
    if name == "lm_head.weight":
        return name
    plain = prefix + name
    for native, hf in _RENAMES:
        if native in plain and native_name(hf_name := plain.replace(native, hf), model) == name:
            return hf_name
    return plain


def note_kept(model, kept: list[str], seen: Mapping[str, str]) -> tuple[str, ...]:
    """Say which weights an update left as they were (``check_complete``): a warning the first time
    for ``model``, at info level after (each step of an RL loop sends the same names). Returns
    their names as a trainer sends them."""
    if not kept:
        return ()
    names = sent_names(model, kept, seen)
    level = logging.INFO if getattr(model, "_kept_noted", False) else logging.WARNING
    log.log(level, "weight update: kept %d weight%s not sent (transformers holds them as buffers, so "
            "named_parameters() lacks them): %s%s; send them too (named_buffers()) when the trainer changes them",
            len(names), "s" * (len(names) != 1), ", ".join(names[:4]), " ..." if len(names) > 4 else "")
    model._kept_noted = True
    return tuple(names)


def convert(name: str, value: torch.Tensor, slot: torch.Tensor, model) -> torch.Tensor:
    """What the loader makes of checkpoint tensor ``name``: the model's dtype (a float32 router
    stays float32) and device, q/k rows (and q/k norms) interleaved for RoPE as the family does."""
    if is_fp8_slot(slot, name):
        return fp8_value(name, value, slot, lambda state: family(model).interleave(model.config, state))
    value = value.detach().to(device=slot.device, dtype=slot.dtype)
    return family(model).interleave(model.config, {name: value})[name]


def incoming_tensors(named_tensors: Iterable, field: str):
    """(name, tensor) pairs -> ``Incoming``, checking each pair's form as it comes."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    for i, pair in enumerate(items):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise LogprobeError(f"{field}[{i}]", "must be a (name, tensor) pair")
        name, t = pair
        if not isinstance(name, str):
            raise LogprobeError(f"{field}[{i}]", f"name must be a string, got {type(name).__name__}")
        if not isinstance(t, torch.Tensor):
            raise LogprobeError(field, f"{name!r} must be a torch tensor, got {type(t).__name__}")
        yield Incoming(name, tuple(t.shape), t.dtype, lambda t=t: t)


@torch.no_grad()
def update_in_place(model: nn.Module, items: Iterable[Incoming], field: str, how: str, whole: bool = True,
                    on_write=None) -> Applied:
    """Write ``items`` into ``model``, ``how``:

    * "checked" (a list or dict, every tensor in memory): check all, then copy each in;
    * "staged" (a stream): convert each as it comes, copy them in once the stream ends (one more
      copy of the weights at most);
    * "streamed" (a stream, ``in_place``): check each, then copy it in at once (no second copy:
      a tensor the stream fails on leaves the weights before it written).

    ``whole``: the items must cover the model (checked before any copy, but for "streamed": at the
    stream's end); False: a part of an update (a trainer's bucket). ``on_write()`` is called before
    the first copy. Items are whole tensors; a tensor-parallel shard (under torchrun) takes its
    slice of each."""
    slots = weight_slots(model)
    full, held = whole_slots(model)
    seen: dict[str, str] = {}
    # a shard's FP8 layers do not state their rows: its meta model's layers do
    rank = model if model.ctx.size == 1 or not held else family(model).build_meta(model.config, model.ctx)
    pending = on_write  # called before the first copy, once

    def part_of(name: str, value: torch.Tensor) -> torch.Tensor | None:
        return rank_part(name, whole_rows(name, value, held, full) if held else value, rank)

    def ready(name: str, piece: Incoming, kept: bool = False) -> torch.Tensor | None:
        """The tensor's converted part; ``kept`` (staged until the stream ends): in memory of its
        own, since a stream may hand the next tensor in the same memory."""
        value = piece.load()
        check_finite(piece.name, value, slots.get(name, full[name]), field)
        part = part_of(name, value)
        if part is None:
            return None
        part = convert(name, part, slots[name], model)
        return part.clone() if kept and same_memory(part, value) else part

    def write(name: str, value: torch.Tensor) -> None:
        nonlocal pending
        if pending is not None:
            pending, call = None, pending
            call()
        slots[name].copy_(value)

    def complete() -> tuple[str, ...]:
        return note_kept(model, check_complete(model, full, seen, field), seen) if whole else ()

    checked = ((name, piece) for item in items for unit, piece in units(item, model, field)
               if (name := check(unit, piece, model, full, seen, field)) is not None)
    if how == "streamed":
        n = 0
        for name, piece in checked:
            if (value := ready(name, piece)) is not None:  # None: another rank's expert
                write(name, value)
            n += 1
        return Applied(n, complete())
    if how == "staged":
        values = {name: v for name, piece in checked if (v := ready(name, piece, kept=True)) is not None}
        kept = complete()
        for name, value in values.items():
            write(name, value)
        return Applied(len(values), kept)
    todo = list(checked)
    kept = complete()
    for name, piece in todo:  # values too before any copy (a checkpoint's tensors are read twice)
        check_finite(piece.name, piece.load(), slots.get(name, full[name]), field)
    for name, piece in todo:
        if (part := part_of(name, piece.load())) is not None:
            write(name, convert(name, part, slots[name], model))
    return Applied(len(todo), kept)


STREAM_COMMIT_BYTES = 1 << 30  # a streamed update to workers: each rank copies in its parts this often
STAGE_MESSAGE_BYTES = 64 << 20  # a rank's slices travel in messages of about this much


class RankParts:
    """The slices ``update_workers`` has cut for each rank, sent to the workers (``stage_weights``)
    a message of about ``STAGE_MESSAGE_BYTES`` at a time rather than one message a tensor. A slice
    that is the incoming tensor itself (not cut: a replicated weight) is sent at once, as the
    tensor stood: a stream may hand the next tensor in the same memory. FP8 codes travel as their
    bytes (torch's pickling has no float8 storage). ``sent``: bytes added since the last commit
    (``update_workers`` resets it)."""

    def __init__(self, engine) -> None:
        self.engine, self.sent = engine, 0
        self.cuda = False  # a slice on a GPU was sent (by CUDA IPC)
        self.parts: dict[int, list] = {}
        self.bytes: dict[int, int] = {}

    def add(self, rank: int, name: str, part: torch.Tensor, owned: bool = True) -> None:
        """``owned``: ``part`` has memory of its own (a cut's copy), so it may wait for the message."""
        fp8 = part.dtype == torch.float8_e4m3fn
        self.cuda = self.cuda or part.is_cuda
        self.parts.setdefault(rank, []).append((name, part.view(torch.uint8) if fp8 else part))
        size = part.numel() * part.element_size()
        self.bytes[rank] = self.bytes.get(rank, 0) + size
        self.sent += size
        if self.bytes[rank] >= STAGE_MESSAGE_BYTES or not owned:
            self.flush(rank)

    def flush(self, rank: int | None = None) -> None:
        """Send the slices held for ``rank`` (None: every rank's)."""
        for r in [rank] if rank is not None else sorted(self.parts):
            if self.parts.get(r):
                self.engine.stage_weights(r, self.parts.pop(r))
            self.bytes[r] = 0


def update_workers(model: nn.Module, items: Iterable[Incoming], engine, field: str, how: str = "staged",
                   whole: bool = True, on_write=None) -> Applied:
    """A parallel scorer's update: ``model`` is the driver's weightless (meta) model; each checked
    tensor is cut into its ranks' slices and sent to every replica's workers, which stage them
    (``StagedWeights``); once the stream is complete every worker confirms, then all copy in. Any
    error before that drops every staged slice (all or nothing across ranks). ``how`` "streamed"
    (and a part, ``whole`` False): the workers copy in what they staged every
    ``STREAM_COMMIT_BYTES`` sent and at the end, without waiting for the whole model (the driver
    checks that the stream covered it); ``on_write()`` before the first such copy.

    A tensor on a GPU (a weight group's receive buffer) is checked and cut there, and its slices
    reach the workers by CUDA IPC (``ParallelEngine.stage_weights``), never through this process's
    memory: on two H200s a 17 GB FP8 update of a latent-attention MoE had moved at 0.2 GB/s through it."""
    weight_slots(model)  # the model's refusals
    full, held = whole_slots(model)
    ranks = rank_models(model, engine)
    on_gpu = getattr(engine, "device_type", "cpu") == "cuda"
    parts, seen, n = RankParts(engine), {}, 0
    stream = how == "streamed" or not whole  # every commit a part: no worker checks the whole

    def commit() -> None:
        parts.flush()
        if on_write is not None and parts.sent:
            on_write()
        engine.end_weights(commit=True, whole=not stream)
        parts.sent = 0

    try:
        for item in items:
            for unit, piece in units(item, model, field):
                if (name := check(unit, piece, model, full, seen, field)) is None:
                    continue
                value = piece.load().detach()
                value = value if on_gpu and value.is_cuda else value.cpu()
                check_finite(piece.name, value, full[name], field)
                value = whole_rows(name, value, held, full) if held else value
                for rank in ranks:  # each rank its part; an expert to the ranks that hold it
                    if (part := rank_part(name, value, rank)) is not None:
                        parts.add(rank.ctx.rank, name, part, owned=not same_memory(part, value))
                n += 1
                if how == "streamed" and parts.sent >= STREAM_COMMIT_BYTES:
                    commit()
        kept = check_complete(model, full, seen, field) if whole and how != "streamed" else []
    except BaseException:
        engine.end_weights(commit=False)
        raise
    parts.sent = max(parts.sent, 1)  # the last commit: an on_write even for a stream of kept tensors only
    commit()
    if parts.cuda:  # every worker has copied its slices (they answered the commit): their GPU memory back
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    if whole and how == "streamed":
        kept = check_complete(model, full, seen, field)
    return Applied(n, note_kept(model, kept, seen) if whole else ())


def rank_models(model: nn.Module, engine) -> list[nn.Module]:
    """The weightless (meta) model of each rank of ``engine``'s replicas: what each holds, so that
    ``rank_part`` cuts its slice of a whole tensor."""
    cfg, build, ranks = model.config, family(model).build_meta, []
    for r in range(engine.tp):
        with torch.device("meta"):
            ctx = parallel_context(cfg, r, engine.tp, experts=getattr(engine, "ep", 1),
                                   attention=getattr(engine, "attention", None))
            ranks.append(build(cfg, replace(ctx, placement=getattr(engine, "placement", None))))
    return ranks


class StagedWeights:
    """A worker's side of ``update_workers``: slices converted and staged as they come (an error is
    kept for ``prepare``), copied into the shard at ``commit``."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.slots = model, {}
        self.values: dict[str, torch.Tensor] = {}
        self.error: BaseException | None = None
        try:  # staging answers nothing: a refusal waits for ``prepare``
            self.slots = weight_slots(model)
        except LogprobeError as e:
            self.error = e

    def add(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Stage ``pairs``. A slice that came by CUDA IPC (``update_workers``) lies in memory the
        driver copied it to for this rank alone (``ParallelEngine.stage_weights``); its allocator
        keeps it until this process lets go, so it is staged as it is, not copied again. What reads
        it here has finished before a reference to it is dropped (``settle``): the driver may reuse
        the memory as soon as the last one is."""
        try:
            for name, value in pairs:
                slot = self.slots.get(name)
                if slot is not None and slot.dtype == torch.float8_e4m3fn and value.dtype == torch.uint8:
                    value = value.view(torch.float8_e4m3fn)  # sent as bytes (``update_workers``)
                if slot is None:
                    raise LogprobeError("named_tensors", f"{name}: rank {self.model.ctx.rank} holds no such weight")
                if tuple(value.shape) != tuple(slot.shape):
                    raise LogprobeError("named_tensors", f"{name}: a slice of shape {tuple(value.shape)} reached "
                                        f"rank {self.model.ctx.rank}, which holds {tuple(slot.shape)}")
                self.values[name] = convert(name, value, slot, self.model)
        except BaseException as e:  # noqa: BLE001 - reported at prepare
            self.error = self.error or e
        self.settle(value for _, value in pairs)

    @staticmethod
    def settle(tensors) -> None:
        """Wait for this process's GPU work where any of ``tensors`` lies on a GPU: dropping a
        tensor received by CUDA IPC hands its memory back to the sender at once, whatever is still
        queued to read it."""
        if any(t.is_cuda for t in tensors):
            torch.cuda.current_stream().synchronize()

    def prepare(self, whole: bool = True) -> None:
        """Every staged slice arrived and converted; ``whole``: and they cover this shard."""
        if self.error is not None:
            raise self.error
        if whole:
            check_complete(self.model, self.slots, set(self.values), "named_tensors")

    @torch.no_grad()
    def commit(self) -> None:
        for name, value in self.values.items():
            self.slots[name].copy_(value)
        self.settle(self.values.values())
        self.values = {}


class InPlaceWrites:
    """Scoring refused while an in-place update writes a model's weights, and after one that
    failed part way (its weights then part old, part new), until an update completes: the
    executor's ``weights_refusal`` (``WeightsUnavailable``), raised by its ``run``.

        bucket 1 written  -> refused ("being replaced")      bucket 2 holds a NaN -> not written,
        refused ("failed part way")     a later complete update -> scored again
    """

    def __init__(self, executor) -> None:
        self.executor = executor
        self.written = False  # the update under way has written some weight

    def run(self, apply, complete: bool) -> Applied:
        """``apply(on_write)`` (an ``update_weights`` with ``on_write``); ``complete``: it ends the
        update (the last bucket, or a whole stream), so scoring resumes once it succeeds."""
        def on_write() -> None:
            self.written = True
            self.executor.weights_refusal = WeightsUnavailable(
                "weight_version", "the weights are being replaced in place (an update under way)",
                "retry once the update completes")
        try:
            applied = apply(on_write)
        except BaseException as e:
            if self.written:
                why = e.problem if isinstance(e, LogprobeError) else f"{type(e).__name__}: {e}"
                self.executor.weights_refusal = WeightsUnavailable(
                    "weight_version", f"an in-place weight update failed part way ({why}): the weights are "
                    "part old, part new", "send a complete update (every weight) to score again")
            raise
        if complete:
            self.done()
        return applied

    def done(self) -> None:
        """Every weight written: scoring resumes."""
        self.written = False
        self.executor.weights_refusal = None


def update_weights(model: nn.Module, named_tensors, field: str = "named_tensors", engine=None, *,
                   in_place: bool = False, whole: bool = True, on_write=None) -> Applied:
    """(Hugging Face name, tensor) pairs -> the model's weights; see the module docstring.
    ``engine``: a parallel scorer's ``ParallelEngine`` (``model`` is then the driver's meta model).
    ``in_place``: a stream is written as it comes, never staged (``update_in_place`` "streamed");
    ``whole`` False: the pairs are a part of an update (a bucket), not checked to cover the model;
    ``on_write()``: called before the first weight changes."""
    if isinstance(named_tensors, (str, bytes, torch.Tensor)) or not isinstance(named_tensors, Iterable):
        raise LogprobeError(field, "must be (name, tensor) pairs: a dict, a list or an iterator")
    family(model)
    items = incoming_tensors(named_tensors, field)
    in_memory = isinstance(named_tensors, (Mapping, list, tuple))
    how = "checked" if in_memory else "streamed" if in_place else "staged"
    if engine is not None:
        return update_workers(model, items, engine, field, how, whole, on_write)
    return update_in_place(model, items, field, how, whole, on_write)


def safetensors_items(path: str | Path, field: str = "path", blocks: set | frozenset = frozenset()) -> list[Incoming]:
    """The tensors of a safetensors file, or of a directory of them (Hugging Face layout, sharded or
    not), as ``Incoming`` read from the headers (data read by ``load()``). A directory whose
    config.json declares a quantization is refused, but an FP8 block one whose
    ``weight_block_size`` is the model's (``blocks``: the (rows, cols) blocks a model held FP8 has)."""
    from safetensors import safe_open


    p = Path(path).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if cfg.exists():
            q = json.loads(cfg.read_text()).get("quantization_config")
            if q is not None and not _same_fp8_blocks(q, blocks, field):
                raise LogprobeError(field, f"{p} is a quantized checkpoint (quant_method "
                                    f"{q.get('quant_method') if isinstance(q, dict) else q!r}): its packed tensors "
                                    "cannot be written into float weights exactly",
                                    "load the new weights as float safetensors, or reload the scorer from it")
        files = safetensors_files(p)
    elif p.is_file() and p.suffix == ".safetensors":
        files = [p]
    else:
        raise LogprobeError(field, f"{str(path)!r} is neither a .safetensors file nor a directory",
                            "give a Hugging Face checkpoint directory or a .safetensors file")
    items = []
    for f in files:
        try:
            st = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors' own error type (a truncated or foreign file)
            raise LogprobeError(field, f"{f} is not a readable safetensors file ({e})") from e
        with st:
            for key in st.keys():
                sl = st.get_slice(key)
                code = sl.get_dtype()
                items.append(Incoming(key, tuple(sl.get_shape()), _SAFETENSORS_FLOATS.get(code, code),
                                      lambda f=f, key=key: _read(f, key)))
    return items


def _same_fp8_blocks(q, blocks, field: str) -> bool:
    """Whether quantization config ``q`` is FP8 blocks of the model's size (refused if of another)."""
    if not blocks or not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return False
    size = tuple(q.get("weight_block_size") or ())
    if {size} != set(blocks):
        raise LogprobeError(field, f"weight_block_size {list(size)}: the model holds FP8 blocks of "
                            f"{' and '.join(str(list(b)) for b in sorted(blocks))}",
                            "send weights quantized in the model's blocks")
    return True


def _read(f: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as st:
        return st.get_tensor(key)


def load_weights(model: nn.Module, path: str | Path, field: str = "path", engine=None, *, in_place: bool = False,
                 on_write=None) -> Applied:
    """A safetensors checkpoint -> the model's weights, every header checked before one tensor is
    read (``engine``: as ``update_weights``; the driver reads the tensors and sends the slices).
    ``in_place``: the workers copy in their slices as they come (``update_workers`` "streamed": no
    staged copy of the shard; a tensor found non-finite then leaves the weights part written). In
    one process every value is checked before any copy either way (the tensors are read twice, no
    copy held), so ``in_place`` changes nothing there."""
    family(model)
    full, held = whole_slots(model)
    items = safetensors_items(path, field, set(held.values()))
    if engine is not None:
        weight_slots(model)
        seen = {}
        for item in items:  # headers first, as in place
            for unit, piece in units(item, model, field):
                check(unit, piece, model, full, seen, field)
        check_complete(model, full, seen, field)
        return update_workers(model, items, engine, field, "streamed" if in_place else "staged", on_write=on_write)
    return update_in_place(model, items, field, "checked")
