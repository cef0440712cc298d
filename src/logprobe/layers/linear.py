"""Linear layers behind one interface: ``forward(x [T, in]) -> [T, out]``.

The dense layer lives here; quantized (packed, ``quant_linear``) and tensor-parallel
(``parallel_linear``) layers implement the same forward so model files never change when the
weight format or the GPU count does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import triton_available
from ..kernels.matmul import config_leaving, invariant_linear
from .activation import silu_mul
from .numerics import NumericsUser


class Linear(NumericsUser, nn.Module):
    """``y = x W^T (+ b)``: x [T, in] -> [T, out], computed as ``self.numerics`` says.

    Deterministic mode (``numerics.row_tile`` set): each row's result is bitwise independent of
    how many rows came with it: rows are multiplied in fixed tiles of that many rows (the last one
    zero-padded), since BLAS and cuBLAS pick their kernel from the matrix shape and a fixed shape
    pins it. ``numerics.matmul == "triton"`` uses the Triton matmul of ``kernels.matmul`` on CUDA
    instead (one fixed tile shape, no split-K: invariant by construction). With
    ``numerics.column_blocks`` the output columns are also computed in ``col_blocks`` (set by the
    column-parallel layers from the model's block count), so a column's bits do not depend on how
    many other columns its rank holds.
    """

    fusable = True  # a plain dense product (packed and row-gathered layers say False)
    # deterministic mode's column blocks (widths summing to out_features; None: one block), set by
    # the column-parallel layers and adopted by the packed layers that replace them
    col_blocks: list[int] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)

    @property
    def blocks(self) -> list[int] | None:
        """The column blocks this layer's products honour now: ``col_blocks`` when the numerics
        ask for them, else None."""
        return self.col_blocks if self.numerics.column_blocks else None

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` under this layer's numerics: one product, or deterministic
        mode's (fixed row tiles, and column blocks). Packed layers call it with their expanded weight."""
        n = self.numerics
        if n.row_tile is None:
            return F.linear(x, weight, bias)
        return deterministic_product(x, weight, bias, n.row_tile, self.blocks, n.matmul, n.collective_sms)

    def gated(self, gate: torch.Tensor, up: torch.Tensor, triton: bool = False) -> torch.Tensor:
        """This layer applied to the gated activation, ``self(silu_mul(gate, up, triton))`` (a Llama
        MLP's down projection): gate, up [T, I] -> [T, out]. A layer that quantizes its input fuses
        the two (``ActQuantLinear``: one pass computes and quantizes SiLU(gate) * up)."""
        return self(silu_mul(gate, up, triton))


def float32_product(layer: Linear, xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """xq [T, in] @ w [out, in]^T (+ the layer's bias), all float32, the way ``layer`` is set up:
    fixed row tiles (and column blocks) in deterministic mode, one product otherwise. The
    fake-quantized layers (FP8/INT8/FP4 activations) end with it."""
    bias = None if layer.bias is None else layer.bias.float()
    if layer.numerics.row_tile is None:
        return F.linear(xq, w, bias)
    return tiled_linear(xq, w, bias, layer.numerics.row_tile, layer.blocks)


def numerics_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, numerics) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` under ``numerics`` (a ``config.Numerics``) for a matrix held
    outside a ``Linear`` (a vision tower's patch embedding, the checkpoint's convolution; a
    projector's bare matrix): one product, or deterministic mode's fixed row tiles (no column
    blocks: such a matrix is whole on every rank), so a row's bits follow neither the row count
    nor the BLAS thread count."""
    if numerics.row_tile is None:
        return F.linear(x, weight, bias)
    return deterministic_product(x, weight, bias, numerics.row_tile, None, numerics.matmul, numerics.collective_sms)


def deterministic_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_tile: int,
                          col_blocks: list[int] | None, kernel: str = "cublas", free_sms: int = 0) -> torch.Tensor:
    """Deterministic mode's ``F.linear``: a row's bits independent of the other rows, and (with
    ``col_blocks``) a column's bits independent of the other columns. On CUDA the Triton
    fixed-tile matmul gives both by construction (every output tile is one program with the same
    K loop), so many narrow column blocks run there instead of as narrow cuBLAS products.
    ``free_sms``: multiprocessors that matmul leaves to the collectives running beside it
    (``Numerics.collective_sms``; the same bits)."""
    if x.is_cuda and x.dim() == 2 and cuda_product(kernel, col_blocks) == "triton" and _triton():
        return invariant_linear(x, weight, bias, config_leaving(free_sms))
    return tiled_linear(x, weight, bias, row_tile, col_blocks)


def cuda_product(kernel: str, col_blocks: list[int] | None) -> str:
    """Which product ``deterministic_product`` runs on CUDA: "triton" (the fixed-tile matmul, the
    same bits for any subset of columns) or "cublas" (fixed row tiles of cuBLAS, each column block
    one product). A layer must take the same one at every TP size, or its columns round otherwise.

    >>> cuda_product("cublas", [64, 64]), cuda_product("cublas", None), cuda_product("triton", None)
    ('triton', 'cublas', 'triton')
    """
    return "triton" if kernel == "triton" or col_blocks else "cublas"


def _triton() -> bool:
    return triton_available()


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int,
                 col_blocks: list[int] | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` [T, out] computed as products of exactly ``tile`` rows (and,
    with ``col_blocks``, of those output-column widths), each written straight into its part of
    the output (no concatenation: copying every layer's output once more cost ~9% of a
    deterministic 8B forward on an H100); only a partial last row tile goes through a zero-padded
    buffer. Every product has one shape, hence one BLAS kernel. ``out_dtype`` (float32 for 16-bit
    inputs): the products' own accumulation precision, kept instead of rounded to ``x.dtype``."""
    x = x.contiguous()
    T = x.shape[0]
    dtype = out_dtype or x.dtype
    out = x.new_empty(T, weight.shape[0], dtype=dtype)  # [T, out]
    wt = weight.t()  # [in, out], the layout F.linear hands to BLAS
    blocks, c0 = [], 0
    for width in col_blocks or [weight.shape[0]]:
        blocks.append((c0, c0 + width))
        c0 += width

    def mm(a: torch.Tensor, o: torch.Tensor) -> None:
        for b0, b1 in blocks:
            w = wt[:, b0:b1] if len(blocks) > 1 else wt
            ob = o[:, b0:b1] if len(blocks) > 1 else o
            if dtype != a.dtype:
                ob.copy_(_mm_wide(a, w, dtype))
            elif bias is None and ob.is_contiguous():
                torch.mm(a, w, out=ob)
            elif ob.is_contiguous():
                torch.addmm(bias[b0:b1], a, w, out=ob)
            else:
                ob.copy_(torch.mm(a, w) if bias is None else torch.addmm(bias[b0:b1], a, w))
        if dtype != a.dtype and bias is not None:
            o += bias.to(dtype)

    full = T - T % tile
    for i in range(0, full, tile):
        mm(x[i:i + tile], out[i:i + tile])
    if full < T:
        xp = x.new_zeros(tile, x.shape[1])  # [tile, in]
        xp[: T - full] = x[full:]
        op = x.new_empty(tile, weight.shape[0], dtype=dtype)  # [tile, out]
        mm(xp, op)
        out[full:] = op[: T - full]
    return out


def _mm_wide(a: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ w with ``dtype`` (float32) output: cuBLAS's float32 accumulator kept where torch offers
    it for 16-bit inputs, else the product of float32 copies (CPU: exact float32 products)."""
    if a.is_cuda:
        try:
            return torch.mm(a, w, out_dtype=dtype)
        except (TypeError, RuntimeError):
            pass
    return torch.mm(a.to(dtype), w.to(dtype))


def fuse_linears(parts: list[Linear]) -> Linear | None:
    """One Linear computing ``parts`` side by side (their outputs concatenated), or None when they
    cannot be fused (not all plain dense layers of one input width, dtype and device). The parts'
    weights become views into the fused weight, so no memory is duplicated and their parameter
    names still load and save. Parts all of one class with a ``fuse_parts`` classmethod are fused
    by it (a packed layer's own rules: ``ActQuantLinear``), None where it says they cannot be."""
    if not parts:
        return None
    own = getattr(type(parts[0]), "fuse_parts", None)
    if own is not None and all(type(p) is type(parts[0]) for p in parts):
        return own(parts)
    if any(not isinstance(p, Linear) or not p.fusable for p in parts):
        return None
    first = parts[0]
    if any(p.in_features != first.in_features or p.weight.dtype != first.weight.dtype
           or p.weight.device != first.weight.device or (p.bias is None) != (first.bias is None) for p in parts):
        return None
    with torch.device("meta"):
        fused = Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None)
    fused.numerics = first.numerics  # the parts' (they all hold the model's)
    if all(p.col_blocks for p in parts):
        fused.col_blocks = [w for p in parts for w in p.col_blocks]
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

