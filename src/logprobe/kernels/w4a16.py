"""W4A16 dequant-GEMM in Triton: y = x @ dequant(W).T with W kept as packed int4 codes.

Layout (compressed-tensors ``pack-quantized``, see ``layers.quant_linear.CTLinear``):

    qweight [N, ceil(K / 8)] int32   element k of row n: bits 4 * (k % 8) of word k // 8, stored + 8
    scale   [N, G]  (G = ceil(K / group_size))
    zero    [N, G]  int8, or none (symmetric)
    W[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group]

Program (m, n) owns a [BLOCK_M, BLOCK_N] tile of y. Its K loop loads a [BLOCK_M, BLOCK_K] tile
of x and the [BLOCK_K, BLOCK_N] tile of packed words (each word read once per 8 k's from L1/L2),
expands the nibbles, applies the group's scale (and zero point) in float32, rounds the weight to
x's dtype exactly as the reference does (``F.linear(x, W.to(x.dtype))``) and accumulates
``tl.dot`` in float32. When ``group_size`` is a multiple of BLOCK_K, a K tile lies inside one group
and its scales are one row of BLOCK_N values instead of a [BLOCK_K, BLOCK_N] gather.

``w4a16_reference`` is the pure-PyTorch definition the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import LogprobeError
from . import triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _w4a16_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, group_size,
                      stride_xm, stride_qn, stride_sn, stride_zn, stride_ym,
                      HAS_ZERO: tl.constexpr, GROUP_ALIGNED: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            kn_ok = k_ok[:, None] & n_ok[None, :]
            words = tl.load(q_ptr + rn[None, :] * stride_qn + (k // 8)[:, None], mask=kn_ok, other=0)  # [BK, BN]
            q = ((words >> ((k % 8) * 4)[:, None]) & 0xF) - 8
            w = q.to(tl.float32)
            if GROUP_ALIGNED:
                g = k0 // group_size
                s = tl.load(s_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[None, :]  # [1, BN]
                if HAS_ZERO:
                    z = tl.load(z_ptr + rn * stride_zn + g, mask=n_ok, other=0).to(tl.float32)[None, :]
                    w = w - z
            else:
                g = (k // group_size)[:, None]
                s = tl.load(s_ptr + rn[None, :] * stride_sn + g, mask=kn_ok, other=0.0).to(tl.float32)  # [BK, BN]
                if HAS_ZERO:
                    z = tl.load(z_ptr + rn[None, :] * stride_zn + g, mask=kn_ok, other=0).to(tl.float32)
                    w = w - z
            w = (w * s).to(x.dtype)
            acc += tl.dot(x, w)
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


_STAGES: dict[tuple[int, int, int], int] = {}  # tile -> pipeline stages that fit this GPU's shared memory


@dataclass(slots=True, frozen=True)
class W4A16Config:
    """Tile sizes (powers of two, >= 16 for tl.dot). ``None`` block_m picks by M. A tile that needs
    more shared memory than the GPU has runs with fewer stages (then fewer rows) instead."""

    block_m: int | None = None
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def dequantize_w4(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int,
                  K: int) -> torch.Tensor:
    """float32 [N, K] weights of the layout above (the reference's definition)."""
    from ..layers.quant_linear import unpack_int32

    q = unpack_int32(qweight, 4, K).float()  # [N, K]
    g = torch.arange(K, device=q.device) // group_size  # [K] group of each column
    if zero is not None:
        q = q - zero.float()[:, g]
    return q * scale.float()[:, g]


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:
    """x [M, K] -> [M, N]: F.linear on the weights expanded in float32 and rounded to x's dtype."""
    return F.linear(x, dequantize_w4(qweight, scale, zero, group_size, x.shape[1]).to(x.dtype))


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 group_size: int, config: W4A16Config | None = None) -> torch.Tensor:
    """x [M, K] (float16/bfloat16 on CUDA; float32 too under the interpreter) -> y [M, N] in x's dtype."""
    if not triton_available():
        raise LogprobeError("backend", "the W4A16 kernel needs Triton", "pip install triton, or run on CPU")
    if x.ndim != 2 or x.stride(-1) != 1:
        raise LogprobeError("x", f"must be a 2-D tensor with contiguous rows, got shape {tuple(x.shape)}")
    M, K = x.shape
    N = qweight.shape[0]
    G = -(-K // group_size)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (N, -(-K // 8)):
        raise LogprobeError("qweight", f"must be int32 [N, {-(-K // 8)}], got {qweight.dtype} {tuple(qweight.shape)}")
    if tuple(scale.shape) != (N, G) or (zero is not None and tuple(zero.shape) != (N, G)):
        raise LogprobeError("scale", f"scale/zero must be [{N}, {G}] for K={K}, group {group_size}")
    cfg = config or W4A16Config()
    block_m = cfg.block_m or (16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128)
    qweight, scale = qweight.contiguous(), scale.contiguous()
    zero = zero.contiguous() if zero is not None else None
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    stages = _STAGES.get((block_m, cfg.block_n, cfg.block_k), cfg.num_stages)
    while True:
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, cfg.block_n))
        try:
            _w4a16_kernel[grid](
                x, qweight, scale, zero if zero is not None else scale, y, M, N, K, group_size,
                x.stride(0), qweight.stride(0), scale.stride(0), zero.stride(0) if zero is not None else 0,
                y.stride(0), HAS_ZERO=zero is not None, GROUP_ALIGNED=group_size % cfg.block_k == 0,
                BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
                num_stages=stages)
            break
        except triton.runtime.errors.OutOfResources:
            # too much shared memory for this GPU: fewer pipeline stages, then shorter row tiles
            if stages > 1:
                stages -= 1
            elif block_m > 16:
                block_m //= 2
                stages = cfg.num_stages
            else:
                raise
    _STAGES[(block_m, cfg.block_n, cfg.block_k)] = stages
    return y
