"""The native families, each one record (``Family``), looked up by what a checkpoint says it is.

A family is registered once, at the bottom of its own loading module (``loading.gemma`` for Gemma 3,
``loading.llama`` for the Llama family, ...); ``loading.families`` imports every such module. The
loader (``loading.loader``) and weight updates (``loading.update``) then ask this registry and name
no family themselves:

    config.json {"model_type": "gemma3_text"}  --family_for_config-->  Family "gemma"
    a GGUF file's general.architecture "gemma3" --family_for_gguf-->   Family "gemma"
    a native config object (GemmaConfig)        --family_of-->         Family "gemma"

Each key belongs to one family: a ``model_type``, a GGUF architecture or a config class registered
twice is refused at import, so the lookups are plain dictionary reads and the order the families
register in does not matter (the if-chains this replaces matched disjoint sets too). ``family_of``
walks the config's class hierarchy, most derived first: ``Glm4Config`` (a ``LlamaConfig``) finds
GLM-4's record, a plain ``LlamaConfig`` the Llama family's.

The record's callables take the loading options as one ``Load`` (device, dtype, packed or dense,
FP8 activations, GGUF rotary layout), passed down: a family reads the ones it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import LogprobeError


@dataclass(frozen=True, slots=True)
class Incoming:
    """One named tensor of a weight update before its data is read: ``load()`` gives the tensor
    (``loading.update``; a family's ``units`` hook reshapes it)."""

    name: str  # Hugging Face name
    shape: tuple[int, ...]
    dtype: torch.dtype | str  # a torch dtype, or a safetensors code the check refuses
    load: Callable[[], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Load:
    """How one load places and keeps the weights (``loader.load_model``'s options).

    ``weights``: "packed" or "dense"; ``rope_interleaved``: the q/k rows of the tensors arrive
    already in the interleaved rotary layout (a llama.cpp conversion); ``place``: (device, dtype),
    where tensors are made as they are read."""

    device: torch.device
    dtype: torch.dtype
    weights: str = "packed"
    quantize_activations: bool = False
    rope_interleaved: bool = False

    @property
    def place(self) -> tuple[torch.device, torch.dtype]:
        return self.device, self.dtype


def _no_parts(name: str, cfg) -> None:
    return None


def _no_units(name: str, item, model, field: str) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Family:
    """One native family: what it matches, how its checkpoints are read, how its model is built
    and split, and how a weight update names its tensors. Signatures (``raw``: config.json as a
    dict; ``load``: ``Load``; ``ctx``: a rank's ``ParallelContext`` or None; pairs: an iterator of
    (native parameter name, tensor)):

        config(raw) -> (cfg, "") | (None, why)      None: the transformers backend runs it (why)
        model_class(cfg) -> the nn.Module class     its __init__(cfg, ctx=None)
        tensors(path, cfg, raw, load) -> pairs      a whole safetensors checkpoint
        build(cfg, pairs, load, ctx) -> model       on load.device in load.dtype
        parallel_context(cfg, rank, size, group, experts, attention) -> ParallelContext
        shard_tensors(path, cfg, ctx, load) -> pairs | None   this rank's slices; None: one rank
                                                              reads the whole model (load_model)
        gguf_config(reader, path) -> cfg            gguf_tensors(reader, arch, cfg, load) -> pairs
        gguf_shard_tensors(reader, arch, cfg, ctx, load) -> pairs | None   None: read on one device
        describe(meta model, raw | None) -> None     marks a weightless model as its weights will be held
        param_name(key, cfg, where) -> native name | None (not a weight it holds)
        fused(native name, cfg) -> [(part, first row, end row)] | None   tensors cut by rows
        units(native name, Incoming, model, field) -> [(slot, Incoming)] | None   reshaped tensors
    """

    name: str  # "gemma": the family's key in messages and tests
    title: str  # "Gemma 3": how messages name it
    config_class: type  # the native config class; its subclasses belong to it unless registered
    model_types: tuple[str, ...]  # config.json model_type values it reads
    config: Callable
    model_class: Callable
    tensors: Callable
    build: Callable
    parallel_context: Callable
    shard_tensors: Callable
    param_name: Callable
    gguf_archs: tuple[str, ...] = ()  # GGUF general.architecture values it reads
    gguf_config: Callable | None = None
    gguf_tensors: Callable | None = None
    gguf_shard_tensors: Callable | None = None  # (reader, arch, cfg, ctx, load) -> pairs | None (one device)
    describe: Callable = lambda model, raw: None  # what a weightless model notes of its checkpoint
    experts: bool = True  # may hold routed experts (False: an expert-parallel size other than 1 is refused)
    data_attention: bool = False  # its mixtures of experts run data-parallel attention (``attention_layout``)
    whole_experts: bool = False  # updates take its expert stacks whole [E, ...] (else one expert at a time)
    fused: Callable = _no_parts
    units: Callable = _no_units
    buffers: tuple[str, ...] = ()  # native name endings of weights transformers holds as buffers
    # native name prefixes of a vision tower's weights: an update takes those sent and keeps the
    # others (a trainer that freezes the tower may send the text model alone: ``update.check_complete``)
    towers: tuple[str, ...] = ()

    def build_meta(self, cfg, ctx=None):
        """A model of this family on the current device (the meta device for shapes, a rank's rows)."""
        return self.model_class(cfg)(cfg, ctx=ctx)

    def interleave(self, cfg, state: dict) -> dict:
        """q/k rows of ``state`` to the interleaved rotary layout, as the family's loader does."""
        return self.model_class(cfg).interleave_rope_weights(cfg, state)


_BY_TYPE: dict[str, Family] = {}
_BY_ARCH: dict[str, Family] = {}
_BY_CONFIG: dict[type, Family] = {}
_ALL: list[Family] = []


def register(family: Family) -> Family:
    """Add ``family`` under its model_types, GGUF architectures and config class; a key another
    family holds already is refused (the lookups would depend on import order)."""
    for table, keys in ((_BY_TYPE, family.model_types), (_BY_ARCH, family.gguf_archs),
                        (_BY_CONFIG, (family.config_class,))):
        for key in keys:
            if key in table and table[key].name != family.name:
                raise LogprobeError("model", f"{key!r} is registered by the families {table[key].name!r} and "
                                    f"{family.name!r}", "give each model_type, GGUF architecture and config "
                                    "class to one family")
    _ALL[:] = [f for f in _ALL if f.name != family.name] + [family]
    _BY_TYPE.update(dict.fromkeys(family.model_types, family))
    _BY_ARCH.update(dict.fromkeys(family.gguf_archs, family))
    _BY_CONFIG[family.config_class] = family
    return family


def families() -> tuple[Family, ...]:
    """Every registered family, in the order they registered."""
    return tuple(_ALL)


def family_for_config(raw: dict) -> Family | None:
    """The family reading config.json ``raw`` (by its ``model_type``); None: no native family."""
    mtype = raw.get("model_type")
    return _BY_TYPE.get(mtype) if isinstance(mtype, str) else None


def family_for_gguf(arch) -> Family | None:
    """The family reading GGUF files of architecture ``arch``; None: none does."""
    return _BY_ARCH.get(arch) if isinstance(arch, str) else None


def family_of(cfg) -> Family | None:
    """The family of a native config object (its class or the nearest registered base class);
    None for anything else (None, a transformers config)."""
    for cls in type(cfg).__mro__:
        if cls in _BY_CONFIG:
            return _BY_CONFIG[cls]
    return None


def gguf_archs() -> tuple[str, ...]:
    """Every GGUF architecture a family reads, in registration order."""
    return tuple(a for f in _ALL for a in f.gguf_archs)
