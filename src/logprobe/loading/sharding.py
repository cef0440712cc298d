"""Shard-by-shard reading for tensor parallelism: each rank reads only its slices of each tensor.

``shard_slice(name, cfg, ctx)`` says which slice of a native parameter a rank holds (the layer
types of ``models.llama`` define the split: column-parallel = rows, row-parallel = rows of the output,
vocabulary-parallel = rows of the embedding and LM head). Safetensors are read with
``get_slice`` (only those bytes); GGUF tensors are memory-mapped and cut before anything is
decoded (whole rows: quantized blocks are never cut).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..kernels.gguf_quants import GGML_TYPES
from ..models.llama import LlamaConfig, LlamaModel
from ..parallel.context import ParallelContext
from ..parallel.shard import kv_heads, q_heads, shard_range
from .checkpoint import hf_param_name, safetensors_files
from .gguf import _LAYER_MAP, _TOP_MAP


def shard_slice(name: str, cfg: LlamaConfig, ctx: ParallelContext, vocab: tuple[int, int]
                ) -> tuple[int, int] | None:
    """The rows [start, end) of parameter ``name`` on this rank, or None when every rank holds it
    whole. Every split is by rows (output features), so a cut never falls inside a row's blocks."""
    D = cfg.head_dim
    m = re.fullmatch(r"layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)", name)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return vocab
    if m is None:
        return None
    proj = m.group(2)
    if proj == "q_proj":
        q0, q1 = q_heads(cfg.num_heads, ctx.rank, ctx.size)
        return q0 * D, q1 * D
    if proj in ("k_proj", "v_proj"):
        k0, k1 = kv_heads(cfg.num_heads, cfg.num_kv_heads, ctx.rank, ctx.size)
        return k0 * D, k1 * D
    if proj in ("gate_proj", "up_proj"):
        return shard_range(cfg.intermediate_size, ctx.rank, ctx.size)
    if proj in ("o_proj", "down_proj"):  # rows of the output, whole along the inputs
        return shard_range(cfg.hidden_size, ctx.rank, ctx.size)
    return None


def hf_shard_tensors(path: Path, cfg: LlamaConfig, ctx: ParallelContext):
    """Yield (parameter name, this rank's slice) from a float safetensors checkpoint."""
    from safetensors import safe_open


    vocab = LlamaModel.vocab_range_of(cfg, ctx)
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                name = hf_param_name(key, cfg, f.name)
                if name is None:
                    continue
                cut = shard_slice(name, cfg, ctx, vocab)
                if cut is None:
                    yield name, st.get_tensor(key)
                    continue
                a, b = cut
                yield name, st.get_slice(key)[a:b]


class ShardedGGUF:
    """A GGUF reader whose tensors are this rank's slices (raw bytes cut, nothing decoded):
    ``gguf.gguf_tensors`` reads it like the whole file."""

    def __init__(self, reader, cfg: LlamaConfig, ctx: ParallelContext) -> None:
        self.fields = reader.fields
        vocab = LlamaModel.vocab_range_of(cfg, ctx)
        self.tensors = []
        for t in reader.tensors:
            name = _gguf_param_name(t.name)
            cut = shard_slice(name, cfg, ctx, vocab) if name else None
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
