"""W4A16 dequant-GEMM in Triton: y = x @ dequant(W).T with W kept as packed int4 codes.

Layout (compressed-tensors ``pack-quantized``, see ``layers.quant_linear.CTLinear``):

    qweight [N, ceil(K / 8)] int32   element k of row n: bits 4 * (k % 8) of word k // 8, stored + 8
    scale   [N, G]  (G = ceil(K / group_size))
    zero    [N, G]  int8, or none (symmetric)
    W[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group]

Program (m, n) owns a [BLOCK_M, BLOCK_N] tile of y. Its K loop loads a [BLOCK_M, BLOCK_K] tile
of x and the [BLOCK_N, BLOCK_K / 8] tile of packed words (each word once, along its row),
expands the nibbles in registers, applies the group's scale (and zero point) in float32, rounds
the weight to x's dtype exactly as the reference does (``F.linear(x, W.to(x.dtype))``) and
accumulates ``tl.dot`` in float32. When ``group_size`` is a multiple of BLOCK_K, a K tile lies
inside one group and its scales are one column of BLOCK_N values instead of a gather.

Two ways to use it, chosen by rows (``w4a16_linear``): few rows (decode-like, memory-bound) run
the dequant-GEMM, which reads 4-bit weights instead of 16-bit ones; many rows (prefill, scoring:
compute-bound) expand the layer once into a transient 16-bit matrix with ``w4_expand`` (one read
of the packed words, one write) and hand it to cuBLAS, whose tensor-core GEMM no Triton kernel
here beats. Only one layer is ever expanded at a time, so weight memory stays packed.

``w4a16_reference`` is the pure-PyTorch definition the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import LogprobeError
from . import triton_available
from .packing import unpack_int32

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # varies with the batch: one compiled kernel
    def _w4a16_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, group_size,
                      stride_xm, stride_qn, stride_sn, stride_zn, stride_ym,
                      HAS_ZERO: tl.constexpr, GROUP_ALIGNED: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rw = tl.arange(0, BLOCK_K // 8)  # words of one K tile
        shifts = tl.arange(0, 8) * 4  # nibble i of a word holds column 8 * word + i
        words_per_row = (K + 7) // 8
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            # each packed word is loaded once, along the row it is contiguous in (coalesced)
            w_idx = k0 // 8 + rw
            words = tl.load(q_ptr + rn[:, None] * stride_qn + w_idx[None, :],
                            mask=n_ok[:, None] & (w_idx < words_per_row)[None, :], other=0)  # [BN, BK/8]
            q = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BN, BK/8, 8]
            w = (tl.reshape(q, (BLOCK_N, BLOCK_K)) - 8).to(tl.float32)  # [BN, BK] signed codes
            if GROUP_ALIGNED:
                g = k0 // group_size
                s = tl.load(s_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]  # [BN, 1]
                if HAS_ZERO:
                    w = w - tl.load(z_ptr + rn * stride_zn + g, mask=n_ok, other=0).to(tl.float32)[:, None]
            else:
                g = (k // group_size)[None, :]
                nk_ok = n_ok[:, None] & k_ok[None, :]
                s = tl.load(s_ptr + rn[:, None] * stride_sn + g, mask=nk_ok, other=0.0).to(tl.float32)  # [BN, BK]
                if HAS_ZERO:
                    w = w - tl.load(z_ptr + rn[:, None] * stride_zn + g, mask=nk_ok, other=0).to(tl.float32)
            # the weight rounded to x's dtype exactly as the reference rounds it
            w = (w * s).to(x.dtype)
            acc += tl.dot(x, tl.trans(w))
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _w4_expand_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, group_size, stride_qn, stride_sn, stride_zn, stride_wn,
                          HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        k = k0 + tl.arange(0, BLOCK_K)
        n_ok = rn < N
        words = tl.load(q_ptr + rn[:, None] * stride_qn + rw[None, :],
                        mask=n_ok[:, None] & (rw < (K + 7) // 8)[None, :], other=0)  # [BN, BK/8]
        q = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [BN, BK/8, 8]
        w = (tl.reshape(q, (BLOCK_N, BLOCK_K)) - 8).to(tl.float32)  # [BN, BK]
        nk_ok = n_ok[:, None] & (k < K)[None, :]
        g = (k // group_size)[None, :]
        if HAS_ZERO:
            w = w - tl.load(z_ptr + rn[:, None] * stride_zn + g, mask=nk_ok, other=0).to(tl.float32)
        w = w * tl.load(s_ptr + rn[:, None] * stride_sn + g, mask=nk_ok, other=0.0).to(tl.float32)
        tl.store(w_ptr + rn[:, None] * stride_wn + k[None, :], w.to(w_ptr.dtype.element_ty), mask=nk_ok)


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


def w4_expand(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int, K: int,
              dtype: torch.dtype) -> torch.Tensor:
    """The layer's weight [N, K] in ``dtype``, expanded in one pass (Triton): bitwise
    ``dequantize_w4(...).to(dtype)``."""
    if not triton_available():
        raise LogprobeError("backend", "the W4A16 kernel needs Triton", "pip install triton, or run on CPU")
    N = qweight.shape[0]
    qweight, scale = qweight.contiguous(), scale.contiguous()
    zero = zero.contiguous() if zero is not None else None
    w = torch.empty(N, K, dtype=dtype, device=qweight.device)
    BN, BK = 32, 128
    _w4_expand_kernel[(triton.cdiv(N, BN), triton.cdiv(K, BK))](
        qweight, scale, zero if zero is not None else scale, w, N, K, group_size, qweight.stride(0), scale.stride(0),
        zero.stride(0) if zero is not None else 0, w.stride(0), HAS_ZERO=zero is not None, BLOCK_N=BN, BLOCK_K=BK,
        num_warps=4)
    return w


EXPAND_MIN_ROWS = 256  # from bench/gpu_w4a16.py (then gpu_scoring.py --sections quant) on an H100 (docs/perf.md)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 group_size: int, expand_min_rows: int = EXPAND_MIN_ROWS) -> torch.Tensor:
    """x [M, K] -> [M, N]: the dequant-GEMM for fewer than ``expand_min_rows`` rows, else one
    transient expanded layer and cuBLAS. Both use the reference's rounded weights."""
    if x.shape[0] < expand_min_rows:
        return w4a16_matmul(x, qweight, scale, zero, group_size)
    return F.linear(x, w4_expand(qweight, scale, zero, group_size, x.shape[1], x.dtype))
