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

Refused, naming the tensor: a float tensor for a module held FP8 (writing it would quantize the
trainer's weights here: the scores would be of other weights than it sent), FP8 codes for a module
held float, FP8 tensors the float path would cut or reshape (fused q/k/v or gate/up, a family's
reshaped units, experts stacked [E, out, in]). Refused for the model: FP8 layers with quantized
activations (``ActQuantLinear``), layers whose block height is unknown (cut at load: the hybrid
families' mixer projections), and FP8 models split over ranks (not built).
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


def check_fp8_model(model: nn.Module, ranks: int) -> None:
    """Refuse an FP8 block model whose layers an update cannot write exactly (module docstring)."""
    for name, m in model.named_modules():
        if isinstance(m, ActQuantLinear):
            raise LogprobeError("model", f"{name} quantizes its activations (quantize_activations=True): its "
                                "weights take no update yet", "load the scorer with quantize_activations off")
        if type(m) in FP8_LAYERS and ranks > 1:
            raise LogprobeError("model", f"an FP8 block model split over {ranks} ranks ({name}) takes no weight "
                                "update yet", "reload the scorer from the new checkpoint, or score on one GPU")
        if type(m) in FP8_LAYERS and m.block_height is None:
            raise LogprobeError("model", f"{name} holds FP8 blocks cut at load, whose block height is not kept: "
                                "its scales cannot be placed", "reload the scorer from the new checkpoint")


def fp8_slots(model: nn.Module, name: str) -> dict[str, torch.Tensor] | None:
    """The slots of native parameter ``name`` where ``model`` holds it FP8, else None: the codes
    (the live ``qweight``, or an expert's row of it) and the scales (a meta tensor of the
    checkpoint's block shape: what ``weight_scale_inv`` must be)."""
    parent, _, leaf = name.rpartition(".")
    owner = _submodule(model, parent)
    if type(owner) is FP8BlockLinear and leaf == "weight":
        return {name: owner.qweight, name + SCALE: _scale_shape(owner)}
    stack = getattr(owner, leaf, None) if owner is not None else None
    if type(stack) is FP8BlockExperts:
        scale = _scale_shape(stack)
        out = {}
        for e in range(stack.num_experts):
            out |= {f"{name}.{e}": stack.qweight[e], f"{name}.{e}{SCALE}": scale}
        return out
    return None


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return None


def _scale_shape(layer) -> torch.Tensor:
    blocks = -(-layer.out_features // layer.block_height)
    groups = -(-layer.in_features // layer.block_cols)
    return torch.empty(blocks, groups, device="meta")  # float32: what the loader turns scales into


def is_fp8_slot(slot: torch.Tensor, name: str) -> bool:
    return slot.dtype == FP8 or name.endswith(SCALE)


def check_fp8_item(name: str, item, slot: torch.Tensor, field: str) -> None:
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


def fp8_target(model: nn.Module, name: str):
    """(layer, expert index or None, the scale half?) of an FP8 slot name, else None."""
    base = name.removesuffix(SCALE)
    parent, _, leaf = base.rpartition(".")
    owner = _submodule(model, parent)
    if type(owner) is FP8BlockLinear and leaf == "weight":
        return owner, None, name.endswith(SCALE)
    if type(owner) is FP8BlockExperts and leaf.isdigit():
        return owner, int(leaf), name.endswith(SCALE)
    return None


def fp8_value(model: nn.Module, name: str, value: torch.Tensor, interleave) -> torch.Tensor:
    """Incoming half ``value`` of FP8 slot ``name`` -> what its layer holds: the codes, or one row
    of scales per weight row (float32), on the layer's device, rows permuted as the loader's
    ``install_packed`` permutes a float weight's (``interleave``: the family's q/k rows)."""
    layer, expert, scale = fp8_target(model, name)
    value = value.detach().to(layer.qweight.device)
    rows = block_rows(value, layer.block_height, layer.out_features) if scale else value
    if expert is not None:
        return rows
    base = name.removesuffix(SCALE)
    order = torch.arange(layer.out_features)[:, None]
    perm = interleave({base: order})[base][:, 0]
    if torch.equal(perm, order[:, 0]):
        return rows
    perm = perm.to(rows.device)
    return rows.view(torch.uint8)[perm].view(FP8) if rows.dtype == FP8 else rows[perm]


@torch.no_grad()
def write_fp8(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """``fp8_value``'s result into its layer's ``qweight`` or ``scale`` (an expert's row)."""
    layer, expert, scale = fp8_target(model, name)
    dst = layer.scale if scale else layer.qweight
    (dst if expert is None else dst[expert]).copy_(value)


def scale_weight_name(item_name: str) -> str | None:
    """``<m>.weight_scale_inv`` -> ``<m>.weight``, else None."""
    return item_name.removesuffix("_scale_inv") if item_name.endswith(".weight_scale_inv") else None


def spell_scale(sent_weight: str) -> str:
    """A missing scale slot's weight as a trainer names it -> the scale's name."""
    return sent_weight.removesuffix(".weight") + ".weight_scale_inv"
