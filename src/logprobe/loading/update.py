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

Mixture-of-experts models take experts one by one (``model.layers.N.mlp.experts.{e}.gate_proj.weight``,
as checkpoints store them, Mixtral's ``block_sparse_moe`` names too) or stacked, as transformers holds
them in memory (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); see ``units``.

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
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LogprobeError
from ..layers.moe import ExpertMatrices
from ..layers.parallel_linear import held_rows
from ..layers.quant_linear import PackedEmbedding, PackedWeight
from ..models.deepseek import DeepseekModel
from ..models.gemma import GemmaModel
from ..models.gemma4 import Gemma4Model
from ..models.glm4 import Glm4Model
from ..models.glm4_moe import PartialRotaryMoeModel
from ..models.gpt_oss import GptOssModel
from ..models.llama import LlamaModel
from ..models.moe import native_model_class
from ..models.qwen3_next import HybridModel
from .checkpoint import _EXPERT, hf_param_name, safetensors_files
from .loader import parallel_context
from .phi3 import fused_parts
from .sharding import rank_model

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_STACKED = re.compile(r"layers\.\d+\.mlp\.experts\.(gate_proj|up_proj|down_proj)")  # [E, out, in] parameters
_SAFETENSORS_FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


@dataclass(frozen=True, slots=True)
class Incoming:
    """One named tensor before its data is read: ``load()`` gives the tensor."""

    name: str  # Hugging Face name
    shape: tuple[int, ...]
    dtype: torch.dtype | str  # a torch dtype, or a safetensors code the check refuses
    load: Callable[[], torch.Tensor]


def weight_slots(model) -> dict[str, torch.Tensor]:
    """Native parameter name -> the live parameter it is copied into (q/k/v and gate/up are views
    of their fused weight, so writing them writes the fused matmul too): exactly the names a
    checkpoint of this model holds. A mixture of experts' stacked ``layers.N.mlp.experts.gate_proj``
    [E, out, in] is E units ``layers.N.mlp.experts.gate_proj.{e}`` (views [out, in]). A
    tensor-parallel shard's parameters are its slices. Refuses models whose weights cannot take
    float tensors."""
    refuse_hybrid(model)
    if not isinstance(model, LlamaModel):
        raise LogprobeError("model", f"{type(model).__name__} (the transformers backend) has no weight update",
                            "use a native model (a Llama-family directory or GGUF file)")
    for name, m in model.named_modules():
        if isinstance(m, (PackedWeight, PackedEmbedding, ExpertMatrices)):
            raise LogprobeError("model", f"{name} holds packed-quantized weights ({type(m).__name__}): float "
                                "tensors cannot be written into quantized blocks exactly",
                                "load the float checkpoint, or reload the scorer from the new quantized file")
    return _slots(model, list(full_slots(model.config, names=True)))


def refuse_hybrid(model) -> None:
    """The hybrid linear-attention models (``models.qwen3_next``) and the DeepSeek-V3-style ones
    (``models.deepseek``) take no weight update yet."""
    if isinstance(model, HybridModel):
        raise LogprobeError("model", f"{model.config.family} (hybrid linear attention) has no weight update yet",
                            "reload the scorer from the new checkpoint")
    if isinstance(model, DeepseekModel):
        raise LogprobeError("model", f"{model.config.family} (latent attention) has no weight update yet",
                            "reload the scorer from the new checkpoint")
    if isinstance(model, PartialRotaryMoeModel):  # glm4_moe, minimax_m2 (models.glm4_moe, models.minimax_m2)
        raise LogprobeError("model", f"{model.config.family} (sigmoid-router mixture of experts) has no weight "
                            "update yet", "reload the scorer from the new checkpoint")
    if isinstance(model, Gemma4Model):
        raise LogprobeError("model", f"{model.config.family} (Gemma 4) has no weight update yet",
                            "reload the scorer from the new checkpoint")
    if isinstance(model, Glm4Model):
        raise LogprobeError("model", "glm4 (fused gate_up checkpoints) has no weight update yet",
                            "reload the scorer from the new checkpoint")
    if isinstance(model, GemmaModel):
        raise LogprobeError("model", f"{model.config.family} (Gemma 3) has no weight update yet",
                            "reload the scorer from the new checkpoint")
    if isinstance(model, GptOssModel):
        raise LogprobeError("model", "gpt_oss has no weight update yet", "reload the scorer from the new checkpoint")


def full_slots(cfg, names: bool = False) -> dict[str, torch.Tensor]:
    """The slots of the whole (unsplit) model of ``cfg``, on the meta device: the shapes a
    checkpoint's tensors must have (``names``: its parameter names -> meta parameters instead)."""
    with torch.device("meta"):
        model = native_model_class(cfg)(cfg)
    return dict(model.state_dict()) if names else _slots(model, list(model.state_dict()))


def _slots(model, names: list[str]) -> dict[str, torch.Tensor]:
    slots = {}
    for n in names:
        if _STACKED.fullmatch(n):  # [E, out, in]: one unit per expert, as checkpoints store them
            p = model.get_parameter(n)
            slots.update({f"{n}.{e}": p[e] for e in range(p.shape[0])})
        else:
            slots[n] = model.get_parameter(n)
    return slots


def rank_slice(name: str, value: torch.Tensor, model: LlamaModel) -> torch.Tensor:
    """``model``'s rank's part of slot ``name``'s whole tensor (the rows its layer holds, as the
    loader reads them: ``loading.sharding``), as its own contiguous storage; the tensor itself
    with one rank."""
    if model.ctx.size == 1:
        return value
    cut = held_rows(model, name)
    if cut is None:
        return value
    a, b = cut
    return value[a:b].clone(memory_format=torch.contiguous_format)


def native_name(hf_name: str, model: LlamaModel) -> str | None:
    """A Hugging Face name -> the native parameter name, by the loader's own mapping
    (``loading.hf.hf_param_name``: Mixtral's ``block_sparse_moe`` too); None: a tensor the model does
    not hold (rotary ``inv_freq``, a tied model's ``lm_head.weight``). An unknown name comes back as
    given and fails the slot lookup."""
    try:
        return hf_param_name(hf_name, model.config, "update")
    except LogprobeError:
        return hf_name


def units(item: Incoming, model: LlamaModel, field: str) -> list[tuple[str | None, Incoming]]:
    """An incoming tensor as (slot name, piece) pairs: one pair, except a mixture of experts' tensors,
    which land one expert at a time:

        layers.N.mlp.experts.{e}.gate_proj.weight [I, H]   -> unit layers.N.mlp.experts.gate_proj.{e}
        layers.N.mlp.experts.gate_proj / up_proj / down_proj [E, out, in]  -> E units
        layers.N.mlp.experts.gate_up_proj [E, 2I, H] (transformers' in-memory name)
                                         -> gate_proj.{e} = [e, :I], up_proj.{e} = [e, I:]
    """
    name = native_name(item.name, model)
    if name is not None and (parts := fused_parts(name, model.config)) is not None:  # Phi-3's fused tensors
        if len(item.shape) != 2 or item.shape[0] != parts[-1][2]:
            raise LogprobeError(field, f"{item.name!r} has shape {item.shape}, the model's is "
                                f"{(parts[-1][2], model.config.hidden_size)}")
        return [(part, Incoming(item.name, (b - a, item.shape[1]), item.dtype, lambda a=a, b=b: item.load()[a:b]))
                for part, a, b in parts]
    if name is None or model.config.moe is None:
        return [(name, item)]
    if m := _EXPERT.fullmatch(name):
        return [(f"{m.group(1)}.{m.group(3)}.{m.group(2)}", item)]
    if len(item.shape) != 3:
        return [(name, item)]
    E, rows, cols = item.shape
    stacked = name.endswith(".experts.gate_up_proj") or _STACKED.fullmatch(name)
    if stacked and E != model.config.moe.num_experts:
        raise LogprobeError(field, f"{item.name!r} has shape {item.shape}: {E} experts, the model has "
                            f"{model.config.moe.num_experts}")
    if name.endswith(".experts.gate_up_proj") and rows % 2 == 0:
        half, base = rows // 2, name.removesuffix("gate_up_proj")
        return [(f"{base}{proj}.{e}", Incoming(item.name, (half, cols), item.dtype,
                                               lambda e=e, k=k: item.load()[e, k * half:(k + 1) * half]))
                for e in range(E) for k, proj in enumerate(("gate_proj", "up_proj"))]
    if _STACKED.fullmatch(name):
        return [(f"{name}.{e}", Incoming(item.name, (rows, cols), item.dtype, lambda e=e: item.load()[e]))
                for e in range(E)]
    return [(name, item)]


def check(name: str | None, item: Incoming, model: LlamaModel, slots: dict[str, torch.Tensor], seen: set[str],
          field: str) -> str | None:
    """``name`` (the unit ``item`` goes to) if the item is valid, None if it is ignored; raises
    naming it otherwise."""
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
    if item.dtype not in _FLOATS:
        raise LogprobeError(field, f"{item.name!r} is {str(item.dtype).removeprefix('torch.')}: weight updates "
                            "take float tensors (float32, bfloat16, float16)",
                            "quantized tensors cannot be written into this model exactly")
    want = tuple(slots[name].shape)
    if item.shape != want:
        part = "" if name.endswith(item.name.removeprefix("model.")) else f" for {name}"
        raise LogprobeError(field, f"{item.name!r} has shape {item.shape}{part}, the model's is {want}")
    seen.add(name)
    return name


def check_finite(name: str, value: torch.Tensor, slot: torch.Tensor, field: str) -> None:
    """Refuse ``value`` (incoming tensor ``name``) if it holds a NaN or an infinity, or a value that
    becomes one in the model's dtype (float32 -> float16 beyond 65504): such weights turn every
    score into NaN."""
    bad = int((~torch.isfinite(value)).sum())
    if bad:
        raise LogprobeError(field, f"{name!r} holds {bad} non-finite value{'s' * (bad != 1)} (NaN or inf)",
                            "send finite weights (a diverged trainer step would make every score NaN)")
    if value.numel() and slot.dtype != value.dtype and not torch.isfinite(value.abs().amax().to(slot.dtype)):
        raise LogprobeError(field, f"{name!r} holds values beyond the range of the model's "
                            f"{str(slot.dtype).removeprefix('torch.')} (largest {value.abs().amax().item():.4g})",
                            "send weights that fit the model's dtype")


def check_complete(slots: dict[str, torch.Tensor], seen: set[str], field: str) -> None:
    missing = [n for n in slots if n not in seen]
    if missing:
        hf = [n if n == "lm_head.weight" else f"model.{n}" for n in missing]
        raise LogprobeError(field, f"{len(missing)} weight{'s' * (len(missing) != 1)} missing: "
                            f"{', '.join(hf[:5])}{' ...' if len(hf) > 5 else ''}",
                            "send every weight of the model (a partial update would mix two policies)")


def convert(name: str, value: torch.Tensor, slot: torch.Tensor, model: LlamaModel) -> torch.Tensor:
    """What the loader makes of checkpoint tensor ``name``: the model's dtype and device, q/k rows
    (and q/k norms) interleaved for RoPE."""
    value = value.detach().to(device=slot.device, dtype=slot.dtype)
    return LlamaModel.interleave_rope_weights(model.config, {name: value})[name]


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
def update_in_place(model: LlamaModel, items: Iterable[Incoming], field: str, staged: bool) -> int:
    """Check every item, then copy all of them in (``staged``: convert each as it comes and copy
    once the stream ends; else check all first and convert while copying). Returns how many.
    Items are whole tensors; a tensor-parallel shard (under torchrun) takes its slice of each."""
    slots = weight_slots(model)
    full = slots if model.ctx.size == 1 else full_slots(model.config)
    seen: set[str] = set()

    def ready(name: str, piece: Incoming) -> torch.Tensor:
        value = piece.load()
        check_finite(piece.name, value, slots[name], field)
        return convert(name, rank_slice(name, value, model), slots[name], model)

    if staged:
        values = {}
        for item in items:
            for unit, piece in units(item, model, field):
                if (name := check(unit, piece, model, full, seen, field)) is not None:
                    values[name] = ready(name, piece)
        check_complete(full, seen, field)
        for name, value in values.items():
            slots[name].copy_(value)
        return len(values)
    todo = [(name, piece) for item in items for unit, piece in units(item, model, field)
            if (name := check(unit, piece, model, full, seen, field)) is not None]
    check_complete(full, seen, field)
    for name, piece in todo:  # values too before any copy (a checkpoint's tensors are read twice)
        check_finite(piece.name, piece.load(), slots[name], field)
    for name, piece in todo:
        slots[name].copy_(convert(name, rank_slice(name, piece.load(), model), slots[name], model))
    return len(todo)


def update_workers(model: LlamaModel, items: Iterable[Incoming], engine, field: str) -> int:
    """A parallel scorer's update: ``model`` is the driver's weightless (meta) model; each checked
    tensor is cut into its ranks' slices and sent to every replica's workers, which stage them
    (``StagedWeights``); once the stream is complete every worker confirms, then all copy in. Any
    error before that drops every staged slice (all or nothing across ranks)."""
    full = weight_slots(model)
    cfg, seen, n = model.config, set(), 0
    ranks = [rank_model(cfg, parallel_context(cfg, r, engine.tp)) for r in range(engine.tp)]
    try:
        for item in items:
            for unit, piece in units(item, model, field):
                if (name := check(unit, piece, model, full, seen, field)) is None:
                    continue
                value = piece.load().detach().cpu()
                check_finite(piece.name, value, full[name], field)
                for rank in ranks:
                    engine.stage_weights(rank.ctx.rank, [(name, rank_slice(name, value, rank))])
                n += 1
        check_complete(full, seen, field)
    except BaseException:
        engine.end_weights(commit=False)
        raise
    engine.end_weights(commit=True)
    return n


class StagedWeights:
    """A worker's side of ``update_workers``: slices converted and staged as they come (an error is
    kept for ``prepare``), copied into the shard at ``commit``."""

    def __init__(self, model: LlamaModel) -> None:
        self.model, self.slots = model, weight_slots(model)
        self.values: dict[str, torch.Tensor] = {}
        self.error: BaseException | None = None

    def add(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        try:
            for name, value in pairs:
                slot = self.slots[name]
                if tuple(value.shape) != tuple(slot.shape):
                    raise LogprobeError("named_tensors", f"{name}: a slice of shape {tuple(value.shape)} reached "
                                        f"rank {self.model.ctx.rank}, which holds {tuple(slot.shape)}")
                self.values[name] = convert(name, value, slot, self.model)
        except BaseException as e:  # noqa: BLE001 - reported at prepare
            self.error = self.error or e

    def prepare(self) -> None:
        if self.error is not None:
            raise self.error
        check_complete(self.slots, set(self.values), "named_tensors")

    @torch.no_grad()
    def commit(self) -> None:
        for name, value in self.values.items():
            self.slots[name].copy_(value)
        self.values = {}


def update_weights(model: LlamaModel, named_tensors, field: str = "named_tensors", engine=None) -> int:
    """(Hugging Face name, tensor) pairs -> the model's weights; see the module docstring.
    ``engine``: a parallel scorer's ``ParallelEngine`` (``model`` is then the driver's meta model)."""
    if isinstance(named_tensors, (str, bytes, torch.Tensor)) or not isinstance(named_tensors, Iterable):
        raise LogprobeError(field, "must be (name, tensor) pairs: a dict, a list or an iterator")
    refuse_hybrid(model)
    items = incoming_tensors(named_tensors, field)
    if engine is not None:
        return update_workers(model, items, engine, field)
    in_memory = isinstance(named_tensors, (Mapping, list, tuple))
    return update_in_place(model, items, field, staged=not in_memory)


def safetensors_items(path: str | Path, field: str = "path") -> list[Incoming]:
    """The tensors of a safetensors file, or of a directory of them (Hugging Face layout, sharded or
    not), as ``Incoming`` read from the headers (data read by ``load()``). A directory whose
    config.json declares a quantization is refused."""
    from safetensors import safe_open


    p = Path(path).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if cfg.exists():
            q = json.loads(cfg.read_text()).get("quantization_config")
            if q is not None:
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


def _read(f: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as st:
        return st.get_tensor(key)


def load_weights(model: LlamaModel, path: str | Path, field: str = "path", engine=None) -> int:
    """A safetensors checkpoint -> the model's weights, every header checked before one tensor is
    read (``engine``: as ``update_weights``; the driver reads the tensors and sends the slices)."""
    refuse_hybrid(model)
    items = safetensors_items(path, field)
    if engine is not None:
        full, seen = weight_slots(model), set()
        for item in items:  # headers first, as in place
            for unit, piece in units(item, model, field):
                check(unit, piece, model, full, seen, field)
        check_complete(full, seen, field)
        return update_workers(model, items, engine, field)
    return update_in_place(model, items, field, staged=False)
