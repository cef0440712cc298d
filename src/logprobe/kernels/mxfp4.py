"""MXFP4 (OCP microscaling FP4) weights and gpt-oss's expert MLP in Triton, reading them packed.

The format, as gpt-oss checkpoints ship their expert matrices (``*_blocks``, ``*_scales``): a
weight [out, in] is cut along ``in`` into blocks of 32 values; each block is 16 bytes
(``blocks`` [out, in / 32, 16] uint8) and one shared scale byte (``scales`` [out, in / 32] uint8).

* Byte b of a block holds values 2b (low nibble, ``b & 15``) and 2b + 1 (high nibble, ``b >> 4``).
* A nibble is FP4 E2M1: sign bit 3, exponent bits 1-2, mantissa bit 0; exponent 0 is the
  subnormal 0.5 * m, otherwise (1 + m / 2) * 2^(e - 1). The 16 codes: 0, 0.5, 1, 1.5, 2, 3, 4, 6
  and their negatives (code 8 is -0).
* A scale byte is E8M0: 2^(s - 127). Code 255 is NaN in the OCP specification; ``check_scales``
  refuses it (no released checkpoint uses it).

Every product value * scale has two significant bits, so it is exact in float32 and in bfloat16
(down to their subnormals): the dequantized weight is one fixed set of numbers, whatever the dtype.

    >>> blocks = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)  # one block, one row
    >>> dequantize_mxfp4(blocks, torch.tensor([[128]], dtype=torch.uint8))[0, :3].tolist()
    [1.0, 2.0, 0.0]

(0x21: low nibble 1 -> 0.5, high nibble 2 -> 1.0; the scale 2^(128 - 127) = 2 doubles both.)

``gpt_oss_experts`` runs a gpt-oss expert MLP for token slots grouped by expert (the tiling of
``kernels.moe``: ``align_by_expert``, fixed tiles per expert, no split-K, so batch-invariant by
construction), with the weights either dense [E, out, in] or MXFP4 packed: a program loads the
bytes and scales of its [BLOCK_K, BLOCK_N] weight tile, decodes them in registers and feeds the
tile to ``tl.dot`` in the activations' dtype (exact, see above). The gate/up kernel computes
gpt-oss's clamped SwiGLU in float32 and rounds once:

    gate = min(x W_g^T + b_g, limit),  up = clamp(x W_u^T + b_u, -limit, limit)
    act  = (up + 1) * gate * sigmoid(alpha * gate)
    y    = act W_d^T + b_d

W_g is rows 0 .. I - 1 of the gate/up matrix [E, 2I, H], W_u rows I .. 2I - 1 (the loader
de-interleaves the checkpoint's alternating rows). ``gpt_oss_experts_reference`` is the PyTorch
definition the kernel is tested against (``tests/test_gpt_oss.py``, ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import LogprobeError
from . import host_values_to, interpreting, triton_available
from .moe import MoeKernelConfig, align_by_expert, default_config

BLOCK = 32  # values per scale
# the 16 E2M1 codes, code = sign * 8 + exponent * 2 + mantissa
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check_scales(scales: torch.Tensor, name: str) -> None:
    """Refuse E8M0 code 255 (NaN in the OCP MX specification)."""
    if bool((scales == 255).any()):
        raise LogprobeError("model", f"{name}: an MXFP4 scale byte is 255, which the OCP MX format defines as NaN",
                            "re-export the checkpoint")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> float32 [..., G * 32], exactly."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != BLOCK // 2 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise LogprobeError("model", f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                            f"{tuple(scales.shape)} {scales.dtype} do not fit [..., G, 16] and [..., G] uint8")
    lut = host_values_to(FP4_VALUES, torch.float32, blocks.device)  # pinned: no host sync on CUDA
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).int()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    out = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)  # times 2^(s - 127), exact
    return out.flatten(-2)  # [..., G * 32]


def gpt_oss_act(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU, op by op as transformers' ``GptOssExperts._apply_gate`` (each op
    rounded to the input dtype): gate, up [n, I] -> [n, I].

    >>> gpt_oss_act(torch.tensor([9.0, 0.0]), torch.tensor([-9.0, 1.0]), 1.702, 7.0).tolist()[1]
    0.0
    """
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_experts_reference(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor,
                              w2: torch.Tensor, b2: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """What ``gpt_oss_experts`` computes, in PyTorch on dense weights: x [T, H], ids [T, k], w13
    [E, 2I, H] (gate rows, then up rows), b13 [E, 2I], w2 [E, H, I], b2 [E, H] -> y [T*k, H], row
    t*k + j = expert ids[t, j] on x[t] (unweighted)."""
    T, k = ids.shape
    inter = w13.shape[1] // 2
    flat = ids.reshape(-1)  # [T*k]
    xs = x.repeat_interleave(k, dim=0)  # [T*k, H]: slot s reads token s // k
    y = xs.new_zeros(T * k, w2.shape[1])
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero()[:, 0]
        gu = F.linear(xs[rows], w13[e], b13[e])  # [n, 2I]
        y[rows] = F.linear(gpt_oss_act(gu[:, :inter], gu[:, inter:], alpha, limit), w2[e], b2[e])
    return y


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _w_tile(w_ptr, s_ptr, e, rn, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                PACKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Weight rows rn, columns k0 .. k0 + BLOCK_K of expert e, a [BLOCK_K, BLOCK_N] tile (W_e^T):
        loaded as stored (dense) or decoded from MXFP4 bytes and scales into float32 (packed)."""
        if PACKED:
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK/2] bytes of the rows
            mask = (rn[None, :] < N) & (kb[:, None] < K // 2)
            row = e * stride_we + rn[None, :].to(tl.int64) * stride_wn  # [1, BN]
            b = tl.load(w_ptr + row + kb[:, None], mask=mask, other=0).to(tl.int32)  # [BK/2, BN]
            srow = e * stride_se + rn[None, :].to(tl.int64) * stride_sn
            s = tl.load(s_ptr + srow + (kb // 16)[:, None], mask=mask, other=127).to(tl.int32)
            # 2^(s - 127) built from its bits (s = 0: the subnormal 2^-127 = bits 1 << 22)
            bits = tl.where(s == 0, 1 << 22, s << 23)
            scale = bits.to(tl.float32, bitcast=True)
            lo = _e2m1(b & 15) * scale  # [BK/2, BN]: values 2j
            hi = _e2m1(b >> 4) * scale  # values 2j + 1
            w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_K, BLOCK_N))  # rows 2j, 2j + 1
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            off = e * stride_we + rn[None, :].to(tl.int64) * stride_wn + kk[:, None]  # [BK, BN]
            w = tl.load(w_ptr + off, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        return w

    @triton.jit
    def _expand_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_we, stride_wn, stride_se, stride_sn, stride_oe,
                       stride_on, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One [BLOCK_N, BLOCK_K] tile of expert ``program_id(2)``'s weight decoded by ``_w_tile``
        (the values the packed kernels feed ``tl.dot``) and stored in ``out``'s dtype."""
        e = tl.program_id(2).to(tl.int64)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        w = tl.trans(_w_tile(w_ptr, s_ptr, e, rn, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                             True, BLOCK_N, BLOCK_K))  # [BN, BK]
        kk = k0 + tl.arange(0, BLOCK_K)
        off = e * stride_oe + rn[:, None].to(tl.int64) * stride_on + kk[None, :]
        tl.store(out_ptr + off, w.to(out_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (kk[None, :] < K))

    @triton.jit
    def _e2m1(c):
        """FP4 E2M1 codes (int32, 0..15) -> float32 values."""
        m = (c & 1).to(tl.float32)
        ex = (c >> 1) & 3
        mag = tl.where(ex == 0, 0.5 * m, (1.0 + 0.5 * m) * ((1 << ex).to(tl.float32) * 0.5))
        return tl.where(c >= 8, -mag, mag)

    @triton.jit(do_not_specialize=["num_slots"])  # varies with the batch: one compiled kernel
    def _gate_up_kernel(x_ptr, w_ptr, s_ptr, b_ptr, act_ptr, sorted_ptr, tile_expert_ptr, num_slots, top_k,
                        N, K, alpha, limit, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_be,
                        stride_am, PACKED: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if tl.load(sorted_ptr + pid_m * BLOCK_M) >= num_slots:
            return  # a tile of pad only (``kernels.moe.align_by_expert``)
        slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
        valid = slots < num_slots
        tokens = (slots // top_k).to(tl.int64)
        e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] gate rows; up rows are N + rn
        rk = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_ptr + tokens[:, None] * stride_xm + kk[None, :], mask=valid[:, None] & (kk[None, :] < K),
                        other=0.0)
            g = _w_tile(w_ptr, s_ptr, e, rn, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                        PACKED, BLOCK_N, BLOCK_K).to(x.dtype)
            u = _w_tile(w_ptr, s_ptr, e, N + rn, k0, 2 * N, K, stride_we, stride_wn, stride_se, stride_sn,
                        PACKED, BLOCK_N, BLOCK_K).to(x.dtype)
            if IEEE:
                acc_g = tl.dot(x, g, acc_g, input_precision="ieee")
                acc_u = tl.dot(x, u, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(x, g, acc_g)
                acc_u = tl.dot(x, u, acc_u)
        ok = rn < N
        bg = tl.load(b_ptr + e * stride_be + rn, mask=ok, other=0.0).to(tl.float32)
        bu = tl.load(b_ptr + e * stride_be + N + rn, mask=ok, other=0.0).to(tl.float32)
        gate = tl.minimum(acc_g + bg[None, :], limit)
        up = tl.minimum(tl.maximum(acc_u + bu[None, :], -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        ap = act_ptr + slots[:, None].to(tl.int64) * stride_am + rn[None, :]
        tl.store(ap, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & ok[None, :])

    @triton.jit(do_not_specialize=["num_slots"])  # varies with the batch: one compiled kernel
    def _down_kernel(a_ptr, w_ptr, s_ptr, b_ptr, y_ptr, sorted_ptr, tile_expert_ptr, num_slots, N, K,
                     stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ym,
                     PACKED: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if tl.load(sorted_ptr + pid_m * BLOCK_M) >= num_slots:
            return  # a tile of pad only (``kernels.moe.align_by_expert``)
        slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
        valid = slots < num_slots
        e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(a_ptr + slots[:, None].to(tl.int64) * stride_am + kk[None, :],
                        mask=valid[:, None] & (kk[None, :] < K), other=0.0)
            w = _w_tile(w_ptr, s_ptr, e, rn, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                        PACKED, BLOCK_N, BLOCK_K).to(a.dtype)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        ok = rn < N
        acc += tl.load(b_ptr + e * stride_be + rn, mask=ok, other=0.0).to(tl.float32)[None, :]
        yp = y_ptr + slots[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & ok[None, :])


def _operand(w: torch.Tensor | tuple[torch.Tensor, torch.Tensor], out: int, inner: int, name: str):
    """A dense [E, out, in] weight or MXFP4 (blocks [E, out, in/32, 16], scales [E, out, in/32]) ->
    (weight pointer tensor, scale tensor, packed, strides (e, row), scale strides (e, row))."""
    if isinstance(w, tuple):
        blocks, scales = w
        E = blocks.shape[0]
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (E, out, inner // BLOCK, BLOCK // 2) \
                or tuple(scales.shape) != (E, out, inner // BLOCK) or inner % BLOCK:
            raise LogprobeError(name, f"MXFP4 blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} do not fit "
                                f"[E, {out}, {inner // BLOCK}, 16] / [E, {out}, {inner // BLOCK}]")
        b = blocks.contiguous().view(E, out, inner // 2)  # [E, out, in/2] bytes
        s = scales.contiguous()
        return b, s, True, (b.stride(0), b.stride(1)), (s.stride(0), s.stride(1))
    if w.dim() != 3 or tuple(w.shape[1:]) != (out, inner):
        raise LogprobeError(name, f"weight {tuple(w.shape)} does not fit [E, {out}, {inner}]")
    w = w.contiguous()
    return w, w, False, (w.stride(0), w.stride(1)), (0, 0)


def expand_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 experts (blocks [E, out, in/32, 16], scales [E, out, in/32]) -> dense [E, out, in] in
    ``dtype`` in one Triton pass: the values ``gpt_oss_experts`` decodes from them tile by tile,
    so its products on the expanded weight are bitwise those on the packed one (and bitwise
    ``dequantize_mxfp4(blocks, scales).to(dtype)``: every value is exact in each dtype)."""
    if not triton_available() or not (blocks.is_cuda or (interpreting() and blocks.device.type == "cpu")):
        raise LogprobeError("device", "the MXFP4 expansion kernel runs on CUDA (or CPU under TRITON_INTERPRET=1)")
    if blocks.dim() != 4:
        raise LogprobeError("blocks", f"MXFP4 experts must be [E, out, in/32, 16], got {tuple(blocks.shape)}")
    E, out_f, groups, _ = blocks.shape
    w, s, _, st, ss = _operand((blocks, scales), out_f, groups * BLOCK, "blocks")
    inner = groups * BLOCK
    y = torch.empty(E, out_f, inner, dtype=dtype, device=blocks.device)
    if y.numel():
        bn, bk = 64, 128
        _expand_kernel[(triton.cdiv(out_f, bn), triton.cdiv(inner, bk), E)](
            w, s, y, out_f, inner, *st, *ss, y.stride(0), y.stride(1), BLOCK_N=bn, BLOCK_K=bk)
    return y


def gpt_oss_experts(x: torch.Tensor, ids: torch.Tensor, w13, b13: torch.Tensor, w2, b2: torch.Tensor,
                    alpha: float, limit: float, config: MoeKernelConfig | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], ids [T, k], w13 (gate rows then up rows) [E, 2I, H] dense or (blocks, scales)
    MXFP4, b13 [E, 2I], w2 [E, H, I] dense or MXFP4, b2 [E, H] -> y [T*k, H] in x's dtype: row
    t*k + j is expert ids[t, j]'s MLP of token t (unweighted; module docstring). ``config``: the
    tiles (``kernels.moe.default_config`` when None; block_k a multiple of 32 for MXFP4).

    A slot whose id is outside 0 .. E - 1 gets no tile (``align_by_expert``): with ``out`` (a
    [T*k, H] buffer in x's dtype, returned) its row is left as it is, so experts run a part at a
    time (ids minus the part's first expert) fill one buffer, each slot's row the bits one call
    over every expert gives (fixed tiles per expert)."""
    T, H = x.shape
    inter = b13.shape[1] // 2
    if not triton_available() or not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        raise LogprobeError("device", "the gpt-oss expert kernel runs on CUDA (or CPU under TRITON_INTERPRET=1)")
    if ids.dim() != 2 or ids.shape[0] != T:
        raise LogprobeError("ids", f"must be [T, k] with T = {T}, got {tuple(ids.shape)}")
    wg, sg, packed_g, st_g, ss_g = _operand(w13, 2 * inter, H, "w13")
    wd, sd, packed_d, st_d, ss_d = _operand(w2, H, inter, "w2")
    E, k = b13.shape[0], ids.shape[1]
    c = config or default_config(x.dtype)
    if c.block_k % BLOCK:
        raise LogprobeError("config", f"block_k {c.block_k} must be a multiple of {BLOCK} (one MXFP4 scale block)")
    x, b13, b2 = x.contiguous(), b13.contiguous(), b2.contiguous()
    sorted_slots, tile_expert = align_by_expert(ids, E, c.block_m)
    act = torch.empty(T * k, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    if out is not None and (tuple(out.shape) != (T * k, H) or out.dtype != x.dtype or not out.is_contiguous()):
        raise LogprobeError("out", f"must be a contiguous [{T * k}, {H}] {x.dtype} buffer, got "
                            f"{tuple(out.shape)} {out.dtype}")
    y = torch.empty(T * k, H, dtype=x.dtype, device=x.device) if out is None else out  # [T*k, H]
    tiles = tile_expert.numel()
    if tiles == 0:
        return y
    ieee = x.dtype == torch.float32
    tiles_kw = dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps,
                    num_stages=c.num_stages)
    _gate_up_kernel[(tiles, triton.cdiv(inter, c.block_n))](
        x, wg, sg, b13, act, sorted_slots, tile_expert, T * k, k, inter, H, float(alpha), float(limit),
        x.stride(0), *st_g, *ss_g, b13.stride(0), act.stride(0), PACKED=packed_g, IEEE=ieee, **tiles_kw)
    _down_kernel[(tiles, triton.cdiv(H, c.block_n))](
        act, wd, sd, b2, y, sorted_slots, tile_expert, T * k, H, inter, act.stride(0), *st_d, *ss_d, b2.stride(0),
        y.stride(0), PACKED=packed_d, IEEE=ieee, **tiles_kw)
    return y
