"""Memory-bound elementwise steps of a decoder layer as single Triton passes (CUDA only).

In PyTorch each of these is several kernels with float32 intermediates in memory: RMSNorm is
``x.float()``, ``pow``, ``mean``, ``rsqrt``, two multiplies and a cast; SiLU(gate) * up is two
kernels; rotary is a cast, a complex multiply and a cast back. At 32k tokens of an 8B model that
traffic is several milliseconds per layer next to about 20 ms of matmuls. Each kernel below
reads its inputs once and writes its output once, computing in float32 and rounding once.

Row-wise, so every row's result is independent of the other rows (batch-invariant as they
stand). References (the functions they are tested against) sit next to each wrapper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import LogprobeError
from . import interpreting, triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def silu_times(g, u):
        """SiLU(g) * u of float32 values, the one arithmetic both SiLU kernels use (``_silu_mul`` here,
        ``kernels.act_quant``'s fused quantizer), so their products are the same bits."""
        return g / (1.0 + tl.exp(-g)) * u  # exp overflows to inf for g << 0: g / inf = -0, SiLU's limit

    @triton.jit
    def _silu_mul(g_ptr, u_ptr, y_ptr, n_cols, stride_g, stride_u, stride_y, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, silu_times(g, u).to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotate_heads(x_ptr, y_ptr, t, c, s, n_heads, half, stride_xt, stride_xh, stride_yt, stride_yh,
                      BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr):
        # token t's heads: pair j = dims (2j, 2j + 1) rotated by (c, s)_j. Whole head rows are
        # loaded and stored contiguously and split into (even, odd) in registers: loading the evens
        # and the odds as two stride-2 gathers (and storing them the same way) ran at about a fifth
        # of the memory bandwidth on an H200 (15% of Qwen3-MoE's W1)
        heads = tl.arange(0, BLOCK_H)
        d = tl.arange(0, 2 * BLOCK_J)
        ok = (heads < n_heads)[:, None] & (d < 2 * half)[None, :]  # [BH, 2 BJ]
        x = tl.load(x_ptr + t * stride_xt + heads[:, None] * stride_xh + d[None, :], mask=ok, other=0.0)
        xe, xo = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_H, BLOCK_J, 2)))  # [BH, BJ] each
        # explicit FMAs: left to the compiler, which product is fused into the add changed with
        # BLOCK_H (a [T, 4, D] k and its [T, 2, D] half rotated some pairs 1 ulp apart on an H200)
        ye = tl.fma(xe, c[None, :], -(xo * s[None, :]))
        yo = tl.fma(xe, s[None, :], xo * c[None, :])
        y = tl.reshape(tl.join(ye, yo), (BLOCK_H, 2 * BLOCK_J))  # pairs interleaved back
        tl.store(y_ptr + t * stride_yt + heads[:, None] * stride_yh + d[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=ok)

    @triton.jit
    def _cos_sin(cs_ptr, t, half, BLOCK_J: tl.constexpr):
        d = tl.arange(0, 2 * BLOCK_J)
        cs = tl.load(cs_ptr + t * 2 * half + d, mask=d < 2 * half, other=0.0)  # cis as real [T, D/2, 2]
        return tl.split(tl.reshape(cs, (BLOCK_J, 2)))  # [BJ] each

    @triton.jit
    def _rotary(x_ptr, cs_ptr, y_ptr, n_heads, half, stride_xt, stride_xh, stride_yt, stride_yh,
                BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr):
        # one program per token, all its heads
        t = tl.program_id(0).to(tl.int64)
        c, s = _cos_sin(cs_ptr, t, half, BLOCK_J)
        _rotate_heads(x_ptr, y_ptr, t, c, s, n_heads, half, stride_xt, stride_xh, stride_yt, stride_yh,
                      BLOCK_H, BLOCK_J)

    @triton.jit
    def _rotary_pair(q_ptr, k_ptr, cs_ptr, yq_ptr, yk_ptr, hq, hk, half, stride_qt, stride_qh, stride_kt,
                     stride_kh, stride_yqt, stride_ykt, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                     BLOCK_J: tl.constexpr):
        # q's and k's heads of one token in one program: one launch where two were (the same
        # arithmetic per element, so the same bits as two ``_rotary`` calls)
        t = tl.program_id(0).to(tl.int64)
        c, s = _cos_sin(cs_ptr, t, half, BLOCK_J)
        _rotate_heads(q_ptr, yq_ptr, t, c, s, hq, half, stride_qt, stride_qh, stride_yqt, 2 * half,
                      BLOCK_HQ, BLOCK_J)
        _rotate_heads(k_ptr, yk_ptr, t, c, s, hk, half, stride_kt, stride_kh, stride_ykt, 2 * half,
                      BLOCK_HK, BLOCK_J)


def _runs_here(x: torch.Tensor, name: str) -> None:
    if not triton_available() or not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        raise LogprobeError("device", f"the Triton {name} runs on CUDA (or CPU under TRITON_INTERPRET=1), "
                            f"got {x.device}", "use the PyTorch path")


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up in float32, rounded once to the input dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def check_gate_up(gate: torch.Tensor, up: torch.Tensor, name: str) -> None:
    """What a Triton kernel over SiLU(gate) * up (``name``) takes: gate, up [T, I] of one dtype, unit
    last stride (any row stride), on CUDA or under the interpreter; else a ``LogprobeError``."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise LogprobeError("gate", f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                            "must be 2-D with one shape and dtype")
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise LogprobeError("gate", "gate and up rows must be contiguous (unit last stride)")
    _runs_here(gate, name)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [T, I] (any row stride, e.g. the two halves of a fused gate/up output) -> [T, I]."""
    check_gate_up(gate, up, "SiLU-multiply")
    T, n = gate.shape
    y = torch.empty(T, n, dtype=gate.dtype, device=gate.device)
    if T and n:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul[(T, triton.cdiv(n, block))](gate, up, y, n, gate.stride(0), up.stride(0), y.stride(0),
                                               BLOCK=block)
    return y


def rotary_reference(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (interleaved pairs) rotated by cis [T, D/2] complex64: the PyTorch path of
    ``layers.rotary.apply_rotary`` (a float32 complex multiply, rounded once)."""
    T, H, D = x.shape
    xc = torch.view_as_complex(x.float().reshape(T, H, D // 2, 2))  # [T, H, D/2]
    return torch.view_as_real(xc * cis[:, None, :]).reshape(T, H, D).to(x.dtype)


def rotary(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Same as ``rotary_reference``; x may be a strided view (heads of a fused q/k/v output)."""
    if x.dim() != 3 or x.shape[-1] % 2 or x.stride(2) != 1:
        raise LogprobeError("x", f"must be [T, H, D] with even D and unit last stride, got {tuple(x.shape)}")
    T, H, D = x.shape
    if cis.shape != (T, D // 2) or cis.dtype != torch.complex64:
        raise LogprobeError("cis", f"must be complex64 [{T}, {D // 2}], got {cis.dtype} {tuple(cis.shape)}")
    _runs_here(x, "rotary")
    y = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T and H:
        cs = torch.view_as_real(cis.contiguous())  # [T, D/2, 2] float32: (cos, sin)
        _rotary[(T,)](x, cs, y, H, D // 2, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                      BLOCK_H=triton.next_power_of_2(H), BLOCK_J=triton.next_power_of_2(D // 2))
    return y


def rotary_pair(q: torch.Tensor, k: torch.Tensor, cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rotary(q, cis), rotary(k, cis))`` in one launch: q [T, Hq, D] and k [T, Hk, D] (strided
    views allowed, unit last stride), bit for bit the two calls."""
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 3 or x.shape[-1] % 2 or x.stride(2) != 1:
            raise LogprobeError(name, f"must be [T, H, D] with even D and unit last stride, got {tuple(x.shape)}")
    T, Hq, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or k.dtype != q.dtype:
        raise LogprobeError("k", f"must be [{T}, Hk, {D}] in {q.dtype}, got {k.dtype} {tuple(k.shape)}")
    if cis.shape != (T, D // 2) or cis.dtype != torch.complex64:
        raise LogprobeError("cis", f"must be complex64 [{T}, {D // 2}], got {cis.dtype} {tuple(cis.shape)}")
    _runs_here(q, "rotary")
    Hk = k.shape[1]
    yq = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    yk = torch.empty(T, Hk, D, dtype=k.dtype, device=k.device)
    if T and (Hq or Hk):
        cs = torch.view_as_real(cis.contiguous())  # [T, D/2, 2] float32: (cos, sin)
        _rotary_pair[(T,)](q, k, cs, yq, yk, Hq, Hk, D // 2, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           yq.stride(0), yk.stride(0), BLOCK_HQ=triton.next_power_of_2(max(Hq, 1)),
                           BLOCK_HK=triton.next_power_of_2(max(Hk, 1)), BLOCK_J=triton.next_power_of_2(D // 2))
    return yq, yk


# --------------------------------------------------------------------------------------------
# Row-invariant elementwise functions on CPU

# PyTorch's CPU loops split a tensor into one flat range per thread (``at::parallel_for`` with a
# grain size g: tasks = min(threads, ceil(numel / g)), ceil(numel / tasks) elements each); each
# range runs SIMD blocks of two vectors from its start and a scalar tail, and the tail rounds some
# functions otherwise (SiLU, sigmoid, softplus, GELU-tanh: the scalar formula is another one).
# Most loops take g = GRAIN_SIZE; GELU's kernel (both approximations) splits evenly over the
# threads once it has more than CPU_EVEN_SPLIT_ABOVE elements (g = numel // threads).
CPU_GRAIN_SIZE = 32768
CPU_EVEN_SPLIT_ABOVE = 16384
CPU_SIMD_SPAN = 64  # elements: two AVX-512 vectors of bfloat16, a multiple of every smaller block


def cpu_ranges_aligned(numel: int, threads: int, grain: int = CPU_GRAIN_SIZE) -> bool:
    """Whether every thread's range of a flat loop over ``numel`` elements (a multiple of
    CPU_SIMD_SPAN) with this grain size starts and ends on a multiple of CPU_SIMD_SPAN, so no
    element falls in a tail.

    >>> cpu_ranges_aligned(1000 * 64, 16), cpu_ranges_aligned(1001 * 64, 16), cpu_ranges_aligned(1001 * 64, 2)
    (True, False, False)
    >>> cpu_ranges_aligned(300 * 64, 16)  # under the grain size: one range, on one thread
    True
    """
    tasks = min(threads, -(-numel // grain))
    return tasks <= 1 or (-(-numel // tasks)) % CPU_SIMD_SPAN == 0


def cpu_loops_aligned(numel: int, threads: int) -> bool:
    """``cpu_ranges_aligned`` under both splits: the grain-size one and GELU's even one.

    >>> cpu_loops_aligned(330 * 128, 2), cpu_loops_aligned(330 * 128, 16)  # 16 x 2,640 elements: 41.25 spans
    (True, False)
    >>> cpu_loops_aligned(336 * 128, 16), cpu_loops_aligned(1000 * 64, 16)  # 16 x 2,688 = 42 spans; 16 x 4,000
    (True, False)
    """
    even = max(1, numel // threads) if numel > CPU_EVEN_SPLIT_ABOVE else CPU_GRAIN_SIZE
    return cpu_ranges_aligned(numel, threads) and cpu_ranges_aligned(numel, threads, even)


def cpu_aligned_rows(rows: int, width: int, threads: int) -> int | None:
    """The fewest rows >= ``rows`` of ``width`` (a multiple of CPU_SIMD_SPAN) whose flat loops
    are aligned under both splits, within threads² extra rows (enough for every row count up to
    20,000 of widths 64, 128 and 1,536 on 12, 16 or 32 threads); None if there are none.

    >>> cpu_aligned_rows(330, 128, 16), cpu_aligned_rows(330, 128, 2), cpu_aligned_rows(1000, 64, 16)
    (336, 330, 1008)
    """
    for r in range(rows, rows + threads * threads + 1):
        if cpu_loops_aligned(r * width, threads):
            return r
    return None


def row_invariant(fn, *xs: torch.Tensor) -> torch.Tensor:
    """``fn(*xs)`` for an elementwise ``fn`` of same-shape [..., W] tensors, each row's bits
    independent of how many rows come with it, on CPU with any thread count.

    Two things move a row's elements into a scalar tail as the row count T changes: a width W that
    is not a multiple of the SIMD span, and a thread's range that ends mid-span. Rows are padded
    with zeros to W' (a multiple of 64), and with zero rows to the fewest T' >= T whose ranges fall
    on multiples of 64 under both of PyTorch's splits (``cpu_aligned_rows``); the padding is cut
    off the result. Where no T' close enough is aligned, ``fn`` runs in tiles of at most
    CPU_EVEN_SPLIT_ABOVE elements (whole rows, or 16,384-wide pieces of wider ones), each on one
    thread from its start. Example, GeGLU of width 96 on 16 threads: W' = 128; T = 330 (42,240
    elements) is split into 2 ranges of 21,120 by the grain, aligned, but GELU splits it into 16
    of 2,640 (41.25 spans): T' = 336 (16 x 2,688). CUDA runs ``fn`` as it is.

    >>> g = torch.linspace(-30, 30, 1001 * 24).view(1001, 24)
    >>> torch.equal(row_invariant(torch.sigmoid, g)[7:9], row_invariant(torch.sigmoid, g[7:9]))
    True
    """
    x0 = xs[0]
    width = x0.shape[-1]
    if x0.is_cuda or x0.numel() == 0:
        return fn(*xs)
    pad = -width % CPU_SIMD_SPAN
    padded = width + pad
    flat = [x.reshape(-1, width) for x in xs]  # [T, W] each
    rows = flat[0].shape[0]
    whole = cpu_aligned_rows(rows, padded, torch.get_num_threads())
    if whole is None:
        out = _tiles(fn, flat, padded)
    elif pad or whole > rows:
        out = fn(*(F.pad(x, (0, pad, 0, whole - rows)) for x in flat))[:rows, :width]  # [T' -> T, W' -> W]
    else:
        out = fn(*flat)
    return out.reshape(*x0.shape[:-1], width)


def _tiles(fn, flat: list[torch.Tensor], padded: int) -> torch.Tensor:
    """``row_invariant``'s fallback: ``fn`` over [T, W] inputs in tiles of at most
    CPU_EVEN_SPLIT_ABOVE elements (one thread each: under both splits' thresholds), every tile's
    rows padded to W' and its width a multiple of CPU_SIMD_SPAN, so no element meets a tail."""
    rows, width = flat[0].shape
    step_c = min(padded, CPU_EVEN_SPLIT_ABOVE)
    step_r = max(1, CPU_EVEN_SPLIT_ABOVE // padded)
    out = None
    for a in range(0, rows, step_r):
        b = min(a + step_r, rows)
        ins = [F.pad(x[a:b], (0, padded - width)) if padded > width else x[a:b] for x in flat]  # [b - a, W']
        for c in range(0, width, step_c):
            e = min(c + step_c, width)
            y = fn(*(x[:, c:c + step_c] for x in ins))  # [b - a, step_c]
            if out is None:
                out = y.new_empty(rows, width)
            out[a:b, c:e] = y[:, :e - c]
    return out
