"""Shard-by-shard reading for tensor parallelism: each rank reads only its slices of each tensor.

The split is the layers' own: every tensor-parallel layer states the rows of the checkpoint's whole
tensors it holds (``layers.parallel_linear.RowShard.tp_rows``: column-parallel = its rows,
gathered-row = rows of the output, vocabulary-parallel = rows of the embedding and LM head), and
``held_rows(rank_model(cfg, ctx), name)`` reads it off the rank's model built on the meta device
(no memory). Safetensors are read with ``get_slice`` (only those bytes); GGUF tensors are
memory-mapped and cut before anything is decoded (whole rows: quantized blocks are never cut).
Weight updates slice whole tensors the same way (``loading.update.rank_slice``). FP8 block
checkpoints are cut the same way, codes by rows and scales by the block rows those rows fall in
(``fp8_shard_tensors``, ``fp8_block.fp8_rows``).

Experts (``layers.moe.Experts.held``): a rank reads only the experts of its group (the others'
tensors are skipped unread) and, of each, its rows: per-expert matrices
``layers.N.mlp.experts.{e}.gate_proj.weight`` [I, H] by rows, stacked ``experts.down_proj``
[E, H, I] by experts then rows, transformers' fused ``experts.gate_up_proj`` [E, 2I, H] by experts
and by the rank's rows of each half (``rank_cut``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch

from ..errors import LogprobeError
from ..kernels.gguf_quants import GGML_TYPES
from ..layers.moe import Experts
from ..layers.parallel_linear import held_ranges, held_rows
from ..models.glm4_moe import PartialRotaryConfig
from ..models.llama import LlamaConfig, LlamaModel
from ..models.minimax_m2 import sigmoid_model_class
from ..models.moe import native_model_class
from ..parallel.context import ParallelContext
from ..parallel.placement import Placement, place_experts
from .checkpoint import SKIP, hf_param_name, open_files
from .fp8_block import fp8_block_tensors, fp8_scheme
from .gguf import _LAYER_MAP, _TOP_MAP
from .hf import _plain_tensors, stack_experts
from .phi3 import FUSED, split_fused
from .registry import families, family_of

log = logging.getLogger(__name__)


def default_expert_parallel(cfg, size: int) -> int:
    """The expert-parallel size a split over ``size`` ranks takes when none is given: whole experts
    per rank (``size``) for a mixture of experts whose expert count it divides (no gather of the
    intermediate, the fused kernel on each rank's rows, the same bits at every size on CUDA too),
    else 1 (every expert split ``size`` ways); 1 for models without experts (``Family.experts``
    False: none ever). gpt-oss alike (its experts are never split by rows: 1 keeps every expert on
    every rank)."""
    family = family_of(cfg)
    if (family is not None and not family.experts) or getattr(cfg, "moe", None) is None:
        return 1
    return size if cfg.moe.num_experts % size == 0 else 1


def expert_placement(cfg, size: int, experts: int, redundant: int, loads) -> Placement | None:
    """The replicas of hot experts of a split (``parallel.placement.place_experts``): None where
    ``redundant`` is 0 (and no ``loads`` given); else checked against the model and the split
    (whole experts per rank over 2 or more ranks, one load per expert), each error naming its
    field, before any process starts. The loads are the caller's (tokens routed to each expert,
    e.g. counted on a warm-up pass): one placement serves every MoE block.

    >>> from logprobe.layers.moe import MoeSpec
    >>> cfg = LlamaConfig(64, 16, 32, 1, 2, 2, 8, moe=MoeSpec(4, 2, 8, True))
    >>> expert_placement(cfg, 2, 2, 1, [9, 1, 1, 1]).replicas
    ((0, 1), (0,), (1, 0), (1,))
    """
    if not redundant and loads is None:
        return None
    moe = getattr(cfg, "moe", None)
    family = family_of(cfg)
    if moe is None or family is None or not family.experts or family.name == "gpt_oss":
        raise LogprobeError("redundant_experts", f"{getattr(cfg, 'family', type(cfg).__name__)} has no experts "
                            "to copy", "leave redundant_experts and expert_loads out")
    if experts != size or size < 2:
        raise LogprobeError("redundant_experts", f"replicas of experts need whole experts per rank over 2 or more "
                            f"ranks; expert_parallel_size {experts} of {size} ranks",
                            "use expert_parallel_size = tensor_parallel_size > 1")
    if loads is None:
        raise LogprobeError("expert_loads", f"redundant_experts {redundant} needs each expert's load to place "
                            "the replicas", f"give expert_loads: {moe.num_experts} token counts, one per expert")
    if len(loads) != moe.num_experts:
        raise LogprobeError("expert_loads", f"{len(loads)} loads for {moe.num_experts} experts",
                            "give one load per expert")
    return place_experts(loads, size, redundant)


ATTENTION_LAYOUTS = ("data", "tensor")


def data_attention_family(cfg) -> bool:
    """Whether the model's blocks can run data-parallel attention (``ParallelContext.attention``):
    a mixture of experts of a family with ``Family.data_attention`` (the Llama-family mixtures of
    experts: Qwen2/Qwen3-MoE, Mixtral, OLMoE, GLM-4.5, MiniMax-M2; the DeepSeek-style ones; gpt-oss;
    the hybrid Qwen3.5-MoE / Qwen3-Next), whose attention and dense layers are built whole under
    it and whose forward is ``ScoringModel.forward``; not the Gemma families."""
    family = family_of(cfg)
    return family is not None and family.data_attention and getattr(cfg, "moe", None) is not None


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
        names = [f.title for f in families() if f.data_attention]
        raise LogprobeError("attention_parallel", f'"data": {getattr(cfg, "family", type(cfg).__name__)} runs '
                            "attention split by heads only (data-parallel attention is for mixtures of experts "
                            f"of the {', '.join(names[:-1])} and {names[-1]} families)", 'use "tensor", or leave it out')
    if attention == "data" and experts != size:
        raise LogprobeError("attention_parallel", f'"data" needs whole experts per rank; expert_parallel_size '
                            f"{experts} splits each expert {size // experts} ways over {size} ranks",
                            f'use expert_parallel_size = tensor_parallel_size ({size}), or attention_parallel "tensor"')
    return attention


def rank_model(cfg: LlamaConfig, ctx: ParallelContext) -> LlamaModel:
    """Rank ``ctx.rank``'s model on the meta device: its layers say which rows of each tensor the
    rank holds (``held_rows``), without a byte of weights."""
    cls = sigmoid_model_class(cfg) if isinstance(cfg, PartialRotaryConfig) else native_model_class(cfg)
    with torch.device("meta"):
        return cls(cfg, ctx=ctx)


def hf_shard_tensors(path: Path, cfg: LlamaConfig, ctx: ParallelContext, model: LlamaModel | None = None,
                     place=None):
    """Yield (parameter name, this rank's slice) from a float safetensors checkpoint; experts of
    other ranks are not read, this rank's are stacked [E / M, rows, in] (``rank_cut``).
    ``model``: the rank's meta-device model (default ``rank_model``); ``place``: the model's
    (device, dtype), where float experts are stacked as read (``hf.stack_experts``)."""


    model = model if model is not None else rank_model(cfg, ctx)
    if cfg.extra.get(FUSED):  # Phi-3: fused qkv_proj / gate_up_proj read whole, cut apart, then sliced
        for name, w in split_fused(_plain_tensors(path, cfg), cfg):
            cut = held_rows(model, name)
            yield name, w if cut is None else w[cut[0]:cut[1]].contiguous()
        return

    def read():
        for f, st in open_files(path, prefetch=False):
            for key in st.keys():
                name = hf_param_name(key, cfg, f.name)
                cut = None if name is None else rank_cut(model, name)
                if name is not None and cut is not SKIP:
                    yield name, read_cut(st, key, cut)

    yield from stack_experts(read(), cfg, held_experts(model), place)


def fp8_shard_tensors(path: Path, cfg: LlamaConfig, ctx: ParallelContext, raw: dict, model: LlamaModel | None = None,
                      place=None):
    """``hf_shard_tensors`` of an FP8 block checkpoint (``loading.fp8_block``): this rank's rows of
    each FP8 weight read alone and kept FP8, each row with its block row's scales (a range may
    start inside a block: exact), float tensors cut as in a float checkpoint, other ranks'
    experts not read, this rank's stacked as ``FP8BlockExperts`` [E / M, rows, in]."""
    if cfg.extra.get(FUSED):
        raise LogprobeError("quantization_config", f"{path.name}: a quantized Phi-3 checkpoint (fused qkv_proj / "
                            "gate_up_proj) is not read natively", "score the unquantized model")
    model = model if model is not None else rank_model(cfg, ctx)
    scheme = fp8_scheme(raw["quantization_config"])
    stream = fp8_block_tensors(path, scheme, lambda key, file: hf_param_name(key, cfg, file), log,
                               lambda name: rank_cut(model, name))
    yield from stack_experts(stream, cfg, held_experts(model), place)


class ShardedGGUF:
    """A GGUF reader whose tensors are this rank's slices (raw bytes cut, nothing decoded):
    ``gguf.gguf_tensors`` reads it like the whole file."""

    def __init__(self, reader, cfg: LlamaConfig, ctx: ParallelContext) -> None:
        self.fields = reader.fields
        model = rank_model(cfg, ctx)
        self.tensors = []
        for t in reader.tensors:
            name = _gguf_param_name(t.name)
            cut = held_rows(model, name) if name else None
            if cut is None or int(t.tensor_type) not in GGML_TYPES:
                self.tensors.append(t)
                continue
            a, b = cut
            shape = [int(x) for x in t.shape]  # innermost first
            if len(shape) == 1:  # a bias: [rows]
                data, shape[0] = t.data[a:b], b - a
            else:
                data = t.data if t.data.ndim == 2 else t.data.reshape(int(np.prod(shape[1:])), -1)  # [rows, bytes]
                data, shape[1] = data[a:b], b - a
            self.tensors.append(t._replace(data=data, shape=np.array(shape), n_elements=int(np.prod(shape))))


def _gguf_param_name(name: str) -> str | None:
    """blk.3.attn_q.weight -> layers.3.self_attn.q_proj.weight (None for tensors nobody splits)."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_MAP:
        return f"layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    return _TOP_MAP.get(name)


_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED = re.compile(r"(.*\.experts)\.(gate_proj|up_proj|down_proj|gate_up_proj)")


def rank_cut(model: torch.nn.Module, name: str):
    """How rank ``model`` (its meta-device model) reads checkpoint tensor ``name``: None (whole),
    ``SKIP`` (an expert of another rank's group) or a function of the tensor, or of its
    safetensors slice (read lazily: only those bytes), giving this rank's part.

    >>> from logprobe.parallel.context import ParallelContext
    >>> m = torch.nn.Module(); m.mlp = torch.nn.Module()
    >>> m.mlp.experts = Experts(4, 8, 6, ParallelContext(1, 2, experts=2))  # rank 1: experts 2, 3 whole
    >>> rank_cut(m, "mlp.experts.1.up_proj.weight"), rank_cut(m, "mlp.experts.2.up_proj.weight")(torch.ones(6, 8)).shape
    ('skip', torch.Size([6, 8]))
    """
    m = _PER_EXPERT.fullmatch(name)
    if m is not None:
        experts = _experts(model, m.group(1))
        _, (a, b) = experts.held(m.group(3))
        return (lambda t: t[a:b]) if int(m.group(2)) in experts.expert_ids else SKIP
    m = _STACKED.fullmatch(name)
    if m is not None and isinstance(_experts(model, m.group(1), None), Experts):
        experts = _experts(model, m.group(1))
        runs = expert_runs(experts.expert_ids)
        if m.group(2) == "gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            _, (a, b) = experts.held("gate_proj")
            inter = experts.intermediate
            return lambda t: torch.cat([_runs(t, runs, a, b), _runs(t, runs, inter + a, inter + b)], dim=1)
        _, (a, b) = experts.held(m.group(2))
        return lambda t: _runs(t, runs, a, b)
    ranges = held_ranges(model, name)
    return None if ranges is None else lambda t: torch.cat([t[a:b] for a, b in ranges]) if len(ranges) > 1 \
        else t[ranges[0][0]:ranges[0][1]]


def expert_runs(ids) -> list[tuple[int, int]]:
    """Experts ``ids`` (a rank's own, then its replicas: ``Experts.expert_ids``) as runs [start,
    end) of consecutive ids, in order.

    >>> expert_runs((4, 5, 6, 7, 0, 2, 3))
    [(4, 8), (0, 1), (2, 4)]
    """
    runs: list[list[int]] = []
    for e in ids:
        if runs and runs[-1][1] == e:
            runs[-1][1] += 1
        else:
            runs.append([e, e + 1])
    return [tuple(r) for r in runs]


def _runs(t, runs: list[tuple[int, int]], a: int, b: int) -> torch.Tensor:
    """Rows a:b of experts ``runs`` of a stacked [E, out, in] tensor or safetensors slice, stacked."""
    parts = [t[e0:e1, a:b] for e0, e1 in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _experts(model: torch.nn.Module, path: str, default=LookupError):
    try:
        return model.get_submodule(path)
    except AttributeError:
        if default is LookupError:
            raise
        return default


def held_experts(model: torch.nn.Module) -> tuple[int, int] | list[int] | None:
    """The experts [start, end) every MoE block of rank ``model`` holds, or under a placement the
    list of them, own then replicas (``Experts.expert_ids``; None: no experts)."""
    for m in model.modules():
        if isinstance(m, Experts):
            return m.held("gate_proj")[0] if m.placement is None else list(m.expert_ids)
    return None


def read_cut(st, key: str, cut):
    """Tensor ``key`` of an open safetensors file as ``cut`` (``rank_cut``, not SKIP) says."""
    return st.get_tensor(key) if cut is None else cut(st.get_slice(key))
