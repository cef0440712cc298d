"""Dequantization of GGUF tensor types, in PyTorch (reference layouts from ggml's block formats).

Each quantized type stores rows of blocks of 32 weights:
    Q8_0: f16 d, 32 x int8 q                 w = d * q
    Q4_0: f16 d, 16 bytes of nibbles         w = d * (q - 8)
    Q4_1: f16 d, f16 m, 16 bytes of nibbles  w = d * q + m
Nibbles: byte j holds element j (low 4 bits) and element j + 16 (high 4 bits).

``split_blocks`` keeps a quantized matrix packed (scales and codes as separate tensors) and
``dequantize_blocks`` expands any rows of it; the dense loader and the packed layers
(``layers.quant_linear``) both go through ``dequantize_blocks``, so their weights are bitwise equal.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
# ggml type id -> (name, bytes per block of 32, or None for plain float types)
GGML_TYPES = {0: ("F32", None), 1: ("F16", None), 30: ("BF16", None),
              8: ("Q8_0", 34), 2: ("Q4_0", 18), 3: ("Q4_1", 20)}
QUANT_NAMES = ("Q8_0", "Q4_0", "Q4_1")


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [..., 16] uint8 -> [..., 32] values 0..15."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def split_blocks(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """A quantized tensor's bytes -> {"d": f16 [rows, nb], "m": f16 [rows, nb] (Q4_1 only),
    "qs": [rows, nb, 16] uint8 nibbles (Q4_*) or [rows, nb, 32] int8 (Q8_0)}, nb = cols / 32."""
    name, block_bytes = GGML_TYPES[type_id]
    rows, cols = (int(np.prod(shape[:-1])), int(shape[-1]))
    data = torch.from_numpy(np.array(raw, copy=True)).view(torch.uint8)
    blocks = data.reshape(rows, cols // BLOCK, block_bytes)  # [rows, nb, bytes]
    out = {"d": blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]}  # [rows, nb]
    if name == "Q8_0":
        out["qs"] = blocks[..., 2:].contiguous().view(torch.int8)  # [rows, nb, 32]
    elif name == "Q4_0":
        out["qs"] = blocks[..., 2:].contiguous()  # [rows, nb, 16]
    else:  # Q4_1
        out["m"] = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]  # [rows, nb]
        out["qs"] = blocks[..., 4:].contiguous()  # [rows, nb, 16]
    return out


def dequantize_blocks(name: str, d: torch.Tensor, qs: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """d [r, nb] f16, qs [r, nb, 16|32] (, m [r, nb]) -> float32 [r, nb * 32]."""
    df = d.float()[..., None]  # [r, nb, 1]
    if name == "Q8_0":
        w = df * qs.float()
    elif name == "Q4_0":
        w = df * (_nibbles(qs).float() - 8.0)
    else:  # Q4_1
        w = df * _nibbles(qs).float() + m.float()[..., None]
    return w.reshape(d.shape[0], -1)  # [r, nb * 32]


def dequantize(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: the tensor's bytes (or typed array) as the GGUF reader gives them -> float32 [shape]."""
    name, block_bytes = GGML_TYPES[type_id]
    if name in QUANT_NAMES:
        return dequantize_blocks(name, **split_blocks(raw, type_id, shape)).reshape(shape)
    data = torch.from_numpy(np.array(raw, copy=True))
    if name == "F32":
        return data.view(torch.float32).reshape(shape).clone()
    if name == "F16":
        return data.view(torch.float16).reshape(shape).float()
    return data.view(torch.int16).view(torch.bfloat16).reshape(shape).float()  # BF16
