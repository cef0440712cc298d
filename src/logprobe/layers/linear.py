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
    with it (batch invariance): on CPU rows are multiplied in fixed tiles of that many rows (the
    last one zero-padded), since BLAS picks its blocking from the matrix shape and a fixed shape
    pins it; on CUDA the Triton matmul of ``kernels.matmul`` (one fixed tile shape, no split-K)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, row_tile: int | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.row_tile = row_tile
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile is None:
            return F.linear(x, self.weight, self.bias)
        if x.is_cuda and x.dim() == 2 and _triton():
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
