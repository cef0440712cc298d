"""Shard-by-shard reading for tensor parallelism: each rank reads only its slices of each tensor.

``shard_slice(name, cfg, ctx)`` says which slice of a native parameter a rank holds (the layer
types of ``models.llama`` define the split: column-parallel = rows, row-parallel = input columns,
vocabulary-parallel = rows of the embedding and LM head). Safetensors are read with
``get_slice`` (only those bytes); GGUF tensors are memory-mapped and cut before anything is
decoded, quantized blocks whole: a cut inside a block is an error naming the tensor.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..errors import LogprobeError
from ..models.llama import LlamaConfig, LlamaModel
from ..parallel.context import ParallelContext
from ..parallel.shard import kv_heads, q_heads, shard_range


def shard_slice(name: str, cfg: LlamaConfig, ctx: ParallelContext, vocab: tuple[int, int]
                ) -> tuple[int, int, int] | None:
    """(dim, start, end) of parameter ``name`` on this rank, or None when every rank holds it whole."""
    D = cfg.head_dim
    m = re.fullmatch(r"layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)", name)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return 0, *vocab
    if m is None:
        return None
    proj, kind = m.group(2), m.group(3)
    if proj == "q_proj":
        q0, q1 = q_heads(cfg.num_heads, ctx.rank, ctx.size)
        return 0, q0 * D, q1 * D
    if proj in ("k_proj", "v_proj"):
        k0, k1 = kv_heads(cfg.num_heads, cfg.num_kv_heads, ctx.rank, ctx.size)
        return 0, k0 * D, k1 * D
    if proj == "o_proj" and kind == "weight":
        q0, q1 = q_heads(cfg.num_heads, ctx.rank, ctx.size)
        return 1, q0 * D, q1 * D
    if proj in ("gate_proj", "up_proj"):
        return 0, *shard_range(cfg.intermediate_size, ctx.rank, ctx.size)
    if proj == "down_proj" and kind == "weight":
        return 1, *shard_range(cfg.intermediate_size, ctx.rank, ctx.size)
    return None


def hf_shard_tensors(path: Path, cfg: LlamaConfig, ctx: ParallelContext):
    """Yield (parameter name, this rank's slice) from a float safetensors checkpoint."""
    from safetensors import safe_open

    from .checkpoint import hf_param_name, safetensors_files

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
                dim, a, b = cut
                sl = st.get_slice(key)
                yield name, (sl[a:b] if dim == 0 else sl[:, a:b])


class ShardedGGUF:
    """A GGUF reader whose tensors are this rank's slices (raw bytes cut, nothing decoded):
    ``gguf.gguf_tensors`` reads it like the whole file."""

    def __init__(self, reader, cfg: LlamaConfig, ctx: ParallelContext) -> None:
        from .gguf_quants import GGML_TYPES, block_values

        self.fields = reader.fields
        vocab = LlamaModel.vocab_range_of(cfg, ctx)
        self.tensors = []
        for t in reader.tensors:
            name = _gguf_param_name(t.name)
            cut = shard_slice(name, cfg, ctx, vocab) if name else None
            if cut is None or int(t.tensor_type) not in GGML_TYPES:
                self.tensors.append(t)
                continue
            dim, a, b = cut
            qname, block_bytes = GGML_TYPES[int(t.tensor_type)]
            shape = [int(x) for x in t.shape]  # innermost first
            data = t.data if t.data.ndim == 2 else t.data.reshape(int(np.prod(shape[1:])), -1)
            if dim == 0:
                data, shape[1] = data[a:b], b - a
            else:
                per = block_values(qname) if block_bytes else 1
                if a % per or b % per:
                    raise LogprobeError("tensor_parallel_size", f"{t.name} ({qname}) would be cut inside its "
                                        f"blocks of {per} weights at columns {a}:{b}",
                                        "use a TP size that splits rows at block boundaries")
                unit = block_bytes if block_bytes else 1
                data, shape[0] = data[:, a // per * unit:b // per * unit], b - a
            self.tensors.append(t._replace(data=data, shape=np.array(shape), n_elements=int(np.prod(shape))))


def _gguf_param_name(name: str) -> str | None:
    """blk.3.attn_q.weight -> layers.3.self_attn.q_proj.weight (None for tensors nobody splits)."""
    from .gguf import _LAYER_MAP, _TOP_MAP

    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_MAP:
        return f"layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    return _TOP_MAP.get(name)
