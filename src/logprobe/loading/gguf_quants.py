"""Dequantization of GGUF tensor types, in PyTorch (reference layouts from ggml's block formats).

Each quantized type stores rows of blocks of 32 weights:
    Q8_0: f16 d, 32 x int8 q                 w = d * q
    Q4_0: f16 d, 16 bytes of nibbles         w = d * (q - 8)
    Q4_1: f16 d, f16 m, 16 bytes of nibbles  w = d * q + m
Nibbles: byte j holds element j (low 4 bits) and element j + 16 (high 4 bits).
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
# ggml type id -> (name, bytes per block of 32, or None for plain float types)
GGML_TYPES = {0: ("F32", None), 1: ("F16", None), 30: ("BF16", None),
              8: ("Q8_0", 34), 2: ("Q4_0", 18), 3: ("Q4_1", 20)}


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [..., 16] uint8 -> [..., 32] values 0..15."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def dequantize(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: the tensor's bytes (or typed array) as the GGUF reader gives them -> float32 [shape]."""
    name, block_bytes = GGML_TYPES[type_id]
    data = torch.from_numpy(np.array(raw, copy=True))
    if name == "F32":
        return data.view(torch.float32).reshape(shape).clone()
    if name == "F16":
        return data.view(torch.float16).reshape(shape).float()
    if name == "BF16":
        return data.view(torch.int16).view(torch.bfloat16).reshape(shape).float()
    blocks = data.view(torch.uint8).reshape(-1, block_bytes)  # [n_blocks, bytes]
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n_blocks, 1]
    if name == "Q8_0":
        q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n_blocks, 32]
        w = d * q
    elif name == "Q4_0":
        w = d * (_nibbles(blocks[:, 2:]).float() - 8.0)
    else:  # Q4_1
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        w = d * _nibbles(blocks[:, 4:]).float() + m
    return w.reshape(shape)
