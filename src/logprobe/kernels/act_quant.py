"""8-bit activation-quantized GEMMs in Triton: FP8 (e4m3) and INT8 W8A8 (``layers.act_quant_linear``).

Three kernels, each beside its PyTorch definition (``quantize_rows_reference``,
``scaled_matmul_reference``, ``silu_mul_quantize_reference``):

1. ``quantize_rows``: x [T, K] (any float dtype) -> codes [T, K] (float8_e4m3fn or int8) and scales
   [T, G] float32, one program per (row, group of ``group`` columns), by the format's rule
   (compressed-tensors ``forward_quantize``; ``layers.act_quant_linear`` states it):

       s    = max(|min(x, 0)|, max(x, 0)) / half_range     (448 for e4m3, 127.5 for int8; 0 -> fp32 eps)
       code = round(clamp(x / s, qmin, qmax))               (e4m3: nearest, ties to even; int8: half to even)

   or, static, with a given one-element scale. Worked example (e4m3, one group): x = [2.0, -7.0, 5.25]
   gives s = 7 / 448 = 1/64, x / s = [128, -448, 336] and codes [128, -448, 320]: 336 lies halfway
   between 320 and 352, neighbours on the e4m3 grid (step 32 in [256, 512)), and goes to the even
   mantissa, 320 = 256 * (1 + 2/8). The division is IEEE (``div_rn``), and the rounding to e4m3 is done in float32 arithmetic
   (``_round_e4m3``: the grid step from the exponent bits, then round-to-nearest-even by the 1.5 *
   2^23 trick), so the codes are the reference's bit for bit on CUDA and under the interpreter
   (whose own float32 -> float8 cast mis-rounds a carry into the next binade: -125.5 became -64).

2. ``scaled_matmul``: y [M, N] = sum over K tiles of (codes_a @ codes_b^T)_tile * s_a[m, tile] *
   s_b[n, tile], accumulated in float32 (int32 inside an INT8 tile: exact), bias added, cast to the
   output dtype. Scales are per row and per K block: ``group_a`` / ``group_b`` columns share one
   (a per-token activation scale is group_a = K; a per-channel weight scale group_b = K; DeepSeek's
   128x128 blocks give group_b = 128 with one row of scales per weight row, and 1x128 activation
   groups group_a = 128). When both groups are K the scales multiply once at the end; otherwise once
   per K tile (BLOCK_K divides both groups). Which tensor-core product multiplies FP8 codes
   (``product_path``, a pure function with a gold table in the tests):

   * float32 output (the exactness mode): codes widened to fp16 (exact: 4-bit significands,
     2^-9..448) on the fp16 tensor cores, float32 sums: within 2.5e-6 of float64 at K = 4096, at
     half the bf16 GEMM rate (H200: about 370 against 780 TFLOP/s);
   * bf16 / fp16 output (the default on CUDA): the FP8 tensor cores. Hopper's FP8 MMA keeps only
     ~14 bits of its partial sums (DeepSeek-V3's observation; 1.4e-4 - 2.0e-4 relative at llama-8b
     shapes on an H200), a tenth of the output's own rounding (bf16: 2^-9 = 2e-3 relative). With
     per-row scales on both sides (per-token activations, per-channel or per-tensor weights) and
     no batch invariance asked, ``torch._scaled_mm`` (cuBLAS / CUTLASS row-wise FP8) runs it; else
     this kernel's FP8 MMA with fixed tiles (deterministic mode, 128-column blocks).

   ``ActQuantConfig(fp8_tensor_cores=True / False)`` forces the FP8 MMA / the exact product.

3. ``silu_mul_quantize``: gate, up [T, I] -> the dynamic per-token codes and scales [T, 1] of
   y = SiLU(gate) * up, i.e. ``quantize_rows(kernels.elementwise.silu_mul(gate, up))`` bit for bit
   in one pass (a Llama MLP's down_proj input; ``ActQuantLinear.gated``): y in float32 by
   ``_silu_mul``'s arithmetic, rounded to the activation dtype (the unfused model stores y in it,
   then quantizes what it stored), then rule 1 on the row held in registers. Worked example (e4m3):
   gate = [20, 20, 20, -200, 0], up = [2, -7, 5.25, 3, 9] gives y = [40, -140, 105, -0, 0] (SiLU(20)
   = 20 / (1 + e^-20) rounds to 20; e^200 overflows to inf, so SiLU(-200) = -0), s = 140 / 448 =
   5/16 and codes [128, -448, 320, -0, 0]: the example of 1 scaled by 20. Saves writing and reading
   the [T, I] bf16 activation (I = 14336 on llama-8b).

Tiles are fixed (``ActQuantConfig``), never chosen by M, and the K loop is never split: a row's
result depends on that row only, so deterministic mode's batch invariance holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LogprobeError
from . import triton_available
from .elementwise import check_gate_up, silu_mul_reference

FP8 = torch.float8_e4m3fn
KINDS = {"float": (FP8, -448.0, 448.0), "int": (torch.int8, -128.0, 127.0)}  # code dtype, qmin, qmax
EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True, slots=True)
class ActQuantConfig:
    """Tiles of ``scaled_matmul`` (fixed: never a function of M, for batch invariance)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3
    # FP8 codes on the FP8 tensor cores: None (auto) when the output is bf16 / fp16, True always, False
    # never (codes widened exactly to fp16); see ``product_path``
    fp8_tensor_cores: bool | None = None
    # ``torch._scaled_mm`` without cuBLAS's periodic promotion of the FP8 MMA's partial sums to
    # float32 (``use_fast_accum``): faster, and truncated like the Triton FP8 MMA path. Off by default
    fast_accum: bool = False


DEFAULT_CONFIG = ActQuantConfig()  # what ``scaled_matmul`` runs without a config


def product_path(kind: str, out_dtype: torch.dtype, per_row_scales: bool, deterministic: bool,
                 fp8_tensor_cores: bool | None, has_scaled_mm: bool) -> str:
    """Which product multiplies the codes (the module docstring says why):

    * "int8": int8 tiles summed in int32 (exact) in ``_scaled_mm_kernel``;
    * "fp16": e4m3 codes widened to fp16 (exact products, float32 sums), ``_scaled_mm_kernel``;
    * "fp8-mma": the FP8 tensor cores in ``_scaled_mm_kernel`` (fixed tiles: batch-invariant);
    * "scaled_mm": ``torch._scaled_mm`` row-wise (cuBLAS / CUTLASS; bf16 out, per-row scales only;
      ``has_scaled_mm``: the GPU has it and K, N are multiples of 16).

    >>> product_path("float", torch.bfloat16, True, False, None, True)
    'scaled_mm'
    >>> product_path("float", torch.float32, True, False, None, True)
    'fp16'
    """
    if kind == "int":
        return "int8"
    mma = out_dtype in (torch.bfloat16, torch.float16) if fp8_tensor_cores is None else fp8_tensor_cores
    if not mma:
        return "fp16"
    if has_scaled_mm and per_row_scales and out_dtype == torch.bfloat16 and not deterministic:
        return "scaled_mm"
    return "fp8-mma"


def has_rowwise_scaled_mm(device: torch.device) -> bool:
    """``torch._scaled_mm`` with row-wise FP8 scales: CUDA compute capability 9.0 (Hopper) or later."""
    return device.type == "cuda" and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (9, 0)


# ------------------------------------------------------------------------------ PyTorch definitions

def quantize_rows_reference(x: torch.Tensor, kind: str, group: int | None = None,
                            scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (codes [T, K] in the kind's dtype, scales [T, G] float32); static ``scale``: [T, 1]
    copies of it. The value each code stands for is ``code * scale``."""
    dtype, qmin, qmax = KINDS[kind]
    x = x.float()
    T, K = x.shape
    if scale is not None:
        s = scale.float().reshape(1, 1).expand(T, 1)
        q = torch.clamp(x / s, qmin, qmax)
    else:
        g = group or K
        xv = x.view(T, K // g, g)  # [T, G, g]
        lo = torch.clamp(xv.amin(-1, keepdim=True), max=0.0)
        hi = torch.clamp(xv.amax(-1, keepdim=True), min=0.0)
        # a tensor divisor, not a Python number: CUDA divides by a scalar as a product with its
        # rounded reciprocal, which is not the IEEE quotient (div_rn) the kernels and the CPU compute
        s = torch.maximum(lo.abs(), hi) / torch.full_like(hi, (qmax - qmin) / 2)  # [T, G, 1]
        s = torch.where(s == 0, torch.tensor(EPS), s)
        q = torch.clamp(xv / s, qmin, qmax).view(T, K)
        s = s.view(T, K // g)
    codes = q.to(FP8) if kind == "float" else torch.round(q).to(torch.int8)  # both: nearest, ties to even
    return codes, s.contiguous()


def silu_mul_quantize_reference(gate: torch.Tensor, up: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gate, up [T, I] -> the dynamic per-token codes [T, I] and scales [T, 1] of SiLU(gate) * up
    rounded to gate's dtype (the activation the unfused model stores, then quantizes)."""
    return quantize_rows_reference(silu_mul_reference(gate, up), kind)


def scaled_matmul_reference(a: torch.Tensor, sa: torch.Tensor, group_a: int, b: torch.Tensor, sb: torch.Tensor,
                            group_b: int, bias: torch.Tensor | None = None,
                            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(a * sa) @ (b * sb)^T in float64 (the scales expanded over their groups), + bias, cast."""
    def expand(codes, s, g):
        return codes.double() * s.double().repeat_interleave(g, dim=1)[:, :codes.shape[1]]

    y = expand(a, sa, group_a) @ expand(b, sb, group_b).T
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype)


# --------------------------------------------------------------------------------- Triton kernels

if triton_available():
    import triton
    import triton.language as tl

    from .elementwise import silu_times

    @triton.jit
    def _round_e4m3(q):
        """float32 q in [-448, 448] -> the nearest float8 e4m3 value (ties to even), as float32."""
        bits = q.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # binade; below 2^-6 the subnormal step
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): 3 mantissa bits
        inv = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # 1 / step, exact
        t = tl.abs(q) * inv  # exact (a power of two)
        r = ((t + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: round to an integer, ties to even
        # the sign put back bitwise, so a tiny negative rounds to -0 like the reference's cast
        return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def _round_half_even(q):
        return (q + 12582912.0) - 12582912.0

    @triton.jit
    def _round_bf16(y):
        """float32 y -> the nearest bfloat16 (ties to even), as float32: the GPU's cast, in integer
        arithmetic (the interpreter's own float32 -> bfloat16 cast truncates)."""
        bits = y.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # a carry moves into the exponent: right
        return tl.where(y == y, r.to(tl.float32, bitcast=True), y)  # NaN stays NaN

    @triton.jit
    def _absmax_scale(x, HALF_RANGE: tl.constexpr, EPS_: tl.constexpr):
        """The dynamic scale of the values x (masked ones loaded as 0): max(|min(x, 0)|, max(x, 0)) / half range."""
        lo = tl.minimum(tl.min(x, 0), 0.0)
        hi = tl.maximum(tl.max(x, 0), 0.0)
        s = tl.math.div_rn(tl.maximum(-lo, hi), HALF_RANGE)
        return tl.where(s == 0.0, EPS_, s)

    @triton.jit
    def _codes(x, s, IS_FLOAT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr):
        """clamp(x / s) rounded to the code grid, as float32 (exact in the code dtype)."""
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), QMIN), QMAX)
        if IS_FLOAT:
            r = _round_e4m3(q)
        else:
            r = _round_half_even(q)
        return r

    @triton.jit
    def _quantize_kernel(x_ptr, c_ptr, s_ptr, static_ptr, K, G, group, stride_x, stride_c,
                         IS_FLOAT: tl.constexpr, STATIC: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
                         HALF_RANGE: tl.constexpr, EPS_: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        g = tl.program_id(1)
        cols = g * group + tl.arange(0, BLOCK)
        ok = (tl.arange(0, BLOCK) < group) & (cols < K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if STATIC:
            s = tl.load(static_ptr).to(tl.float32)
        else:
            s = _absmax_scale(x, HALF_RANGE, EPS_)
        code = _codes(x, s, IS_FLOAT, QMIN, QMAX).to(c_ptr.dtype.element_ty)  # exact: on the grid already
        tl.store(c_ptr + row * stride_c + cols, code, mask=ok)
        tl.store(s_ptr + row * G + g, s)

    @triton.jit
    def _silu_mul_quantize_kernel(g_ptr, u_ptr, c_ptr, s_ptr, K, stride_g, stride_u, stride_c,
                                  IS_FLOAT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
                                  HALF_RANGE: tl.constexpr, EPS_: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row, the whole row in registers: SiLU(g) * u, then its per-token codes
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < K
        g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
        y = silu_times(g, u)  # kernels.elementwise._silu_mul's arithmetic (masked: 0)
        if g_ptr.dtype.element_ty == tl.bfloat16:  # the activation dtype's rounding, as that kernel stores it
            y = _round_bf16(y)
        else:
            y = y.to(g_ptr.dtype.element_ty).to(tl.float32)
        s = _absmax_scale(y, HALF_RANGE, EPS_)
        code = _codes(y, s, IS_FLOAT, QMIN, QMAX).to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + row * stride_c + cols, code, mask=ok)
        tl.store(s_ptr + row, s)

    @triton.jit(do_not_specialize=["M"])  # varies with the batch: one compiled kernel
    def _scaled_mm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, y_ptr, M, N, K,
                          stride_a, stride_b, stride_sa, stride_sb, stride_y, group_a, group_b,
                          PER_TILE: tl.constexpr, IS_INT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          FP8_MMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
            a = tl.load(a_ptr + rm[:, None] * stride_a + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr + rn[None, :] * stride_b + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if IS_INT:
                part = tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)  # exact integer sum of one tile
            elif FP8_MMA:
                part = tl.dot(a, b)  # float32 out, but the FP8 MMA truncates its partial sums
            else:  # e4m3 -> fp16 is exact (4-bit significands, 2^-9..448), fp16 products are exact in float32
                part = tl.dot(a.to(tl.float16), b.to(tl.float16))
            if PER_TILE:
                sa = tl.load(sa_ptr + rm * stride_sa + k0 // group_a, mask=m_ok, other=0.0)
                sb = tl.load(sb_ptr + rn * stride_sb + k0 // group_b, mask=n_ok, other=0.0)
                acc += part * sa[:, None] * sb[None, :]
            else:
                acc += part
        if not PER_TILE:
            sa = tl.load(sa_ptr + rm * stride_sa, mask=m_ok, other=0.0)
            sb = tl.load(sb_ptr + rn * stride_sb, mask=n_ok, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------- wrappers

def quantize_rows(x: torch.Tensor, kind: str, group: int | None = None,
                  scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton form of ``quantize_rows_reference`` (same codes and scales, bit for bit)."""
    dtype, qmin, qmax = KINDS[kind]
    x = x.contiguous()
    T, K = x.shape
    g = K if scale is not None else (group or K)
    if K % g:
        raise LogprobeError("group", f"{g} does not divide the width {K}")
    G = K // g
    codes = torch.empty(T, K, dtype=dtype, device=x.device)
    scales = torch.empty(T, G, dtype=torch.float32, device=x.device)
    static = scale.float().reshape(1).contiguous() if scale is not None else scales
    block = triton.next_power_of_2(g)
    _quantize_kernel[(T, G)](x, codes, scales, static, K, G, g, x.stride(0), codes.stride(0),
                             IS_FLOAT=kind == "float", STATIC=scale is not None, QMIN=qmin, QMAX=qmax,
                             HALF_RANGE=(qmax - qmin) / 2, EPS_=EPS, BLOCK=block, num_warps=_row_warps(block))
    return codes, scales


def _row_warps(block: int) -> int:
    """Warps of a one-row-in-registers kernel over ``block`` columns: about 16 values a thread (a
    whole 14336-wide row on 4 warps kept 128 a thread: 0.26 ms for [8192, 14336] on an H200, a third
    of the FP8 GEMM after it)."""
    return max(1, min(32, block // 512))


def silu_mul_quantize(gate: torch.Tensor, up: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(kernels.elementwise.silu_mul(gate, up), kind)`` in one pass, bit for bit: gate,
    up [T, I] (unit last stride, any row stride: the halves of a fused gate/up output) -> codes
    [T, I] and dynamic per-token scales [T, 1] float32. The [T, I] activation never reaches memory."""
    check_gate_up(gate, up, "SiLU-multiply-quantize")
    dtype, qmin, qmax = KINDS[kind]
    T, K = gate.shape
    codes = torch.empty(T, K, dtype=dtype, device=gate.device)
    scales = torch.empty(T, 1, dtype=torch.float32, device=gate.device)
    if T and K:
        block = triton.next_power_of_2(K)
        _silu_mul_quantize_kernel[(T,)](gate, up, codes, scales, K, gate.stride(0), up.stride(0), codes.stride(0),
                                        IS_FLOAT=kind == "float", QMIN=qmin, QMAX=qmax, HALF_RANGE=(qmax - qmin) / 2,
                                        EPS_=EPS, BLOCK=block, num_warps=_row_warps(block))
    return codes, scales


def scaled_matmul(a: torch.Tensor, sa: torch.Tensor, group_a: int, b: torch.Tensor, sb: torch.Tensor, group_b: int,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                  config: ActQuantConfig | None = None, deterministic: bool = False) -> torch.Tensor:
    """a [M, K] codes with scales sa [M, ceil(K / group_a)], b [N, K] codes with sb [N, ceil(K /
    group_b)] (float8_e4m3fn both, or int8 both) -> y [M, N] in ``out_dtype``, by ``product_path``.
    ``deterministic``: a row's result must not depend on M (never ``torch._scaled_mm``)."""
    cfg = config or DEFAULT_CONFIG
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K or a.dtype != b.dtype or a.dtype not in (FP8, torch.int8):
        raise LogprobeError("weight", f"codes {a.dtype} {tuple(a.shape)} and {b.dtype} {tuple(b.shape)} do not "
                            "multiply (both float8_e4m3fn or both int8, same K)")
    per_tile = not (group_a >= K and group_b >= K)
    if per_tile and any(g < K and g % cfg.block_k for g in (group_a, group_b)):
        raise LogprobeError("group", f"scale groups {group_a}/{group_b} are not multiples of the K tile "
                            f"{cfg.block_k}", "use the PyTorch path (ActQuantLinear without kernels)")
    scaled_mm_fits = has_rowwise_scaled_mm(a.device) and K % 16 == 0 and N % 16 == 0  # cuBLAS FP8's alignment
    path = product_path("int" if a.dtype == torch.int8 else "float", out_dtype, not per_tile, deterministic,
                        cfg.fp8_tensor_cores, scaled_mm_fits)
    if path == "scaled_mm":
        return rowwise_scaled_mm(a, sa, b, sb, bias, cfg.fast_accum)
    ga, gb = (group_a if group_a < K else K + cfg.block_k), (group_b if group_b < K else K + cfg.block_k)
    y = torch.empty(M, N, dtype=out_dtype, device=a.device)
    sa, sb = sa.float().contiguous(), sb.float().contiguous()
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n))
    _scaled_mm_kernel[grid](a, b, sa, sb, bias if bias is not None else y, y, M, N, K,
                            a.stride(0), b.stride(0), sa.stride(0), sb.stride(0), y.stride(0), ga, gb,
                            PER_TILE=per_tile, IS_INT=a.dtype == torch.int8, HAS_BIAS=bias is not None,
                            FP8_MMA=path == "fp8-mma",
                            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def rowwise_scaled_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                      bias: torch.Tensor | None, fast_accum: bool = False) -> torch.Tensor:
    """FP8 codes a [M, K] x b [N, K]^T with one scale per row of each (sa [M, 1], sb [N, 1]) on the
    FP8 tensor cores through ``torch._scaled_mm`` -> bf16 [M, N] (float32 accumulation with the
    library's periodic promotion, unless ``fast_accum``)."""
    M, N = a.shape[0], b.shape[0]
    return torch._scaled_mm(a.contiguous(), b.t(), scale_a=sa.reshape(M, 1).contiguous(),
                            scale_b=sb.reshape(1, N).contiguous(), bias=None if bias is None else bias.to(torch.bfloat16),
                            out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def act_quant_linear(x: torch.Tensor, kind: str, act_group: int | None, static_scale: torch.Tensor | None,
                     qweight: torch.Tensor, w_scale: torch.Tensor, block_cols: int,
                     bias: torch.Tensor | None = None, config: ActQuantConfig | None = None,
                     deterministic: bool = False) -> torch.Tensor:
    """``ActQuantLinear``'s product through the two kernels: x [T, K] -> y [T, N] in x's dtype."""
    K = x.shape[1]
    codes, sx = quantize_rows(x, kind, act_group, static_scale)
    group_a = K if static_scale is not None else (act_group or K)
    return scaled_matmul(codes, sx, group_a, qweight, w_scale, block_cols, bias, _out_dtype(x.dtype), config,
                         deterministic)


def gated_act_quant_linear(gate: torch.Tensor, up: torch.Tensor, kind: str, qweight: torch.Tensor,
                           w_scale: torch.Tensor, block_cols: int, bias: torch.Tensor | None = None,
                           config: ActQuantConfig | None = None, deterministic: bool = False) -> torch.Tensor:
    """``act_quant_linear(silu_mul(gate, up), kind, None, None, ...)`` (dynamic per-token activations),
    bit for bit, with ``silu_mul_quantize`` in place of the two passes: gate, up [T, I] -> y [T, N]."""
    codes, sx = silu_mul_quantize(gate, up, kind)
    return scaled_matmul(codes, sx, gate.shape[1], qweight, w_scale, block_cols, bias, _out_dtype(gate.dtype), config,
                         deterministic)


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
