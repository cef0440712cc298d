"""Fused LM head + log-prob statistics in Triton: one pass over the vocabulary, no logits in memory.

Same function as ``logprobe.layers.logprob_head.logprob_head`` (the pure-PyTorch reference), for rows
``i`` with hidden ``h_i`` [H] and target ``y_i``:

    z_iv   = softcap(scale * (h_i . W_v + b_v)) / T_i          # float32, one [BLOCK_M, BLOCK_N] tile at a time
    lse_i  = log sum_v exp(z_iv)                                # online max / sum-exp
    ent_i  = lse_i - sum_v softmax(z_i)_v z_iv                  # online sum of exp(z - m) * z
    rank_i = #{v != y_i : z_iv > z_{i,y_i}}                     # z_{i,y_i} from its own dot product, as the reference
    top-k  = the k largest z_iv (k <= 256), larger first, equal values by smaller id

Layout of the work:
  * ``_target_logit`` computes z_{i,y_i} (one program per row: h_i . W_{y_i}, float32), first,
    because the rank needs it while the vocabulary streams by.
  * ``_head_partials``: program (m, s) takes BLOCK_M rows and the s-th contiguous slice of the
    vocabulary; for each BLOCK_N columns it runs a K loop of ``tl.dot`` (float32 accumulator),
    transforms the tile and folds it into per-row running (max, sum-exp, sum-exp*z, count above
    target, top-k). It writes those few numbers per (split, row): [S, N] (+ [S, N, KPAD]).
    Splitting the vocabulary gives enough programs to fill the GPU when N is small; programs are
    ordered split-fastest within groups of GROUP_M row tiles so the ones running together share
    their hidden rows and weight tiles in L2.
  * The online statistics run in base 2 (t = z log2(e) / T, exp2), saving a multiply per logit;
    the partials are converted back to natural-log units before they are written.
  * Top-k, two ways. k <= ``insert_top_k``: each row's k best sit in registers and a tile's candidates (values
    above the row's k-th) are inserted one per step. Wider k (up to 256): each value and its
    id are packed into one int64 key ordered as (value, then smaller id), and a tile with any
    candidate is merged in bulk: the tile's KPAD best keys (one sort), joined with the row's
    KPAD kept keys, sorted, the upper half kept. Either way ties go to the smaller id.
  * The combine over S splits is a few [S, N] tensor ops in PyTorch (tiny next to the matmul).

Extra memory: O(S * N) floats (+ S * N * KPAD for top-k), never O(N * V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LogprobeError
from . import interpreting, triton_available

INSERT_TOP_K = 256  # the default config's widest insertion (``KernelConfig.insert_top_k``)
# k up to this launches on every GPU the kernel was measured on; where a wider k's registers or
# shared memory do not fit, the caller falls back to the PyTorch head (exact too), once warned
ALWAYS_LAUNCHES_TOP_K = 20
MAX_TOP_K = 256  # the kernel's largest k; larger k goes to the PyTorch head

if triton_available():
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    # what a wide top-k launch may raise on a GPU whose registers / shared memory do not fit its
    # sorts: the caller then runs the PyTorch head (exact too), once warned
    LAUNCH_ERRORS: tuple[type[BaseException], ...] = (CompilationError, OutOfResources)
else:
    LAUNCH_ERRORS = ()

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _transform(z, bv, scale, softcap,
                   HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
        """Raw dot products -> logits, exactly the reference's order: (+b) * scale, softcap."""
        if HAS_BIAS:
            z = z + bv
        if HAS_SCALE:
            z = z * scale
        if HAS_SOFTCAP:
            # tanh from exp(-2|x|): no cancellation for large |x|, portable to the interpreter
            x = z / softcap
            t = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - t) / (1.0 + t)
            z = tl.where(x < 0, -th, th) * softcap
        return z

    @triton.jit
    def _target_logit(h_ptr, w_ptr, b_ptr, y_ptr, inv_t_ptr, out_ptr, H, stride_hn, stride_wv,
                      scale, softcap,
                      HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                      BLOCK_H: tl.constexpr):
        # one program per row: z_y = transform(h . W[y]) / T, float32 sum of products
        row = tl.program_id(0).to(tl.int64)
        y = tl.load(y_ptr + row).to(tl.int64)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            hv = tl.load(h_ptr + row * stride_hn + ks, mask=ks < H, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + y * stride_wv + ks, mask=ks < H, other=0.0).to(tl.float32)
            acc += hv * wv
        z = tl.sum(acc, axis=0)
        bv = 0.0
        if HAS_BIAS:
            bv = tl.load(b_ptr + y)
        z = _transform(z, bv, scale, softcap, HAS_BIAS, HAS_SCALE, HAS_SOFTCAP)
        tl.store(out_ptr + row, z * tl.load(inv_t_ptr + row))

    @triton.jit
    def _insert_candidates(tv, ti, cand, best, bcol, thr, v0, kcols, BLOCK_N: tl.constexpr):
        """Insert, one column per row per step, every candidate (``cand``: the tile's values above
        the row's k-th best, others -inf) into the rows' k best (tv, ti); ``best`` / ``bcol``: each
        row's largest candidate and its column in the tile (-inf: none). After the first tiles
        this is rarely more than a step or two: one max-with-index pass and one pruning pass per
        step, while any row of the tile still has a candidate."""
        lcols = tl.arange(0, BLOCK_N)
        todo = tl.max(best, axis=0) > float("-inf")
        while todo:
            # [BM] the slot to evict: the current minimum, the largest id among equal minima (the
            # head keeps the smaller ids at a tie on the k-th value)
            slot = tl.argmax(tl.where(tv == thr[:, None], ti, -1), axis=1)
            put = (kcols[None, :] == slot[:, None]) & (best > thr)[:, None]
            tv = tl.where(put, best[:, None], tv)
            ti = tl.where(put, (v0 + bcol).to(tl.int32)[:, None], ti)
            thr = tl.min(tv, axis=1)
            cand = tl.where((lcols[None, :] == bcol[:, None]) | (cand <= thr[:, None]), float("-inf"), cand)
            best, bcol = tl.max(cand, axis=1, return_indices=True)
            todo = tl.max(best, axis=0) > float("-inf")
        return tv, ti

    @triton.jit
    def _encode(t, ids):
        """(float32 value, id < 2^32) -> int64 key, ordered as the value, then the smaller id:
        the value's bits made monotonic as a signed int32 (negative floats: magnitude bits flipped)
        in the high half, 2^32 - 1 - id in the low half. -0.0 becomes +0.0 (they compare equal)."""
        bits = tl.where(t == 0.0, 0.0, t).to(tl.int32, bitcast=True)
        mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return (mono.to(tl.int64) << 32) | (4294967295 - ids)

    @triton.jit
    def _decode(key):
        """int64 key -> (float32 value, int64 id), the inverse of ``_encode``."""
        mono = (key >> 32).to(tl.int32)
        t = tl.where(mono >= 0, mono, mono ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        return t, 4294967295 - (key & 4294967295)

    @triton.jit
    def _merge_keys(keys, t, cols64, col_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KPAD: tl.constexpr):
        """A row's KPAD best keys (sorted, larger first) merged with a tile's values t [BM, BN]."""
        tk = _encode(tl.where(col_ok[None, :], t, float("-inf")), cols64[None, :])  # [BM, BN]
        if BLOCK_N > KPAD:  # the tile's KPAD best: sorted, row j of [BN / KPAD, KPAD] holds ranks j*KPAD..
            tk = tl.max(tl.reshape(tl.sort(tk, dim=1, descending=True), [BLOCK_M, BLOCK_N // KPAD, KPAD]), axis=1)
        both = tl.sort(tl.reshape(tl.join(keys, tk), [BLOCK_M, 2 * KPAD]), dim=1, descending=True)
        return tl.max(tl.reshape(both, [BLOCK_M, 2, KPAD]), axis=1)  # the upper half, still sorted

    @triton.jit(do_not_specialize=["N", "num_splits", "top_k"])  # varies with the batch: one compiled kernel
    def _head_partials(
        h_ptr, w_ptr, b_ptr, y_ptr, zy_ptr, inv_t_ptr,  # [N, H], [V, H], [V], [N], [N], [N]
        m_ptr, s_ptr, a_ptr, c_ptr,  # [S, N] each: running max, sum exp(z - m), sum exp(z - m) z, count above
        tv_ptr, ti_ptr,  # [S, N, KPAD] top-k values / ids (only when KPAD > 0)
        h_desc, w_desc,  # TMA descriptors of h ([BM, BK] blocks) and w ([BN, BK] blocks), when TMA
        N, V, H, cols_per_split, num_splits, top_k,
        stride_hn, stride_wv,
        scale, softcap,
        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        ENTROPY: tl.constexpr, KPAD: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        TMA: tl.constexpr, FLATTEN: tl.constexpr, TOPK_ROWMAX: tl.constexpr, WIDE: tl.constexpr,
    ):
        # grouped ordering: within a group of GROUP_M row tiles, the split index varies fastest
        pid = tl.program_id(0)
        num_m = tl.cdiv(N, BLOCK_M)
        per_group = GROUP_M * num_splits
        group = pid // per_group
        first_m = group * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_size
        pid_s = (pid % per_group) // group_size

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        y = tl.load(y_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        zy = tl.load(zy_ptr + rows, mask=row_ok, other=0.0)
        inv_t = tl.load(inv_t_ptr + rows, mask=row_ok, other=1.0)
        LOG2E: tl.constexpr = 1.4426950408889634
        c2 = inv_t * LOG2E  # z -> t = z log2(e) / T
        ty = zy * LOG2E  # zy already carries 1 / T

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_M], tl.float32)
        a = tl.zeros([BLOCK_M], tl.float32)
        cnt = tl.zeros([BLOCK_M], tl.int32)
        if WIDE:  # sorted int64 keys, all -inf to begin with; kth: the value of the last one
            keys = _encode(tl.full([BLOCK_M, KPAD], float("-inf"), tl.float32), tl.zeros([BLOCK_M, KPAD], tl.int64))
            kth = tl.full([BLOCK_M], float("-inf"), tl.float32)
        elif KPAD > 0:
            kcols = tl.arange(0, KPAD)
            # slots past k hold +inf, so the least slot (the insertion threshold) is the k-th
            # best, not the KPAD-th: a quarter fewer insertion steps for k = 20 than with 32 slots
            tv = tl.where(kcols[None, :] < top_k, float("-inf"), float("inf")) + tl.zeros([BLOCK_M, KPAD], tl.float32)
            ti = tl.zeros([BLOCK_M, KPAD], tl.int32)  # ids < 2^31; int64 only when stored (registers)

        v_begin = pid_s * cols_per_split
        v_end = tl.minimum(v_begin + cols_per_split, V)
        # FLATTEN: one software-pipelined loop over (vocabulary tile, k) pairs, so the next tile's
        # loads overlap this tile's epilogue instead of draining the pipeline every BLOCK_N columns
        for v0 in tl.range(v_begin, v_end, BLOCK_N, flatten=FLATTEN):
            cols = v0 + tl.arange(0, BLOCK_N)  # [BN]
            col_ok = cols < v_end
            cols64 = cols.to(tl.int64)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, H, BLOCK_K):
                if TMA:  # Hopper's tensor memory accelerator; out-of-range rows/columns read as 0
                    hb = h_desc.load([pid_m * BLOCK_M, k0])  # [BM, BK]
                    wb = w_desc.load([v0, k0])  # [BN, BK]; columns past v_end are masked below
                else:
                    ks = k0 + tl.arange(0, BLOCK_K)
                    h_ptrs = h_ptr + rows64[:, None] * stride_hn + ks[None, :]
                    w_ptrs = w_ptr + cols64[:, None] * stride_wv + ks[None, :]
                    if EVEN_K:
                        hb = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)  # [BM, BK]
                        wb = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)  # [BN, BK]
                    else:
                        hb = tl.load(h_ptrs, mask=row_ok[:, None] & (ks < H)[None, :], other=0.0)
                        wb = tl.load(w_ptrs, mask=col_ok[:, None] & (ks < H)[None, :], other=0.0)
                if IEEE:  # float32 inputs: true float32 products, not tf32
                    acc = tl.dot(hb, tl.trans(wb), acc, input_precision="ieee")
                else:
                    acc = tl.dot(hb, tl.trans(wb), acc)
            bv = 0.0
            if HAS_BIAS:
                bv = tl.load(b_ptr + cols, mask=col_ok, other=0.0)[None, :]
            z = _transform(acc, bv, scale, softcap, HAS_BIAS, HAS_SCALE, HAS_SOFTCAP)
            # base-2 domain: t = z * log2(e) / T in one multiply, then exp2 (what tl.exp does anyway)
            t = z * c2[:, None]
            # padding columns get a huge finite negative, not -inf: exp2 still gives exactly 0 there,
            # and e * t is then 0 (not 0 * -inf = nan), so entropy needs no second mask
            t = tl.where(col_ok[None, :], t, -3.0e38)  # [BM, BN]
            if KPAD > 0 and TOPK_ROWMAX and not WIDE:  # the row maximum's column too: top-k's first candidate
                tmax, tcol = tl.max(t, axis=1, return_indices=True)
            else:
                tmax = tl.max(t, axis=1)
            m_new = tl.maximum(m, tmax)  # finite: every tile has >= 1 real column
            alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max
            e = tl.exp2(t - m_new[:, None])  # 0 on padding columns
            s = s * alpha + tl.sum(e, axis=1)
            if ENTROPY:
                a = a * alpha + tl.sum(e * t, axis=1)
            m = m_new
            # the target never outranks itself (its tile value may round above zy)
            above = (t > ty[:, None]) & (cols64[None, :] != y[:, None])
            cnt += tl.sum(above.to(tl.int32), axis=1)
            if WIDE:
                # within a split later tiles hold larger ids: only a value above the k-th enters
                if tl.max((tmax > kth).to(tl.int32), axis=0) > 0:
                    keys = _merge_keys(keys, t, cols64, col_ok, BLOCK_M, BLOCK_N, KPAD)
                    kth, _ = _decode(tl.min(keys, axis=1))
            elif KPAD > 0:
                thr = tl.min(tv, axis=1)
                if TOPK_ROWMAX:
                    # a row's best candidate is its tile maximum, found above with the softmax's
                    # max: no pass over the tile unless some row has one (the same value and
                    # column as the arg-max of the candidates: same values, same reduction)
                    best = tl.where(tmax > thr, tmax, float("-inf"))
                    bcol = tcol
                    todo = tl.max(best, axis=0) > float("-inf")
                    if todo:
                        cand = tl.where((t > thr[:, None]) & col_ok[None, :], t, float("-inf"))
                        tv, ti = _insert_candidates(tv, ti, cand, best, bcol, thr, v0, kcols, BLOCK_N)
                else:
                    cand = tl.where((t > thr[:, None]) & col_ok[None, :], t, float("-inf"))
                    best, bcol = tl.max(cand, axis=1, return_indices=True)  # [BM], [BM] column in the tile
                    tv, ti = _insert_candidates(tv, ti, cand, best, bcol, thr, v0, kcols, BLOCK_N)

        # back to natural-log units: m, a, top-k values times ln 2 (s is a plain sum)
        LN2: tl.constexpr = 0.6931471805599453
        m = m * LN2
        a = a * LN2
        if WIDE:
            tv, ti = _decode(keys)
            tv = tv * LN2  # -inf stays -inf: slots a split narrower than KPAD never filled
            kcols = tl.arange(0, KPAD)
        elif KPAD > 0:
            tv = tl.where(kcols[None, :] < top_k, tv * LN2, float("-inf"))  # the +inf slots never win
            ti = ti.to(tl.int64)
        out = pid_s.to(tl.int64) * N + rows64
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(s_ptr + out, s, mask=row_ok)
        if ENTROPY:
            tl.store(a_ptr + out, a, mask=row_ok)
        tl.store(c_ptr + out, cnt, mask=row_ok)
        if KPAD > 0:
            kout = out[:, None] * KPAD + kcols[None, :]
            tl.store(tv_ptr + kout, tv, mask=row_ok[:, None])
            tl.store(ti_ptr + kout, ti, mask=row_ok[:, None])


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Tile shape and launch settings of ``_head_partials`` (tuned on an H100, see docs/perf.md)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    waves: int = 8  # aim for about this many programs per multiprocessor (vocabulary splits)
    max_rows: int = 65536  # rows per launch: bounds the [S, N(, KPAD)] partials
    fixed_split: int = 8192  # deterministic: vocabulary columns per split, whatever N is
    # TMA tile loads (CUDA capability >= 9, 16-bit inputs; else pointer loads) and one pipelined
    # loop across vocabulary tiles (plain and entropy; top-k keeps the nested loop). Together on an
    # H100: 32.6 -> 25.9 ms at M=16k, V=128k, H=4096 (1.37x -> 1.09x the bare matmul); flattening
    # without TMA was slower (35.6 ms), so it only applies with TMA (docs/perf.md)
    tma: bool = True
    flatten: bool = True
    # top-k: every split keeps its own k best, and a row's insertions grow with the number of
    # splits (about k ln(cols / k) each), so top-k runs with fewer, longer splits
    topk_waves: int = 1
    topk_flatten: bool = False  # the flattened loop around top-k's data-dependent insertion loop
    # top-k's first candidate per row from the softmax's row max (with its column): one pass
    # over the tile fewer, and none at all where no row has a candidate (H200, M=16k, V=128k:
    # top-20 36.04 -> 35.77 ms, top-5 34.02 -> 33.13). Triton 3.6 cannot compile it inside the
    # flattened loop, so it wins over ``topk_flatten`` (which measured no faster)
    topk_rowmax: bool = True
    # top-k up to this k: one-at-a-time insertion into registers; above ("wide"): sorted key merges.
    # H200, M=16k, V=128k, H=4096 (docs/perf.md): insertion at 128 rows per program 38.7 / 41.8 /
    # 61.7 ms at k = 32 / 64 / 128, the sorted merges 175.7 / 225.3 / 363.5 ms (the merges sort the
    # whole tile whenever any of its rows has a candidate, which is nearly every tile)
    insert_top_k: int = INSERT_TOP_K
    # wide top-k (k > insert_top_k): fewer rows per program (the kept keys are [block_m, KPAD]
    # int64 and each merge sorts [block_m, 2 KPAD]); tiles at least KPAD columns wide
    wide_block_m: int = 64


DEFAULT_CONFIG = KernelConfig()
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(hidden, weight, bias, targets, inv_t, top_k) -> None:
    if hidden.dim() != 2:
        raise LogprobeError("hidden", f"must be 2-D [N, H], got shape {tuple(hidden.shape)}")
    N, H = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != H:
        raise LogprobeError("weight", f"shape {tuple(weight.shape)} does not match hidden width {H}")
    if hidden.dtype not in _DTYPES or weight.dtype != hidden.dtype:
        raise LogprobeError("hidden", f"dtypes {hidden.dtype} (hidden) and {weight.dtype} (weight) must match "
                            "and be bfloat16, float16 or float32", "cast one to the other's dtype")
    if hidden.stride(1) != 1 or weight.stride(1) != 1:
        raise LogprobeError("hidden", "hidden and weight rows must be contiguous (unit last stride)",
                            "pass .contiguous() tensors")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        raise LogprobeError("bias", f"must be a contiguous [{weight.shape[0]}] tensor, got {tuple(bias.shape)}")
    if targets.shape != (N,) or targets.dtype not in (torch.int64, torch.int32):
        raise LogprobeError("targets", f"must be an integer [{N}] tensor, got {targets.dtype} {tuple(targets.shape)}")
    if inv_t.shape != (N,) or inv_t.dtype != torch.float32:
        raise LogprobeError("temperature", f"must be a float32 [{N}] tensor here")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        raise LogprobeError("top_k", f"the fused kernel keeps at most {MAX_TOP_K}, got {top_k}",
                            "use the PyTorch head (logprob_head dispatches there by itself)")
    devs = {t.device for t in (hidden, weight, targets, inv_t) + ((bias,) if bias is not None else ())}
    if len(devs) != 1:
        raise LogprobeError("hidden", f"all tensors must be on one device, got {sorted(map(str, devs))}")
    dev = hidden.device
    if not triton_available():
        raise LogprobeError("device", "the fused head needs Triton", "install triton or use the PyTorch head")
    if dev.type != "cuda" and not (interpreting() and dev.type == "cpu"):
        raise LogprobeError("device", f"the fused head runs on CUDA (or CPU under TRITON_INTERPRET=1), got {dev}")


def combine_head_partials(zy, m, s, a, c, tv, ti, top_k: int, deterministic: bool):
    """The PyTorch half of the head, shared by the fused kernel and the chunked reference: fold P
    partials (one per vocabulary split, chunk or rank shard) into per-row results.

    zy [N] target logits; m, s, a [P, N] (max, sum exp(z - m), sum exp(z - m) z over the split);
    c [P, N] counts above the target; tv, ti [P, N, K] each split's best logits and global ids.
    The global max is exact in any order; ``deterministic`` (the mode) adds the rescaled sums
    split after split in P order (elementwise ops only, no shape-dependent reduction), so a row's
    bits depend only on its partials:

        lse = max_p m_p + log(sum_p s_p exp(m_p - max))      entropy = lse - sum_p a_p exp(...) / sum_p s_p exp(...)

    -> (logprobs, logsumexp, ranks, entropy | None, topk_ids | None, topk_logprobs | None)."""
    mx = m.max(dim=0).values  # [N]
    w = torch.exp(m - mx)  # [P, N]
    entropy = a is not None
    if deterministic:
        tot, ent_num = s[0] * w[0], (a[0] * w[0] if entropy else None)
        for j in range(1, m.shape[0]):
            tot = tot + s[j] * w[j]
            if entropy:
                ent_num = ent_num + a[j] * w[j]
    else:
        tot = (s * w).sum(0)
        ent_num = (a * w).sum(0) if entropy else None
    lse = mx + torch.log(tot)
    ent = lse - ent_num / tot if entropy else None
    tid = tlp = None
    if top_k:
        P, N, K = tv.shape
        vals = tv.permute(1, 0, 2).reshape(N, P * K)  # [N, P * K]
        best, tid = merge_topk(vals, ti.permute(1, 0, 2).reshape(N, P * K), top_k)
        tlp = best - lse[:, None]
    return zy - lse, lse, c.sum(0).to(torch.int64), ent, tid, tlp


def merge_topk(vals: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of ``vals`` [N, n] with their ``ids`` [N, n], in the head's order:
    larger value first, equal values by smaller id (so at a tie on the k-th value the smaller ids
    are kept). Sorts by id, then stably by value: exact whatever order the candidates come in.

    >>> merge_topk(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), torch.tensor([[9, 7, 4, 5]]), 2)
    (tensor([[3., 3.]]), tensor([[4, 7]]))
    """
    by_id = ids.argsort(dim=1, stable=True)  # [N, n]
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    best, sel = vals.sort(dim=1, descending=True, stable=True)
    return best[:, :k], ids.gather(1, sel[:, :k])


def fused_target_logits(hidden, weight, targets, inv_temperature, *, bias=None, scale: float = 1.0,
                        softcap: float | None = None):
    """z_{i,y_i} [N] float32 (one program per row, float32 sum of products). ``targets`` must be
    valid rows of ``weight`` (a vocabulary shard's caller clamps and masks)."""
    N, H = hidden.shape
    zy = torch.empty(N, dtype=torch.float32, device=hidden.device)
    if N == 0:
        return zy
    b = bias.float().contiguous() if bias is not None else None
    flags = dict(HAS_BIAS=b is not None, HAS_SCALE=scale != 1.0, HAS_SOFTCAP=softcap is not None)
    _target_logit[(N,)](hidden, weight, b, targets.contiguous(), inv_temperature.contiguous(), zy, H,
                        hidden.stride(0), weight.stride(0), float(scale), float(softcap or 1.0), **flags,
                        BLOCK_H=min(1024, triton.next_power_of_2(H)))
    return zy


def filling_split(V: int, N: int, top_k: int, sms: int, config: KernelConfig = DEFAULT_CONFIG) -> int:
    """Vocabulary columns per split (a multiple of the tile width) that fill a GPU of ``sms``
    multiprocessors with ``fused_head_partials``'s programs over V columns and N rows: enough
    splits for ``waves`` programs per multiprocessor, never an empty one. A pure function of its
    arguments, so ranks of a vocabulary-parallel head that agree on them know each other's split
    counts (``cdiv(V_r, split)``) without asking.

    >>> filling_split(128256, 16, 0, 132), filling_split(128256, 65536, 0, 132)
    (256, 42752)
    """
    kpad = 0 if top_k == 0 else max(2, triton.next_power_of_2(top_k))
    bm, bn = config.block_m, config.block_n
    if top_k > config.insert_top_k:
        bm, bn = config.wide_block_m, max(bn, kpad)
    num_m = triton.cdiv(min(max(N, 1), config.max_rows), bm)
    waves = config.topk_waves if kpad else config.waves
    want = max(1, triton.cdiv(waves * sms, num_m))  # splits to fill the GPU
    tiles = triton.cdiv(V, bn)
    return triton.cdiv(tiles, min(want, tiles)) * bn


def fused_head_partials(
    hidden: torch.Tensor,  # [N, H] bf16 / fp16 / fp32
    weight: torch.Tensor,  # [V, H], same dtype (a vocabulary shard: ids vocab_start + row)
    targets: torch.Tensor,  # [N] int, in this weight's row numbering (may fall outside it)
    zy: torch.Tensor,  # [N] float32 target logits (already / T)
    inv_temperature: torch.Tensor,  # [N] float32
    *,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
    softcap: float | None = None,
    top_k: int = 0,
    entropy: bool = False,
    config: KernelConfig = DEFAULT_CONFIG,
    split: int | None = None,
    vocab_start: int = 0,
):
    """Per-split partials of ``combine_head_partials`` over this weight's rows: (m, s, a | None,
    c, tv | None, ti | None), [S, N] (+ KPAD). ``split``: vocabulary columns per split (fixed:
    deterministic mode; must be a multiple of the tile width); None picks enough splits to fill
    the GPU. Top-k ids come out global (``+ vocab_start``)."""
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    b = bias.float().contiguous() if bias is not None else None
    flags = dict(HAS_BIAS=b is not None, HAS_SCALE=scale != 1.0, HAS_SOFTCAP=softcap is not None)
    args_t = (float(scale), float(softcap or 1.0))
    kpad = 0 if top_k == 0 else max(2, triton.next_power_of_2(top_k))
    wide = top_k > config.insert_top_k
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if wide:
        bm, bn = config.wide_block_m, max(bn, kpad)
    if split is None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        split = filling_split(V, N, top_k, sms, config)
    cols_per_split = triton.cdiv(split, bn) * bn
    S = triton.cdiv(V, cols_per_split)  # every split non-empty
    m = torch.empty(S, N, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    a = torch.empty_like(m) if entropy else None
    c = torch.empty(S, N, dtype=torch.int32, device=dev)
    tv = torch.empty(S, N, kpad, dtype=torch.float32, device=dev) if kpad else None
    ti = torch.empty(S, N, kpad, dtype=torch.int64, device=dev) if kpad else None
    # TMA needs Hopper or newer, 16-byte aligned rows and a contiguous last dimension
    use_tma = (config.tma and dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
               and hidden.dtype != torch.float32 and (H * hidden.element_size()) % 16 == 0
               and hidden.stride(1) == 1 and weight.stride(1) == 1 and hidden.stride(0) == H
               and weight.stride(0) == H and weight.data_ptr() % 16 == 0)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
    for r0 in range(0, N, config.max_rows):
        r1 = min(r0 + config.max_rows, N)
        n = r1 - r0
        h, y, it = hidden[r0:r1], targets[r0:r1].contiguous(), inv_temperature[r0:r1].contiguous()
        # [S, n] views of the [S, N] outputs: row stride N, so the kernel gets slices it can index
        mo, so, co = m[:, r0:r1].contiguous(), s[:, r0:r1].contiguous(), c[:, r0:r1].contiguous()
        ao = a[:, r0:r1].contiguous() if entropy else mo
        tvo = tv[:, r0:r1].contiguous() if kpad else mo
        tio = ti[:, r0:r1].contiguous() if kpad else co
        tma = use_tma and h.data_ptr() % 16 == 0
        h_desc, w_desc = (TensorDescriptor.from_tensor(h, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk])) \
            if tma else (h, weight)
        _head_partials[(triton.cdiv(n, bm) * S,)](
            h, weight, b, y, zy[r0:r1].contiguous(), it, mo, so, ao, co, tvo, tio, h_desc, w_desc,
            n, V, H, cols_per_split, S, top_k, h.stride(0), weight.stride(0), *args_t, **flags,
            ENTROPY=entropy, KPAD=kpad, EVEN_K=H % bk == 0, IEEE=hidden.dtype == torch.float32,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m, TMA=tma,
            FLATTEN=config.flatten and (kpad == 0 or (config.topk_flatten and not config.topk_rowmax and not wide))
            and (tma or dev.type != "cuda"), TOPK_ROWMAX=config.topk_rowmax, WIDE=wide, num_warps=config.num_warps,
            num_stages=config.num_stages)
        if N > n:  # several launches: copy each launch's block back into the [S, N] outputs
            m[:, r0:r1], s[:, r0:r1], c[:, r0:r1] = mo, so, co
            if entropy:
                a[:, r0:r1] = ao
            if kpad:
                tv[:, r0:r1], ti[:, r0:r1] = tvo, tio
        else:
            m, s, c = mo, so, co
            a = ao if entropy else None
            tv, ti = (tvo, tio) if kpad else (None, None)
    if ti is not None and vocab_start:
        ti += vocab_start
    return m, s, a, c, tv, ti


def fused_logprob_head(
    hidden: torch.Tensor,  # [N, H] bf16 / fp16 / fp32
    weight: torch.Tensor,  # [V, H], same dtype
    targets: torch.Tensor,  # [N] int
    inv_temperature: torch.Tensor,  # [N] float32, 1 / T per row
    *,
    bias: torch.Tensor | None = None,  # [V]
    scale: float = 1.0,
    softcap: float | None = None,
    top_k: int = 0,
    entropy: bool = False,
    config: KernelConfig = DEFAULT_CONFIG,
    deterministic: bool = False,
):
    """-> (logprobs [N] f32, logsumexp [N] f32, ranks [N] i64, entropy [N] f32 | None,
    topk_ids [N, k] i64 | None, topk_logprobs [N, k] f32 | None). Targets are not range-checked
    here (the caller does it once).

    ``deterministic``: a row's numbers do not depend on N (batch invariance): the vocabulary is
    split every ``config.fixed_split`` columns (not by how many programs fill the GPU) and the
    splits are combined one after another in split order (not by a reduction kernel whose
    layout depends on the shape). Each row's dot products never depended on other rows."""
    _check(hidden, weight, bias, targets, inv_temperature, top_k)
    N = hidden.shape[0]
    dev = hidden.device
    if N == 0:
        e = torch.empty(0, dtype=torch.float32, device=dev)
        return (e, e, e.long(), e if entropy else None, e.long().view(0, top_k) if top_k else None,
                e.view(0, top_k) if top_k else None)
    opts = dict(bias=bias, scale=scale, softcap=softcap)
    zy = fused_target_logits(hidden, weight, targets, inv_temperature, **opts)
    parts = fused_head_partials(hidden, weight, targets, zy, inv_temperature, **opts, top_k=top_k, entropy=entropy,
                                config=config, split=config.fixed_split if deterministic else None)
    return combine_head_partials(zy, *parts, top_k=top_k, deterministic=deterministic)
