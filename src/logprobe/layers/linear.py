"""Linear layers behind one interface: ``forward(x [T, in]) -> [T, out]``.

Today only the dense layer exists; quantized (packed) and tensor-parallel layers implement the
same forward so model files never change when the weight format does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``row_tile``: when set, each row's result is bitwise independent of how many rows came
    with it (batch invariance): rows are multiplied in fixed tiles of that many rows (the last
    one zero-padded), since BLAS and cuBLAS pick their kernel from the matrix shape and a fixed
    shape pins it. ``invariant_kernel = "triton"`` uses the Triton matmul of ``kernels.matmul``
    on CUDA instead (one fixed tile shape, no split-K: invariant by construction)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, row_tile: int | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.row_tile = row_tile
        self.invariant_kernel = "cublas"
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile is None:
            return F.linear(x, self.weight, self.bias)
        if self.invariant_kernel == "triton" and x.is_cuda and x.dim() == 2 and _triton():
            from ..kernels.matmul import invariant_linear

            return invariant_linear(x, self.weight, self.bias)
        return tiled_rows(lambda t: F.linear(t, self.weight, self.bias), x, self.row_tile)


def _triton() -> bool:
    from ..kernels import triton_available

    return triton_available()


def tiled_rows(fn, x: torch.Tensor, tile: int) -> torch.Tensor:
    """fn applied to x [T, ...] in tiles of exactly ``tile`` rows; the result has T rows."""
    T = x.shape[0]
    pad = (-T) % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])  # [T + pad, ...]
    return torch.cat([fn(x[i:i + tile]) for i in range(0, T + pad, tile)])[:T]


def fuse_linears(parts: list[Linear]) -> Linear | None:
    """One Linear computing ``parts`` side by side (their outputs concatenated), or None when they
    cannot be fused (not all plain dense layers of one input width, dtype and device). The parts'
    weights become views into the fused weight, so no memory is duplicated and their parameter
    names still load and save."""
    if not parts or any(type(p) is not Linear for p in parts):
        return None
    first = parts[0]
    if any(p.in_features != first.in_features or p.weight.dtype != first.weight.dtype
           or p.weight.device != first.weight.device or (p.bias is None) != (first.bias is None) for p in parts):
        return None
    with torch.device("meta"):
        fused = Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None)
    fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)  # [sum out, in]
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    offset = 0
    for p in parts:
        rows = slice(offset, offset + p.out_features)
        p.weight = nn.Parameter(fused.weight[rows], requires_grad=False)
        if p.bias is not None:
            p.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
        offset += p.out_features
    return fused

