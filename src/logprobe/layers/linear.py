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
        return tiled_linear(x, self.weight, self.bias, self.row_tile)


def _triton() -> bool:
    from ..kernels import triton_available

    return triton_available()


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` [T, out] computed as products of exactly ``tile`` rows, each
    written straight into its rows of the output (no concatenation: copying every layer's output
    once more cost ~9% of a deterministic 8B forward on an H100); only a partial last tile goes
    through a zero-padded buffer. Every product has one shape, hence one BLAS kernel."""
    x = x.contiguous()
    T = x.shape[0]
    out = x.new_empty(T, weight.shape[0])  # [T, out]
    wt = weight.t()  # [in, out], the layout F.linear hands to BLAS

    def mm(a: torch.Tensor, o: torch.Tensor) -> None:
        if bias is None:
            torch.mm(a, wt, out=o)
        else:
            torch.addmm(bias, a, wt, out=o)

    full = T - T % tile
    for i in range(0, full, tile):
        mm(x[i:i + tile], out[i:i + tile])
    if full < T:
        xp = x.new_zeros(tile, x.shape[1])  # [tile, in]
        xp[: T - full] = x[full:]
        op = x.new_empty(tile, weight.shape[0])  # [tile, out]
        mm(xp, op)
        out[full:] = op[: T - full]
    return out


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

