"""One-pass expansion of a GGUF quantized layer (Triton): packed blocks -> [out, in] in the activation dtype.

``gguf_expand(qtype, d, qs, m, dtype)`` reads the buffers ``layers.quant_linear.GGUFLinear`` keeps
(``kernels.gguf_quants.split_blocks``' layout) once and writes the weight once, instead of the
PyTorch reference's chain of small kernels and float32 temporaries (``dequantize_blocks``, then
``.to(dtype)``). Its result is bitwise ``dequantize_blocks(qtype, d, qs, m).to(dtype)``:

* every product and sum is done in float32 in the reference's order, e.g. Q4_K's
  ``(d * sc) * q - (dmin * mn)`` is three roundings (d * sc, dmin * mn, the product) and a
  subtraction, and the one rounding to ``dtype`` (round to nearest even, as ``Tensor.to``) comes last
  (bfloat16 rounded with integer ops, ``_rounded``: the interpreter's float32 -> bfloat16 cast truncates);
* kernels launch with ``enable_fp_fusion=False``. By default Triton contracts ``a * b + c`` into one
  FMA (a single rounding), which changes the last bit of Q4_1 and Q4_K weights on a GPU. Triton's CPU
  interpreter (``TRITON_INTERPRET=1``, the CPU tests) computes with numpy and never fuses, so the
  interpreter tests cannot catch a missing flag: only the CUDA test can.

Programs: Q8_0 / Q4_0 / Q4_1 (blocks of 32) take a [BLOCK_R rows, BLOCK_B blocks, 32] tile; the
k-quants take [BLOCK_R rows, one super-block of 256] as (sub-block, value) axes: Q4_K [8, 32],
Q6_K [16, 16]. Row offsets are int64 (a vocabulary-sized matrix can pass 2**31 values).

``dequantize_blocks`` (``kernels.gguf_quants``) is the PyTorch reference.
"""

from __future__ import annotations

import torch

from ..errors import LogprobeError
from . import triton_available
from .gguf_quants import QUANT_NAMES, block_values

FORMATS = QUANT_NAMES  # Q8_0, Q4_0, Q4_1, Q4_K, Q6_K
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_QS_BYTES = {"Q8_0": 32, "Q4_0": 16, "Q4_1": 16, "Q4_K": 140, "Q6_K": 208}  # qs bytes per block
_KIND = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _rounded(w, w_ptr, BF16: tl.constexpr):
        """float32 ``w`` in the output's element type. bfloat16 is rounded to nearest even by hand
        and stored as its int16 bits: Triton's interpreter casts float32 -> bfloat16 by truncation,
        so a plain ``.to`` would differ from ``Tensor.to`` on CPU (a GPU's cvt.rn is the same as this)."""
        if BF16:
            bits = w.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)  # round half to even (finite overflow -> inf)
            bits = tl.where(w != w, 0x7FC00000, bits)  # NaN stays NaN
            return (bits >> 16).to(tl.int16)
        return w.to(w_ptr.dtype.element_ty)

    @triton.jit
    def _expand32_kernel(d_ptr, qs_ptr, m_ptr, w_ptr, R, NB, KIND: tl.constexpr, QS_BYTES: tl.constexpr,
                         BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
        # KIND 0: Q8_0  w = d * q (int8);  1: Q4_0  w = d * (q - 8);  2: Q4_1  w = d * q + m
        rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        bb = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        jj = tl.arange(0, 32)
        r64 = rr.to(tl.int64)
        rb_ok = (rr < R)[:, None] & (bb < NB)[None, :]  # [BR, BB]
        rb = r64[:, None] * NB + bb[None, :]  # [BR, BB] block index
        df = tl.load(d_ptr + rb, mask=rb_ok, other=0.0).to(tl.float32)[:, :, None]  # [BR, BB, 1]
        ok = rb_ok[:, :, None] & (jj < 32)[None, None, :]  # [BR, BB, 32]
        if KIND == 0:
            q = tl.load(qs_ptr + rb[:, :, None] * QS_BYTES + jj[None, None, :], mask=ok, other=0).to(tl.float32)
            w = df * q
        else:
            # byte j % 16 holds element j (low nibble) and element j + 16 (high nibble)
            byte = tl.load(qs_ptr + rb[:, :, None] * QS_BYTES + (jj % 16)[None, None, :], mask=ok, other=0)
            q = ((byte.to(tl.int32) >> (4 * (jj // 16))[None, None, :]) & 0xF).to(tl.float32)
            if KIND == 1:
                w = df * (q - 8.0)
            else:
                mf = tl.load(m_ptr + rb, mask=rb_ok, other=0.0).to(tl.float32)[:, :, None]
                w = df * q + mf  # two roundings: never an FMA (enable_fp_fusion=False)
        out = (rb * 32)[:, :, None] + jj[None, None, :]
        tl.store(w_ptr + out, _rounded(w, w_ptr, BF16), mask=ok)

    @triton.jit
    def _expand_q4k_kernel(d_ptr, qs_ptr, m_ptr, w_ptr, R, NB, BF16: tl.constexpr, BLOCK_R: tl.constexpr):
        # qs per super-block: 12 bytes of 6-bit (scale, min) pairs, then 4 groups of 32 nibble bytes
        # (group c: low nibbles = sub-block 2c, high = 2c + 1).  w = (d * sc_s) * q - dmin * mn_s
        rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        b = tl.program_id(1)
        s = tl.arange(0, 8)  # sub-block
        ll = tl.arange(0, 32)  # value within it
        r_ok = rr < R
        rb = rr.to(tl.int64) * NB + b  # [BR] block index
        base = rb * 140
        sb_ok = r_ok[:, None] & (s < 8)[None, :]  # [BR, 8]
        sbp = qs_ptr + base[:, None]
        x_s = tl.load(sbp + s[None, :], mask=sb_ok, other=0).to(tl.int32)  # byte s
        x_s4 = tl.load(sbp + (s + 4)[None, :], mask=sb_ok, other=0).to(tl.int32)  # byte s + 4
        x_sm4 = tl.load(sbp + tl.where(s >= 4, s - 4, s)[None, :], mask=sb_ok, other=0).to(tl.int32)  # byte s - 4
        lo = (s < 4)[None, :]
        sc = tl.where(lo, x_s & 63, (x_s4 & 0x0F) | ((x_sm4 >> 6) << 4))  # [BR, 8]
        mn = tl.where(lo, x_s4 & 63, (x_s4 >> 4) | ((x_s >> 6) << 4))
        df = tl.load(d_ptr + rb, mask=r_ok, other=0.0).to(tl.float32)[:, None]  # [BR, 1]
        mf = tl.load(m_ptr + rb, mask=r_ok, other=0.0).to(tl.float32)[:, None]
        scale = (df * sc.to(tl.float32))[:, :, None]  # [BR, 8, 1], d * sc first, as the reference
        mins = (mf * mn.to(tl.float32))[:, :, None]
        ok = r_ok[:, None, None] & (s < 8)[None, :, None] & (ll < 32)[None, None, :]  # [BR, 8, 32]
        off = 12 + 32 * (s // 2)[None, :, None] + ll[None, None, :]  # [1, 8, 32]
        byte = tl.load(qs_ptr + base[:, None, None] + off, mask=ok, other=0).to(tl.int32)
        q = ((byte >> (4 * (s % 2))[None, :, None]) & 0x0F).to(tl.float32)
        w = scale * q - mins  # two roundings: never an FMA (enable_fp_fusion=False)
        out = (rb * 256)[:, None, None] + (32 * s)[None, :, None] + ll[None, None, :]
        tl.store(w_ptr + out, _rounded(w, w_ptr, BF16), mask=ok)

    @triton.jit
    def _expand_q6k_kernel(d_ptr, qs_ptr, w_ptr, R, NB, BF16: tl.constexpr, BLOCK_R: tl.constexpr):
        # qs per super-block: 128 bytes ql, 64 bytes qh, 16 int8 scales. Value j = 128 h + 32 i + l
        # (half h, quarter i): the nibble (i // 2) of ql[64 h + 32 (i % 2) + l], bits 2 i of
        # qh[32 h + l] as bits 4-5, minus 32; scale sc[j // 16].  w = (d * sc) * (q - 32)
        rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        b = tl.program_id(1)
        g = tl.arange(0, 16)  # group of 16 values (its scale)
        ll = tl.arange(0, 16)
        r_ok = rr < R
        rb = rr.to(tl.int64) * NB + b  # [BR]
        base = rb * 208
        sc = tl.load(qs_ptr + base[:, None] + 192 + g[None, :], mask=r_ok[:, None] & (g < 16)[None, :], other=0)
        sc = sc.to(tl.int8, bitcast=True).to(tl.float32)  # [BR, 16]
        df = tl.load(d_ptr + rb, mask=r_ok, other=0.0).to(tl.float32)[:, None]  # [BR, 1]
        scale = (df * sc)[:, :, None]  # [BR, 16, 1], d * sc first, as the reference
        j = (16 * g)[None, :, None] + ll[None, None, :]  # [1, 16, 16] value in the super-block
        h = j // 128
        i = (j // 32) % 4
        lane = j % 32
        ok = r_ok[:, None, None] & (j < 256)
        ql = tl.load(qs_ptr + base[:, None, None] + (64 * h + 32 * (i % 2) + lane), mask=ok, other=0).to(tl.int32)
        qh = tl.load(qs_ptr + base[:, None, None] + (128 + 32 * h + lane), mask=ok, other=0).to(tl.int32)
        q = ((ql >> (4 * (i // 2))) & 0x0F) | (((qh >> (2 * i)) & 3) << 4)
        w = scale * (q.to(tl.float32) - 32.0)
        out = (rb * 256)[:, None, None] + j
        tl.store(w_ptr + out, _rounded(w, w_ptr, BF16), mask=ok)


def gguf_expand(qtype: str, d: torch.Tensor, qs: torch.Tensor, m: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """A GGUF layer's weight [out, in] in ``dtype`` (float32, bfloat16 or float16), expanded in one
    pass: bitwise ``dequantize_blocks(qtype, d, qs, m).to(dtype)``. ``d`` [out, nb], ``qs``
    [out, nb, bytes], ``m`` [out, nb] (Q4_1's minimum, Q4_K's dmin; None otherwise), as
    ``split_blocks`` gives them. CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``."""
    if not triton_available():
        raise LogprobeError("backend", "the GGUF expansion kernel needs Triton", "pip install triton, or run on CPU")
    if qtype not in FORMATS:
        raise LogprobeError("qtype", f"{qtype!r} is not one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise LogprobeError("dtype", f"{dtype} is not float32, bfloat16 or float16")
    R, NB = d.shape
    if qs.ndim != 3 or tuple(qs.shape) != (R, NB, _QS_BYTES[qtype]) or qs.element_size() != 1:
        raise LogprobeError("qs", f"{qtype} codes must be 1-byte [{R}, {NB}, {_QS_BYTES[qtype]}], "
                            f"got {qs.dtype} {tuple(qs.shape)}")
    needs_m = qtype in ("Q4_1", "Q4_K")
    if needs_m and (m is None or tuple(m.shape) != (R, NB)):
        raise LogprobeError("m", f"{qtype} needs m [{R}, {NB}], got {None if m is None else tuple(m.shape)}")
    d, qs = d.contiguous(), qs.contiguous()
    m = m.contiguous() if needs_m else d  # an unused pointer for the formats without one
    w = torch.empty(R, NB * block_values(qtype), dtype=dtype, device=d.device)
    if R == 0 or NB == 0:
        return w
    bf16 = dtype == torch.bfloat16
    out = w.view(torch.int16) if bf16 else w  # bfloat16 is written as its bits (``_rounded``)
    # enable_fp_fusion=False: no a * b + c -> FMA contraction, so the roundings are the reference's
    if qtype in _KIND:
        BR, BB = 16, 8
        _expand32_kernel[(triton.cdiv(R, BR), triton.cdiv(NB, BB))](
            d, qs, m, out, R, NB, KIND=_KIND[qtype], QS_BYTES=_QS_BYTES[qtype], BF16=bf16, BLOCK_R=BR, BLOCK_B=BB,
            num_warps=4, enable_fp_fusion=False)
    elif qtype == "Q4_K":
        BR = 8
        _expand_q4k_kernel[(triton.cdiv(R, BR), NB)](d, qs, m, out, R, NB, BF16=bf16, BLOCK_R=BR, num_warps=4,
                                                     enable_fp_fusion=False)
    else:
        BR = 8
        _expand_q6k_kernel[(triton.cdiv(R, BR), NB)](d, qs, out, R, NB, BF16=bf16, BLOCK_R=BR, num_warps=4,
                                                     enable_fp_fusion=False)
    return w
