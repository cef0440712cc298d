"""Dequantization of GGUF tensor types, in PyTorch (reference layouts from ggml's block formats).

Each quantized type stores rows of blocks of 32 weights:
    Q8_0: f16 d, 32 x int8 q                 w = d * q
    Q4_0: f16 d, 16 bytes of nibbles         w = d * (q - 8)
    Q4_1: f16 d, f16 m, 16 bytes of nibbles  w = d * q + m
Nibbles: byte j holds element j (low 4 bits) and element j + 16 (high 4 bits).

and the k-quants super-blocks of 256 (ggml's ``block_q4_K`` / ``block_q6_K``):
    Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32, 128 bytes
          of nibbles (64 values per 32 bytes: low nibbles then high)
                                             w = (d * sc_j) * q - dmin * m_j
    Q6_K: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 values), f16 d
                                             w = (d * sc_j) * (q - 32)

``split_blocks`` keeps a quantized matrix packed (scales and codes as separate tensors) and
``dequantize_blocks`` expands any rows of it; the dense loader and the packed layers
(``layers.quant_linear``) both go through ``dequantize_blocks``, so their weights are bitwise equal.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import LogprobeError

BLOCK = 32
# ggml type id -> (name, bytes per block, or None for plain float types)
GGML_TYPES = {0: ("F32", None), 1: ("F16", None), 30: ("BF16", None),
              8: ("Q8_0", 34), 2: ("Q4_0", 18), 3: ("Q4_1", 20), 12: ("Q4_K", 144), 14: ("Q6_K", 210)}
QUANT_NAMES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
K_QUANTS = ("Q4_K", "Q6_K")


def block_values(name: str) -> int:
    """Weights per block: 256 for the k-quants, 32 for the others."""
    return 256 if name in K_QUANTS else BLOCK


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [..., 16] uint8 -> [..., 32] values 0..15."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def split_blocks(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """A quantized tensor's bytes -> {"d": f16 [rows, nb], "m": f16 [rows, nb] (Q4_1; Q4_K's dmin),
    "qs": [rows, nb, 16] uint8 nibbles (Q4_0/1), [rows, nb, 32] int8 (Q8_0), or the rest of each
    k-quant super-block as uint8 (Q4_K: 12 scale bytes + 128 nibble bytes; Q6_K: 208 bytes before
    d)}, nb = cols / block_values(name)."""
    name, block_bytes = GGML_TYPES[type_id]
    rows, cols = (int(np.prod(shape[:-1])), int(shape[-1]))
    data = torch.from_numpy(np.array(raw, copy=True)).view(torch.uint8)
    if cols % block_values(name):
        raise LogprobeError("model", f"a {name} tensor of shape {tuple(shape)} has rows of {cols} weights, not a "
                            f"multiple of its block of {block_values(name)}: the file is damaged")
    blocks = data.reshape(rows, cols // block_values(name), block_bytes)  # [rows, nb, bytes]
    if name == "Q6_K":  # d comes last in this block
        return {"d": blocks[..., 208:210].contiguous().view(torch.float16)[..., 0],
                "qs": blocks[..., :208].contiguous()}  # [rows, nb, 208]
    out = {"d": blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]}  # [rows, nb]
    if name == "Q4_K":
        out["m"] = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]  # dmin [rows, nb]
        out["qs"] = blocks[..., 4:].contiguous()  # [rows, nb, 140]
    elif name == "Q8_0":
        out["qs"] = blocks[..., 2:].contiguous().view(torch.int8)  # [rows, nb, 32]
    elif name == "Q4_0":
        out["qs"] = blocks[..., 2:].contiguous()  # [rows, nb, 16]
    else:  # Q4_1
        out["m"] = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]  # [rows, nb]
        out["qs"] = blocks[..., 4:].contiguous()  # [rows, nb, 16]
    return out


def dequantize_blocks(name: str, d: torch.Tensor, qs: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """d [r, nb] f16, qs [r, nb, bytes] (, m [r, nb]) -> float32 [r, nb * block_values(name)]."""
    if name == "Q4_K":
        return _dequantize_q4_k(d, m, qs)
    if name == "Q6_K":
        return _dequantize_q6_k(d, qs)
    df = d.float()[..., None]  # [r, nb, 1]
    if name == "Q8_0":
        w = df * qs.float()
    elif name == "Q4_0":
        w = df * (_nibbles(qs).float() - 8.0)
    else:  # Q4_1
        w = df * _nibbles(qs).float() + m.float()[..., None]
    return w.reshape(d.shape[0], -1)  # [r, nb * 32]


def _dequantize_q4_k(d: torch.Tensor, dmin: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    r, nb = d.shape
    sb, q = rest[..., :12], rest[..., 12:]  # [r, nb, 12] scale bytes, [r, nb, 128] nibbles
    # 8 six-bit scales and mins: sub-blocks 0-3 in the low bits of bytes 0-3 / 4-7, sub-blocks
    # 4-7 in bytes 8-11 (low / high nibble) plus the top two bits of bytes 0-3 / 4-7
    sc = torch.cat([sb[..., 0:4] & 63, (sb[..., 8:12] & 0x0F) | ((sb[..., 0:4] >> 6) << 4)], dim=-1)  # [r, nb, 8]
    mn = torch.cat([sb[..., 4:8] & 63, (sb[..., 8:12] >> 4) | ((sb[..., 4:8] >> 6) << 4)], dim=-1)  # [r, nb, 8]
    q = q.reshape(r, nb, 4, 32)  # 4 groups of 32 bytes: low nibbles = sub-block 2c, high = 2c + 1
    vals = torch.stack([q & 0x0F, q >> 4], dim=3).reshape(r, nb, 8, 32).float()  # [r, nb, 8, 32]
    scale = (d.float()[..., None] * sc.float())[..., None]  # [r, nb, 8, 1], d * sc first, as ggml
    mins = (dmin.float()[..., None] * mn.float())[..., None]
    return (scale * vals - mins).reshape(r, nb * 256)


def _dequantize_q6_k(d: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    r, nb = d.shape
    ql = rest[..., :128].reshape(r, nb, 2, 64)  # two halves of 128 values
    qh = rest[..., 128:192].reshape(r, nb, 2, 32)
    sc = rest[..., 192:208].contiguous().view(torch.int8)  # [r, nb, 16], one per 16 values in order
    lo, hi = ql[..., :32], ql[..., 32:]
    # value 32 i + l of a half (i = 0..3): a nibble of ql and two bits of qh[l], minus 32
    q = torch.stack([(lo & 0x0F) | ((qh & 3) << 4), (hi & 0x0F) | (((qh >> 2) & 3) << 4),
                     (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)], dim=3)  # [r, nb, 2, 4, 32]
    vals = (q.reshape(r, nb, 16, 16).float() - 32.0)  # [r, nb, 16 groups, 16]
    scale = (d.float()[..., None] * sc.float())[..., None]  # [r, nb, 16, 1]
    return (scale * vals).reshape(r, nb * 256)


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
