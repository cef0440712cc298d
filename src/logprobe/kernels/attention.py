r"""Packed (varlen) causal attention forward in Triton, for default mode on CUDA at head_dim 64 and 128.

The layout is FlashAttention's varlen one: q [T, Hq, D] holds the query rows of B segments one
after another (segment s: rows ``cu_q[s] .. cu_q[s+1] - 1``), k/v [K, Hkv, D] their keys
(``cu_k``); a segment's n queries are the last n of its m keys, so query i sees keys
0 .. m - n + i (causal aligned bottom-right: a completion over its shared prompt). Hq is a
multiple of Hkv (GQA).

Why a kernel of our own: PyTorch's bundled FlashAttention-2 issues Ampere's MMA instructions on
Hopper and ran W1's segments at 242 TFLOP/s (head_dim 64) and 297 (128) on an H200, where this
kernel, which Triton lowers to Hopper's, ran at 400 and 435 (docs/perf.md, "Attention"). It runs
on Hopper GPUs only (``layers.attention_gpu.triton_varlen_attention``): elsewhere it was not
measured, and FlashAttention-2 stays.

Each program computes ``rows`` query rows of one segment for ``HG`` query heads that share one
key/value head (GQA packed into the tile's rows: the keys are read once for the group): tile
row ``idx`` is query row ``start + idx // HG`` of head ``first + idx % HG``. It walks the keys in
blocks of ``BN`` from the segment's first key with an online softmax in float32 (base 2, the
scale folded in), the probabilities rounded to the input dtype before the product with the values
(as FlashAttention), the output divided once and rounded once. Blocks below the tile's first
row's diagonal run unmasked; the diagonal ones are masked per row.

Programs are listed by ``block_plan``, the blocks with the most keys first, so that the long
ones do not start last and run alone at the end (longest-processing-time order).

A row's result depends on its query, its segment's keys and the fixed key blocks alone (no
other row enters its dot products or its softmax; a block past the row's diagonal adds exact
zeros), so it is batch-invariant by construction, whatever the other segments, the tile the row
lands in or the chunk its sequence was cut at (the key blocks start at the sequence's first key):
deterministic mode runs it too (tests/test_gpu.py pins the bits on CUDA).

``varlen_reference`` is the definition in PyTorch (per segment, in the inputs' dtype or float64).
"""

from __future__ import annotations

import torch

from . import triton_available

# (tile rows, key block, warps, stages) by head_dim: the fastest of eight on W1's segments, one
# H200 (docs/perf.md, "Attention"); other head dims run FlashAttention-2
CONFIGS = {64: (64, 64, 4, 3), 128: (128, 64, 8, 3)}

triton = None
if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _varlen_fwd(Q, K, V, OUT, CU_Q, CU_K, SEG, START, qk_scale,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, HG: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
        pid = tl.program_id(0)
        first = tl.program_id(1) * HG  # the tile's first query head; all HG share one kv head
        kvh = first // G
        seg = tl.load(SEG + pid)
        qs = tl.load(START + pid)  # the tile's first query row, within its segment
        q0 = tl.load(CU_Q + seg).to(tl.int64)
        n = tl.load(CU_Q + seg + 1) - tl.load(CU_Q + seg)
        k0 = tl.load(CU_K + seg).to(tl.int64)
        m = tl.load(CU_K + seg + 1) - tl.load(CU_K + seg)
        ctx = m - n
        idx = tl.arange(0, BM * HG)
        r = qs + idx // HG
        h = first + idx % HG
        d = tl.arange(0, D)
        live = r < n
        q_at = ((q0 + r) * HQ + h)[:, None] * D + d[None, :]
        q = tl.load(Q + q_at, mask=live[:, None], other=0.0)
        mi = tl.full([BM * HG], -float("inf"), tl.float32)
        li = tl.zeros([BM * HG], tl.float32)
        acc = tl.zeros([BM * HG, D], tl.float32)
        seen = tl.minimum(m, ctx + qs + BM)  # keys past the tile's last row's are seen by no row
        whole = (tl.minimum(ctx + qs + 1, m) // BN) * BN  # blocks every row of the tile sees whole
        for j in range(0, whole, BN):
            kn = (k0 + j + tl.arange(0, BN)) * HKV + kvh
            kt = tl.load(K + kn[None, :] * D + d[:, None])  # [D, BN]
            s = tl.dot(q, kt) * qk_scale
            mn = tl.maximum(mi, tl.max(s, 1))
            p = tl.math.exp2(s - mn[:, None])
            alpha = tl.math.exp2(mi - mn)
            li = li * alpha + tl.sum(p, 1)
            vt = tl.load(V + kn[:, None] * D + d[None, :])  # [BN, D]
            acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
            mi = mn
        for j in range(whole, seen, BN):
            kj = j + tl.arange(0, BN)
            kn = (k0 + kj) * HKV + kvh
            kin = kj < m
            kt = tl.load(K + kn[None, :] * D + d[:, None], mask=kin[None, :], other=0.0)
            s = tl.dot(q, kt) * qk_scale
            s = tl.where((kj[None, :] <= (ctx + r)[:, None]) & kin[None, :], s, -float("inf"))
            mn = tl.maximum(mi, tl.max(s, 1))
            base = tl.where(mn == -float("inf"), 0.0, mn)  # a row that has seen nothing yet (pad rows)
            p = tl.math.exp2(s - base[:, None])
            alpha = tl.math.exp2(mi - base)
            li = li * alpha + tl.sum(p, 1)
            vt = tl.load(V + kn[:, None] * D + d[None, :], mask=kin[:, None], other=0.0)
            acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
            mi = mn
        out = acc / tl.where(live, li, 1.0)[:, None]
        tl.store(OUT + q_at, out.to(OUT.dtype.element_ty), mask=live[:, None])


def tile_shape(head_dim: int, q_heads: int, kv_heads: int) -> tuple[int, int] | None:
    """(query rows, query heads) of one program for this shape, or None where the kernel does not
    run (head_dim without a measured config). The heads sharing a kv head go in one tile where
    their count is a power of two dividing the tile; else one head a tile.

    >>> tile_shape(64, 32, 8), tile_shape(128, 28, 4), tile_shape(128, 16, 16), tile_shape(96, 8, 8)
    ((16, 4), (128, 1), (128, 1), None)
    """
    if head_dim not in CONFIGS:
        return None
    rows = CONFIGS[head_dim][0]
    g = q_heads // kv_heads
    hg = g if g & (g - 1) == 0 and g <= rows else 1
    return rows // hg, hg


def block_plan(cu_q: list[int], cu_k: list[int], rows: int) -> tuple[list[int], list[int]]:
    """The programs of one call: (segment, first query row within it) of every ``rows``-row block,
    the blocks reading the most keys first (ties in order). A block of segment s starting at row a
    reads keys 0 .. min(m, m - n + a + rows) - 1.

    Worked example, rows = 2: segment 0 has 3 own rows and no context (keys 3), segment 1 one row
    over 4 context keys (keys 5). Blocks: (0, 0) reads 2 keys, (0, 2) 3, (1, 0) 5:

    >>> block_plan([0, 3, 4], [0, 3, 8], 2)
    ([1, 0, 0], [0, 2, 0])
    """
    blocks = []
    for s in range(len(cu_q) - 1):
        n, m = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        blocks.extend((-min(m, m - n + a + rows), s, a) for a in range(0, n, rows))
    blocks.sort(key=lambda b: b[0])  # stable: equal blocks keep their order
    return [b[1] for b in blocks], [b[2] for b in blocks]


def varlen_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  plan: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [K, Hkv, D] contiguous, cu_q/cu_k int32 [B + 1] and ``plan`` (``block_plan``
    for ``tile_shape``'s rows, int32 on the device) -> [T, Hq, D] (module docstring)."""
    if triton is None:
        raise RuntimeError("varlen_triton needs Triton; use kernels.attention.varlen_reference")
    T, hq, d = q.shape
    hkv = k.shape[1]
    bm, hg = tile_shape(d, hq, hkv)
    _, bn, warps, stages = CONFIGS[d]
    seg, start = plan
    o = torch.empty_like(q)
    if seg.numel():
        _varlen_fwd[(seg.numel(), hq // hg)](q, k, v, o, cu_q, cu_k, seg, start, scale * 1.4426950408889634,
                                             hq, hkv, d, hq // hkv, hg, bm, bn, num_warps=warps, num_stages=stages)
    return o


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int],
                     scale: float) -> torch.Tensor:
    """What ``varlen_triton`` computes, one segment at a time in q's dtype (pass float64 for the
    exact value): softmax(q k^T * scale, causal bottom-right) v, each kv head repeated for its
    query heads."""
    out = torch.empty_like(q)
    g = q.shape[1] // k.shape[1]
    for s in range(len(cu_q) - 1):
        a, b, c, e = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        n, m = b - a, e - c
        kk, vv = (x[c:e].to(q.dtype).repeat_interleave(g, 1) for x in (k, v))  # [m, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q[a:b], kk) * scale
        seen = torch.arange(m, device=q.device)[None, :] <= (m - n + torch.arange(n, device=q.device))[:, None]
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vv)
    return out
