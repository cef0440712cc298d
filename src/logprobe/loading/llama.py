"""The Llama family (``models.llama``, ``models.moe``): Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM,
Phi-3/Phi-4 (fused tensors: ``loading.phi3``) and the mixtures of experts of the same blocks (Qwen2-MoE,
Qwen3-MoE, Mixtral, OLMoE). Its config reader is ``hf.native_config`` (None and a reason: the
transformers backend runs the config), its safetensors reader ``hf.hf_tensors`` (float, FP8 block,
compressed-tensors, GPTQ, AWQ), its GGUF reader ``gguf`` (llama, qwen2, qwen3, qwen2moe, qwen3moe:
packed or dense), its rank's reader ``sharding`` (float and FP8 block safetensors, dense GGUF); the
builder ``build_native`` and the split ``llama_parallel_context`` are here. The family registers
itself at the bottom (``loading.registry``).
"""

from __future__ import annotations

import torch

from ..errors import LogprobeError
from ..layers.quant_linear import PackedEmbedding, PackedWeight
from ..models.llama import LlamaConfig, LlamaModel
from ..models.moe import native_model_class
from ..parallel.context import ParallelContext
from ..parallel.shard import check_experts, check_tp, num_blocks, vocab_chunk_width
from .checkpoint import hf_param_name
from .fp8_block import is_fp8_block, split_packed
from .gguf import ARCHES, gguf_config, gguf_tensors
from .hf import MOE_TYPES, NATIVE_TYPES, check_quantization, hf_tensors, native_config, read_config
from .phi3 import fused_parts
from .registry import Family, Load, register
from .sharding import ShardedGGUF, attention_layout, fp8_shard_tensors, hf_shard_tensors


def build_native(cfg: LlamaConfig, tensors, device: torch.device, dtype: torch.dtype,
                 rope_interleaved: bool = False, ctx: ParallelContext | None = None,
                 model_class: type[LlamaModel] | None = None) -> LlamaModel:
    """rope_interleaved: q/k rows already arrive in the layout the model uses (llama GGUF).
    ``ctx``: this rank's tensor-parallel group; ``tensors`` then yields this rank's slices.
    ``model_class``: a subclass of the Llama blocks' models (Qwen3-VL's; default
    ``native_model_class(cfg)``).

    ``tensors`` yields (parameter name, tensor) or (parameter name, packed layer): a packed
    ``*.weight`` replaces the whole Linear (or the embedding) it belongs to; packed experts
    (``layers.moe.PackedExperts``) replace one of an MoE block's expert tensors."""
    freq_factors = None

    def weights():  # GGUF's rope_freqs is a factor of the rotary table, not a weight
        nonlocal freq_factors
        for name, w in tensors:
            if name == "rope_freqs":
                freq_factors = w.float()
            else:
                yield name, w

    state, packed, experts = split_packed(weights(), device, dtype)
    with torch.device("meta"):
        model = (model_class or native_model_class(cfg))(cfg, ctx=ctx)
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
    model.rotary = model.make_rotary(freq_factors).to(device)
    model.fuse_projections()
    return model.eval()


def llama_parallel_context(cfg, rank: int = 0, size: int = 1, group=None, experts: int = 1,
                           attention: str | None = None, latent: bool = False) -> ParallelContext:
    """A rank's context for a model of Llama-family blocks (dense or a mixture of experts; the
    sigmoid-router families and, with ``latent``, DeepSeek's latent attention, split by heads, use
    it too): heads, vocabulary, widths and experts checked against ``size`` and ``experts``;
    ``attention``: "data" (attention and dense layers whole per rank) or "tensor"
    (``sharding.attention_layout``)."""
    moe = cfg.moe
    if moe is None and experts != 1:
        raise LogprobeError("expert_parallel_size", f"{experts}: this model has no experts", "use 1")
    grid = vocab_chunk_width(cfg.vocab_size)
    layout = attention_layout(cfg, size, experts, attention)
    if layout == "data":  # attention and dense layers whole: only the vocabulary and the experts split
        check_tp(size, size, -(-cfg.vocab_size // grid), size)  # (heads whole: only the vocabulary checked)
        check_experts(moe.num_experts, moe.intermediate_size, cfg.hidden_size, size, experts)
        return ParallelContext(rank, size, group, num_blocks(*cfg.split_widths), experts, layout)
    if latent:  # latent attention: split by heads
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


def _shard_tensors(path, cfg: LlamaConfig, ctx: ParallelContext, load: Load):
    """This rank's slices of a float or FP8 block checkpoint; None for a mixture of experts on one
    rank (the whole model, packed where quantized: ``loader.load_model``)."""
    if cfg.moe is not None and ctx.size == 1:
        return None
    raw = read_config(path)
    if raw.get("quantization_config") is not None and not is_fp8_block(raw):
        raise LogprobeError("tensor_parallel_size", f"{path.name} is a quantized checkpoint: tensor parallelism "
                            "reads float and FP8 block safetensors and GGUF files", "use one GPU for it")
    check_quantization(raw, path, native=True)
    return (fp8_shard_tensors(path, cfg, ctx, raw, place=load.place) if is_fp8_block(raw)
            else hf_shard_tensors(path, cfg, ctx, place=load.place))


def _gguf_shard_tensors(reader, arch: str, cfg: LlamaConfig, ctx: ParallelContext, load: Load):
    """This rank's blocks of a dense model's GGUF file, expanded (None: a mixture of experts is
    read on one device)."""
    if cfg.moe is not None:
        return None
    return gguf_tensors(ShardedGGUF(reader, cfg, ctx), arch, cfg, packed=False)


FAMILY = register(Family(
    name="llama", title="Llama", config_class=LlamaConfig,
    model_types=(*NATIVE_TYPES, "phi3", *MOE_TYPES),
    config=native_config,
    model_class=native_model_class,
    tensors=lambda path, cfg, raw, load: hf_tensors(path, cfg, raw, packed=load.weights == "packed",
                                                    quantize_activations=load.quantize_activations,
                                                    place=load.place),
    build=lambda cfg, tensors, load, ctx: build_native(cfg, tensors, load.device, load.dtype,
                                                       load.rope_interleaved, ctx=ctx),
    parallel_context=llama_parallel_context,
    shard_tensors=_shard_tensors,
    param_name=hf_param_name,
    gguf_archs=ARCHES,
    gguf_config=lambda reader, path: gguf_config(reader, path)[1],
    gguf_tensors=lambda reader, arch, cfg, load: gguf_tensors(reader, arch, cfg, packed=load.weights == "packed"),
    gguf_shard_tensors=_gguf_shard_tensors,
    data_attention=True,
    fused=fused_parts,
))
