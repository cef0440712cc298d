"""FP8 block weights in a weight update (``loading.update``): a model loaded from an FP8 block
checkpoint (``loading.fp8_block``) takes new weights as such a checkpoint stores them, and as an RL
trainer that quantizes its policy for an FP8 rollout sends them: each quantized Linear ``<m>`` as
``<m>.weight`` float8_e4m3fn [out, in] beside ``<m>.weight_scale_inv`` [ceil(out/bh), ceil(in/bw)]
(float32, bf16 or float16, as the loader reads them); every other tensor (embeddings, norms, routers,
the modules the checkpoint keeps float) is a float tensor as always.

Each half of a pair is a slot of its own, the scale's named with ``SCALE`` after the weight's, so the
update's checks (known name, not twice, shape, finite, none missing) hold for both:

    model.layers.1.self_attn.q_proj.weight                 e4m3 [out, in] -> layers.1.self_attn.q_proj.weight
    model.layers.1.self_attn.q_proj.weight_scale_inv       [R, G]         -> layers.1.self_attn.q_proj.weight:scale_inv
    model.layers.1.mlp.experts.3.gate_proj.weight          e4m3 [I, H]    -> layers.1.mlp.experts.gate_proj.3
    model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv               -> layers.1.mlp.experts.gate_proj.3:scale_inv

and each lands where a fresh load of the same tensors puts it, bitwise: the codes as they are, the
scales one row per weight row (``block_rows`` by the checkpoint's block height, which the layer
keeps), both permuted as the loader permutes a q/k layer's rows for RoPE (``install_packed``);
an expert's into its row of the stack (``FP8BlockExperts``).

Three stages, as for float weights (``loading.update``): a sent half is checked against the whole
model's slot (``whole_fp8_slots``: codes [out, in], scale [ceil(out/bh), G]); a scale then becomes one
row of scales per weight row, [out, G] (``whole_rows``), so that a rank's part of either half is its
rows (``update.rank_part``, under tensor and expert parallelism: the rows the loader reads for it,
which may start inside a block); the holder permutes its rows as it permutes a float weight's and
copies them into its live ``qweight`` / ``scale`` (``weight_slots``: those buffers, or views of an
expert's row of them, written as any slot is).

Refused, naming the tensor: a float tensor for a module held FP8 (writing it would quantize the
trainer's weights here: the scores would be of other weights than it sent), FP8 codes for a module
held float, FP8 tensors the float path would cut or reshape (fused q/k/v or gate/up, a family's
reshaped units, experts stacked [E, out, in]). Refused for the model: FP8 layers with quantized
activations (``ActQuantLinear``) and layers whose block height is unknown (cut at load: the hybrid
families' mixer projections).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import LogprobeError
from ..layers.act_quant_linear import ActQuantLinear
from ..layers.fp8_block_linear import FP8, FP8BlockExperts, FP8BlockLinear, block_rows

SCALE = ":scale_inv"  # a scale slot's name: its weight's, then this
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_LAYERS = (FP8BlockLinear, FP8BlockExperts)


def holds_fp8(model: nn.Module) -> bool:
    """Whether ``model`` holds FP8 block layers (loaded from an FP8 block checkpoint)."""
    return any(type(m) in FP8_LAYERS for m in model.modules())


def check_fp8_model(model: nn.Module) -> None:
    """Refuse an FP8 block model whose layers an update cannot write exactly (module docstring)."""
    for name, m in model.named_modules():
        if isinstance(m, ActQuantLinear):
            raise LogprobeError("model", f"{name} quantizes its activations (quantize_activations=True): its "
                                "weights take no update yet", "load the scorer with quantize_activations off")
        if type(m) in FP8_LAYERS and m.block_height is None:
            raise LogprobeError("model", f"{name} holds FP8 blocks cut at load, whose block height is not kept: "
                                "its scales cannot be placed", "reload the scorer from the new checkpoint")


def fp8_slots(model: nn.Module, name: str) -> dict[str, torch.Tensor] | None:
    """The live slots of native parameter ``name`` where ``model`` holds it FP8, else None: the
    codes (``qweight``) and the row scales (``scale``, one row per weight row held), or each held
    expert's row of them, by the expert's id (``expert_ids``: a rank's own, then its replicas)."""
    parent, _, leaf = name.rpartition(".")
    owner = _submodule(model, parent)
    if type(owner) is FP8BlockLinear and leaf == "weight":
        return {name: owner.qweight, name + SCALE: owner.scale}
    stack = getattr(owner, leaf, None) if owner is not None else None
    if type(stack) is FP8BlockExperts:
        ids = getattr(owner, "expert_ids", range(stack.num_experts))
        out = {}
        for i, e in enumerate(ids):
            out |= {f"{name}.{e}": stack.qweight[i], f"{name}.{e}{SCALE}": stack.scale[i]}
        return out
    return None


def fp8_names(model: nn.Module, names) -> dict[str, tuple[int, int]]:
    """Of the native parameter ``names``, those ``model`` holds FP8 -> their block (rows, cols): a
    dense weight ``X.weight``, or an expert stack ``layers.N.mlp.experts.gate_proj``."""
    out = {}
    for n in names:
        parent, _, leaf = n.rpartition(".")
        owner = _submodule(model, parent)
        layer = owner if type(owner) is FP8BlockLinear and leaf == "weight" else getattr(owner, leaf, None)
        if type(layer) in FP8_LAYERS:
            out[n] = (layer.block_height, layer.block_cols)
    return out


def whole_fp8_slots(named: dict[str, torch.Tensor], held: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """The checkpoint halves of the ``held`` FP8 weights (name -> block) of the whole model
    (``named``: native name -> meta tensor of the float model): codes float8 [out, in], scales
    [ceil(out/bh), ceil(in/bw)]; an expert stack's per expert (``name.{e}``)."""
    out = {}
    for n, (bh, bw) in held.items():
        t = named[n]
        rows, cols = t.shape[-2:]
        codes = torch.empty(rows, cols, dtype=FP8, device="meta")
        scale = torch.empty(-(-rows // bh), -(-cols // bw), device="meta")
        for unit in ([f"{n}.{e}" for e in range(t.shape[0])] if t.ndim == 3 else [n]):
            out |= {unit: codes, unit + SCALE: scale}
    return out


def whole_rows(name: str, value: torch.Tensor, held: dict[str, tuple[int, int]],
               whole: dict[str, torch.Tensor]) -> torch.Tensor:
    """A checked whole half -> rows: a scale [ceil(out/bh), G] becomes one row of scales per weight
    row [out, G] (float32), so a rank's part of it is its rows, as of the codes; codes as they are."""
    if not name.endswith(SCALE):
        return value
    base = name.removesuffix(SCALE)
    stack = base.rpartition(".")[0] if base not in held else base
    rows = whole[base].shape[0]
    return block_rows(value, held[stack][0], rows)


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return None


def is_fp8_slot(slot: torch.Tensor, name: str) -> bool:
    return slot.dtype == FP8 or name.endswith(SCALE)


def check_fp8_item(name: str, item, field: str) -> None:
    """Refuse an item of the wrong kind for an FP8 slot (the shape is checked by the caller)."""
    if name.endswith(SCALE):
        if item.dtype not in SCALE_DTYPES:
            raise LogprobeError(field, f"{item.name!r} is {_dtype(item.dtype)}: a block scale is a float tensor")
        return
    if item.dtype != FP8:
        raise LogprobeError(field, f"{item.name!r} is {_dtype(item.dtype)}, but this model holds {name} as FP8 "
                            "blocks: a float weight would have to be quantized here, which scores other weights "
                            "than the trainer's",
                            "send its float8_e4m3fn codes and its weight_scale_inv, as an FP8 block checkpoint "
                            "stores them (or load the scorer from the float checkpoint)")


def held_float_message(item, name: str) -> str:
    return (f"{item.name!r} is float8_e4m3fn, but this model holds {name} as a float weight (the checkpoint "
            "keeps it float)")


def _dtype(dt) -> str:
    return str(dt).removeprefix("torch.")


def fp8_value(name: str, rows: torch.Tensor, slot: torch.Tensor, interleave) -> torch.Tensor:
    """The held rows of FP8 slot ``name`` (codes, or row scales: ``whole_rows`` then the rank's
    part) -> what its live ``slot`` holds: its device and dtype (codes float8, scales float32),
    rows permuted as the loader's ``install_packed`` permutes a float weight's (``interleave``: the
    family's q/k rows; an expert's unit, ``...gate_proj.3``, is never permuted)."""
    rows = rows.detach().to(slot.device, slot.dtype)
    base = name.removesuffix(SCALE)
    if base.rpartition(".")[2].isdigit():
        return rows
    order = torch.arange(slot.shape[0])[:, None]
    perm = interleave({base: order})[base][:, 0]
    if torch.equal(perm, order[:, 0]):
        return rows
    perm = perm.to(rows.device)
    return rows.view(torch.uint8)[perm].view(FP8) if rows.dtype == FP8 else rows[perm]


def scale_weight_name(item_name: str) -> str | None:
    """``<m>.weight_scale_inv`` -> ``<m>.weight``, else None."""
    return item_name.removesuffix("_scale_inv") if item_name.endswith(".weight_scale_inv") else None


def spell_scale(sent_weight: str) -> str:
    """A missing scale slot's weight as a trainer names it -> the scale's name."""
    return sent_weight.removesuffix(".weight") + ".weight_scale_inv"
