"""Deterministic mode's row-parallel product in one Triton kernel: ``y = x @ W.T`` in float32 with
the inner dimension cut into ``S`` equal slices whose partial products are added by the fixed
pairwise tree of ``parallel.shard.tree_order`` — in registers, instead of S narrow GEMMs each
writing a float32 [M, N] partial to memory (docs/perf.md: 6.4x a plain product for llama-8b's o).

Every output tile is one program; slice j is its own K loop of ``tl.dot`` from a zero float32
accumulator over columns j*K/S .. (j+1)*K/S in BLOCK_K steps, so a slice's partial is the same
bits wherever it is computed; the partials are folded as a binary counter (slice 0, 1 -> p0+p1;
2, 3 -> p2+p3 -> (p0+p1)+(p2+p3); ...), which is exactly the tree's additions. So a rank that
holds slices 4..7 of a TP = 2 split computes (p4+p5)+(p6+p7) as the TP = 1 kernel does inside its
own sum, and the rank totals' sum is the tree's last addition: identical bits at every TP size.
Rows never interact (no split-K), so it is batch-invariant too.

``sliced_linear_reference`` is the same function in PyTorch (per-slice float32 products and the
same tree); it is what CPUs run and what the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LogprobeError
from . import triton_available

MAX_SLICES = 8

if triton_available():
    import triton
    import triton.language as tl

    from .matmul import grouped_tile

    @triton.jit(do_not_specialize=["M"])
    def _sliced_matmul(x_ptr, w_ptr, y_ptr, M, N, K, KS, stride_xm, stride_wn, stride_ym,
                       SLICES: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        rk = tl.arange(0, BLOCK_K)  # [BK]
        a0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # the binary counter's levels
        a1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        a2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(SLICES):
            p = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            k_end = (j + 1) * KS
            for k0 in range(j * KS, k_end, BLOCK_K):
                kk = k0 + rk
                x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                            mask=(rm[:, None] < M) & (kk[None, :] < k_end), other=0.0)  # [BM, BK]
                w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + kk[:, None],
                            mask=(rn[None, :] < N) & (kk[:, None] < k_end), other=0.0)  # [BK, BN]
                if IEEE:
                    p = tl.dot(x, w, p, input_precision="ieee")
                else:
                    p = tl.dot(x, w, p)
            if j % 2 == 0:
                a0 = p
                out = p
            else:
                c1 = a0 + p
                out = c1
                if (j // 2) % 2 == 0:
                    a1 = c1
                else:
                    c2 = a1 + c1
                    out = c2
                    if (j // 4) % 2 == 0:
                        a2 = c2
                    else:
                        out = a2 + c2
        yp = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(yp, out, mask=(rm[:, None] < M) & (rn[None, :] < N))


@dataclass(frozen=True, slots=True)
class SlicedConfig:
    """Tile shape: narrower than the plain matmul's, since up to four float32 accumulators live
    in registers at once."""

    block_m: int = 128
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


DEFAULT_CONFIG = SlicedConfig()


def _check_slices(K: int, slices: int) -> None:
    if slices < 1 or slices > MAX_SLICES or slices & (slices - 1):
        raise LogprobeError("slices", f"must be a power of two <= {MAX_SLICES}, got {slices}")
    if K % slices:
        raise LogprobeError("slices", f"{slices} slices do not divide the inner dimension {K}")


def sliced_linear_reference(x: torch.Tensor, weight: torch.Tensor, slices: int) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T as float32 per-slice products added by the pairwise tree."""
    from ..parallel.shard import tree_order

    _check_slices(x.shape[1], slices)
    ks = x.shape[1] // slices
    parts = [x[:, j * ks:(j + 1) * ks].float() @ weight[:, j * ks:(j + 1) * ks].float().T for j in range(slices)]
    for i, j in tree_order(slices):
        parts[i] = parts[i] + parts[j]
    return parts[0]


def sliced_linear(x: torch.Tensor, weight: torch.Tensor, slices: int,
                  config: SlicedConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> float32 [M, N], ``slices`` fixed inner slices in tree order."""
    from .matmul import check_operands

    x, weight = check_operands(x, weight, "the sliced matmul")
    M, K = x.shape
    N = weight.shape[0]
    _check_slices(K, slices)
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0:
        return y
    c = config
    grid = (triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n),)
    _sliced_matmul[grid](x, weight, y, M, N, K, K // slices, x.stride(0), weight.stride(0), y.stride(0),
                         SLICES=slices, IEEE=x.dtype == torch.float32, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                         BLOCK_K=c.block_k, GROUP_M=c.group_m, num_warps=c.num_warps, num_stages=c.num_stages)
    return y
