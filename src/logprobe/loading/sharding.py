"""Shard-by-shard reading for tensor parallelism: each rank reads only its slices of each tensor.

The split is the layers' own: every tensor-parallel layer states the rows of the checkpoint's whole
tensors it holds (``layers.parallel_linear.RowShard.tp_rows``: column-parallel = its rows,
gathered-row = rows of the output, vocabulary-parallel = rows of the embedding and LM head), and
``held_rows(rank_model(cfg, ctx), name)`` reads it off the rank's model built on the meta device
(no memory). Safetensors are read with ``get_slice`` (only those bytes); GGUF tensors are
memory-mapped and cut before anything is decoded (whole rows: quantized blocks are never cut).
Weight updates slice whole tensors the same way (``loading.update.rank_slice``).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from ..kernels.gguf_quants import GGML_TYPES
from ..layers.parallel_linear import held_rows
from ..models.llama import LlamaConfig, LlamaModel
from ..models.moe import native_model_class
from ..parallel.context import ParallelContext
from .checkpoint import hf_param_name, safetensors_files
from .gguf import _LAYER_MAP, _TOP_MAP
from .hf import _plain_tensors
from .phi3 import FUSED, split_fused


def rank_model(cfg: LlamaConfig, ctx: ParallelContext) -> LlamaModel:
    """Rank ``ctx.rank``'s model on the meta device: its layers say which rows of each tensor the
    rank holds (``held_rows``), without a byte of weights."""
    with torch.device("meta"):
        return native_model_class(cfg)(cfg, ctx=ctx)


def hf_shard_tensors(path: Path, cfg: LlamaConfig, ctx: ParallelContext):
    """Yield (parameter name, this rank's slice) from a float safetensors checkpoint."""
    from safetensors import safe_open


    model = rank_model(cfg, ctx)
    if cfg.extra.get(FUSED):  # Phi-3: fused qkv_proj / gate_up_proj read whole, cut apart, then sliced
        for name, w in split_fused(_plain_tensors(path, cfg), cfg):
            cut = held_rows(model, name)
            yield name, w if cut is None else w[cut[0]:cut[1]].contiguous()
        return
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                name = hf_param_name(key, cfg, f.name)
                if name is None:
                    continue
                cut = held_rows(model, name)
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
