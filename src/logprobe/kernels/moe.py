"""Fused mixture-of-experts MLP in Triton: two grouped GEMMs over all experts, SiLU fused.

Rows are token slots ``s = t * k + j`` (token t's j-th selected expert). ``align_by_expert``
sorts the slots by expert and pads each expert's segment to a multiple of BLOCK_M with a
sentinel (``T * k``), so every row tile belongs to exactly one expert. Example, E = 4, k = 2,
BLOCK_M = 2, ids = [[2, 0], [0, 3], [2, 1]]:

    slots by expert (stable):  e0: 1, 2 | e1: 5 | e2: 0, 4 | e3: 3
    sorted_slots (padded):     [1, 2 | 5, P | 0, 4 | 3, P | P, P]   P = 6, a row that is masked off
    tile_expert:               [0,     1,     2,     3,     3]

(the last tile is pad only: the padded length is a bound the host knows without asking the GPU,
``padded_length``, and a tile whose first slot is pad is skipped.)

* ``_gate_up_kernel``: program (tile, n) loads the tile's x rows (token ``s // k``), runs one K
  loop with two float32 accumulators against expert e's gate and up columns n, and stores
  ``SiLU(gate) * up`` (computed in float32, rounded once) to ``act[s]`` [T*k, I].
* ``_down_kernel``: program (tile, n) multiplies the tile's act rows by expert e's down columns
  n and stores ``y[s]`` [T*k, H].

* ``_combine_kernel`` (``combine_slots``): program (t, column block) adds token t's k rows of y
  weighted by the router, ``out[t] = w[t,0] y[t*k] + w[t,1] y[t*k+1] + ...`` in float32, in slot
  order, each product and each sum rounded as ``layers.moe.combine`` rounds them (FMA contraction
  off), then rounds once to the output dtype: bitwise the PyTorch definition's ``combine(y,
  w).to(dtype)``, in one pass over y instead of 3k float32 temporaries of [T, H].
* ``_combine_rows_kernel`` (``combine_rows``): the same sum over only the slots a rank computed
  (expert parallelism, default mode): rows y [n, H] in ascending slot order, their weights [n],
  token t's rows ``start[t] .. start[t+1] - 1``; ``out[t] = 0 + w y + w y ...`` in float32, kept
  in float32 (the partial each rank adds to the sum over ranks), 0 for a token with no row here.
* ``_combine_owned_kernel`` (``combine_owned``): the same sum read from y [T*k, H] by slot, where
  only the slots of this rank's experts were computed (``fused_moe`` given ids outside its
  experts leaves those out): no gathered copy of the rows, no compaction (which would wait for
  the GPU to learn how many).

Fixed tiles per expert, each K loop in order, no split-K: a row's numbers depend only on its own
row and its expert's weights, never on how many rows share the expert, so the kernel is
batch-invariant by construction (deterministic mode uses it as is). ``moe_reference`` is the
PyTorch definition it is tested against (``tests/test_moe.py``, under ``TRITON_INTERPRET=1`` on
CPU); the PyTorch path rounds gate and up to the activation dtype before SiLU as transformers
does, the kernel does not (equal in float32 up to accumulation order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import LogprobeError
from . import interpreting, triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_slots"])  # varies with the batch: one compiled kernel
    def _gate_up_kernel(x_ptr, wg_ptr, wu_ptr, act_ptr, sorted_ptr, tile_expert_ptr, num_slots, top_k, N, K,
                        stride_xm, stride_we, stride_wn, stride_am, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS: tl.constexpr):
        pid_m, pid_g = tl.program_id(0), tl.program_id(1)
        if tl.load(sorted_ptr + pid_m * BLOCK_M) >= num_slots:
            return  # a tile of pad only (past the last expert's tiles: ``align_by_expert``)
        slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
        valid = slots < num_slots
        tokens = (slots // top_k).to(tl.int64)
        e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)  # [BK]
        for j in range(COLS):  # this program's column tiles, each computed whole as one program would
            rn = (pid_g * COLS + j) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
            xp = x_ptr + tokens[:, None] * stride_xm + rk[None, :]  # [BM, BK]
            w_off = e * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BK, BN]: W_e^T tile
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                x = tl.load(xp, mask=valid[:, None] & (kk[None, :] < K), other=0.0)
                w_mask = (rn[None, :] < N) & (kk[:, None] < K)
                g = tl.load(wg_ptr + w_off, mask=w_mask, other=0.0)
                u = tl.load(wu_ptr + w_off, mask=w_mask, other=0.0)
                if IEEE:
                    acc_g = tl.dot(x, g, acc_g, input_precision="ieee")
                    acc_u = tl.dot(x, u, acc_u, input_precision="ieee")
                else:
                    acc_g = tl.dot(x, g, acc_g)
                    acc_u = tl.dot(x, u, acc_u)
                xp += BLOCK_K
                w_off += BLOCK_K
            act = acc_g * tl.sigmoid(acc_g) * acc_u  # SiLU(gate) * up in float32
            ap = act_ptr + slots[:, None].to(tl.int64) * stride_am + rn[None, :]
            tl.store(ap, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))

    @triton.jit(do_not_specialize=["num_slots"])  # varies with the batch: one compiled kernel
    def _down_kernel(a_ptr, wd_ptr, y_ptr, sorted_ptr, tile_expert_ptr, num_slots, N, K,
                     stride_am, stride_we, stride_wn, stride_ym, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS: tl.constexpr):
        pid_m, pid_g = tl.program_id(0), tl.program_id(1)
        if tl.load(sorted_ptr + pid_m * BLOCK_M) >= num_slots:
            return  # a tile of pad only
        slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
        valid = slots < num_slots
        e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        for j in range(COLS):  # this program's column tiles, each computed whole as one program would
            rn = (pid_g * COLS + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            ap = a_ptr + slots[:, None].to(tl.int64) * stride_am + rk[None, :]  # [BM, BK]
            w_off = e * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BK, BN]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                a = tl.load(ap, mask=valid[:, None] & (kk[None, :] < K), other=0.0)
                w = tl.load(wd_ptr + w_off, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
                if IEEE:
                    acc = tl.dot(a, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w, acc)
                ap += BLOCK_K
                w_off += BLOCK_K
            yp = y_ptr + slots[:, None].to(tl.int64) * stride_ym + rn[None, :]
            tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))

    @triton.jit
    def _combine_kernel(y_ptr, w_ptr, out_ptr, H, stride_y, stride_o, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < H
        row = y_ptr + t * TOP_K * stride_y + cols  # slot t*k, then t*k + j
        acc = tl.load(row, mask=ok, other=0.0).to(tl.float32) * tl.load(w_ptr + t * TOP_K)
        for j in tl.static_range(1, TOP_K):
            acc = acc + tl.load(row + j * stride_y, mask=ok, other=0.0).to(tl.float32) * tl.load(w_ptr + t * TOP_K + j)
        tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _combine_rows_kernel(y_ptr, w_ptr, start_ptr, out_ptr, H, stride_y, stride_o, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < H
        r0 = tl.load(start_ptr + t)
        r1 = tl.load(start_ptr + t + 1)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for r in range(r0, r1):  # token t's rows, in slot order (int64: ``start`` is)
            acc = acc + tl.load(y_ptr + r * stride_y + cols, mask=ok, other=0.0).to(tl.float32) * tl.load(w_ptr + r)
        tl.store(out_ptr + t * stride_o + cols, acc, mask=ok)


    @triton.jit
    def _combine_owned_kernel(y_ptr, w_ptr, own_ptr, out_ptr, H, stride_y, stride_o, TOP_K: tl.constexpr,
                              BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # token t's slots in slot order, those computed here only
            if tl.load(own_ptr + t * TOP_K + j) != 0:
                r = t * TOP_K + j
                acc = acc + tl.load(y_ptr + r * stride_y + cols, mask=ok, other=0.0).to(tl.float32) * tl.load(w_ptr + r)
        tl.store(out_ptr + t * stride_o + cols, acc, mask=ok)


    @triton.jit(do_not_specialize=["M"])  # varies with the batch: one compiled kernel
    def _combine_leaves_kernel(y_ptr, w_ptr, leaf_ptr, pos_ptr, out_ptr, H, M, stride_y, stride_o,
                               TOP_K: tl.constexpr, LEAVES: tl.constexpr, PERMUTE: tl.constexpr,
                               BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < H
        s0 = tl.zeros([BLOCK_H], dtype=tl.float32)
        s1, s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0, s0
        for j in tl.static_range(TOP_K):  # token t's slots in slot order; each adds to its leaf's sum alone
            leaf = tl.load(leaf_ptr + t * TOP_K + j)  # one scalar per program: the branches below are uniform
            if (leaf >= 0) & (leaf < LEAVES):
                r = t * TOP_K + j
                v = tl.load(y_ptr + r * stride_y + cols, mask=ok, other=0.0).to(tl.float32) * tl.load(w_ptr + r)
                if leaf == 0:
                    s0 = s0 + v
                if LEAVES > 1:
                    if leaf == 1:
                        s1 = s1 + v
                if LEAVES > 2:
                    if leaf == 2:
                        s2 = s2 + v
                    if leaf == 3:
                        s3 = s3 + v
                if LEAVES > 4:
                    if leaf == 4:
                        s4 = s4 + v
                    if leaf == 5:
                        s5 = s5 + v
                    if leaf == 6:
                        s6 = s6 + v
                    if leaf == 7:
                        s7 = s7 + v
        if LEAVES == 8:  # the fixed tree: neighbours first
            acc = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
        elif LEAVES == 4:
            acc = (s0 + s1) + (s2 + s3)
        elif LEAVES == 2:
            acc = s0 + s1
        else:
            acc = s0
        row = t
        if PERMUTE:  # row block t // M goes to block position pos[t // M]
            row = tl.load(pos_ptr + t // M).to(tl.int64) * M + t % M
        tl.store(out_ptr + row * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True, slots=True)
class MoeKernelConfig:
    """Tile shape (powers of two, >= 16 for tl.dot); one shape for every expert and batch of a
    dtype (``default_config``). On an H200 at the Qwen3-30B-A3B layer with T = 32768 tokens (the
    default budget's batch: about 2048 rows per expert), bf16: 128/128/64 with 8 warps and 3 stages
    (``HALF_CONFIG``) 6.25 ms = 1.45x the grouped-GEMM floor, 64/128/64/8/4 8.01 ms, 64/64/64/4/3
    (``DEFAULT_CONFIG``) 8.87 ms (docs/perf.md). Float32 tiles take twice the shared memory, and the
    larger ones need more than a Hopper SM has (245,760 > 232,448 bytes), so float32 keeps the
    small tiles."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_CONFIG = MoeKernelConfig()  # float32 (and every dtype when a benchmark sets both to one)
HALF_CONFIG = MoeKernelConfig(128, 128, 64, 8, 3)  # bf16 / fp16


def default_config(dtype: torch.dtype) -> MoeKernelConfig:
    """The tiles for activations of ``dtype``, read at the call (bench/gpu_moe.py --tiles sets them)."""
    return HALF_CONFIG if dtype in (torch.bfloat16, torch.float16) else DEFAULT_CONFIG


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> ``sorted_slots`` [P] (slots grouped by expert, each group padded to a
    multiple of ``block_m`` with ``T * k``) and ``tile_expert`` [P / block_m] (see the module
    docstring's example). A slot whose id is outside 0 .. num_experts - 1 (another rank's expert,
    a pad row's -1) gets no place: no tile computes it.

    No host synchronisation (on CUDA each one stalls the host until the GPU drains, so the next
    pass cannot be planned while this one runs): P is the bound ``padded_length(n, E, block_m)``
    known on the host, not the exact padded length, and the tiles past the last expert's are all
    pad (their expert is the last one; the kernels skip a tile whose first slot is pad).

        >>> s, t = align_by_expert(torch.tensor([[2, 0], [0, 3], [2, 1]]), 4, 2)
        >>> s.tolist()[:8], t.tolist()[:4], len(s) == 2 * len(t) == padded_length(6, 4, 2)
        ([1, 2, 5, 6, 0, 4, 3, 6], [0, 1, 2, 3], True)
        >>> align_by_expert(torch.tensor([[2, 0], [0, 3], [2, 1]]), 2, 2)[0].tolist()[:4]  # experts 0, 1 only
        [1, 2, 5, 6]
    """
    flat = ids.reshape(-1)  # [n], n = T * k
    n = flat.numel()
    E = num_experts
    bucket = torch.where((flat >= 0) & (flat < E), flat, E).long()  # [n]: E for a slot left out
    order = torch.sort(bucket, stable=True).indices  # slots by expert, the left-out ones last
    expert_of = bucket[order]  # [n], ascending
    # [E]: each expert's slots, read off the sorted ids (a bincount would wait for the GPU; counting
    # by atomic adds piles every left-out slot of another rank's experts onto one address)
    ends = torch.searchsorted(expert_of, torch.arange(E, device=flat.device), right=True)  # [E]
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [E]
    tiles = (counts + block_m - 1) // block_m  # [E]: each expert's tiles
    start = torch.cumsum(counts, 0) - counts  # first sorted index of each expert
    tile_end = torch.cumsum(tiles, 0)  # [E]: one past each expert's last tile
    total = padded_length(n, E, block_m)
    # each expert's first padded position; the left-out slots all go to position `total`, dropped
    pstart = torch.cat([(tile_end - tiles) * block_m, tile_end.new_full((1,), total)])  # [E + 1]
    start = torch.cat([start, start.new_zeros(1)])  # [E + 1]
    rank = torch.arange(n, device=flat.device) - start[expert_of]  # place within its expert
    dest = torch.where(expert_of < E, pstart[expert_of] + rank, total)  # [n]
    sorted_slots = torch.full((total + 1,), n, dtype=torch.int32, device=flat.device)  # [P + 1]
    sorted_slots[dest] = order.to(torch.int32)
    every_tile = torch.arange(total // block_m, device=flat.device)  # [P / block_m]
    tile_expert = torch.searchsorted(tile_end, every_tile, right=True).clamp_(max=E - 1)
    return sorted_slots[:total], tile_expert.to(torch.int32)


def padded_length(n: int, num_experts: int, block_m: int) -> int:
    """A bound on the slots of ``n`` padded expert by expert to multiples of ``block_m``: each
    expert adds fewer than ``block_m`` pad slots, rounded up to whole tiles.

    >>> padded_length(6, 4, 2), padded_length(1000, 128, 64), padded_length(0, 128, 64)
    (10, 9088, 0)
    """
    return -(-(n + num_experts * (block_m - 1)) // block_m) * block_m if n else 0


def _check(x: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
    E, inter, H = gate.shape
    if x.dim() != 2 or x.shape[1] != H or tuple(up.shape) != (E, inter, H) or tuple(down.shape) != (E, H, inter):
        raise LogprobeError("x", f"shapes x {tuple(x.shape)}, gate {tuple(gate.shape)}, up {tuple(up.shape)}, "
                            f"down {tuple(down.shape)} do not fit [T, H], [E, I, H], [E, I, H], [E, H, I]")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise LogprobeError("ids", f"must be [T, k] with T = {x.shape[0]}, got {tuple(ids.shape)}")
    if any(w.dtype != x.dtype for w in (gate, up, down)) or x.dtype not in (torch.bfloat16, torch.float16,
                                                                                torch.float32):
        raise LogprobeError("x", "x and the expert weights must share one dtype (bf16, fp16 or fp32)")
    if not triton_available() or not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        raise LogprobeError("device", "the fused MoE kernel runs on CUDA (or CPU under TRITON_INTERPRET=1)")


def fused_moe(x: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              config: MoeKernelConfig | None = None, foreign: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], ids [T, k], gate/up [E, I, H], down [E, H, I] -> y [T*k, H] in x's dtype: row
    ``t * k + j`` is expert ``ids[t, j]``'s MLP of token t (unweighted). ``config`` None:
    ``default_config(x.dtype)``. ``foreign``: many slots are other ranks' experts (expert
    parallelism): their row tiles, all pad, are about half the grid, so each program runs every
    column tile of its row tile (``whole_rows``) and a pad tile costs one program, not one per
    column tile. The same tiles either way: the same bits. ``out``: y written there (rows of
    slots whose id is outside 0 .. E - 1 left as they are), so that calls over parts of the
    experts fill one buffer."""
    _check(x, ids, gate, up, down)
    T, k = ids.shape
    c = config or default_config(x.dtype)
    sorted_slots, tile_expert = align_by_expert(ids, gate.shape[0], c.block_m)
    act = moe_gate_up(x, sorted_slots, tile_expert, T * k, k, gate, up, c, whole_rows=foreign)  # [T*k, I]
    return moe_down(act, sorted_slots, tile_expert, down, c, whole_rows=foreign, out=out)  # [T*k, H]


def _column_grid(n: int, block_n: int, whole_rows: bool) -> tuple[int, int]:
    """(column tiles a program runs, programs per row tile): one and every tile, or every tile and one.

    >>> _column_grid(768, 128, False), _column_grid(768, 128, True), _column_grid(100, 64, True)
    ((1, 6), (6, 1), (2, 1))
    """
    tiles = -(-n // block_n)
    return (tiles, 1) if whole_rows else (1, tiles)


def moe_gate_up(x: torch.Tensor, sorted_slots: torch.Tensor, tile_expert: torch.Tensor, num_slots: int, top_k: int,
                gate: torch.Tensor, up: torch.Tensor, config: MoeKernelConfig | None = None,
                whole_rows: bool = False) -> torch.Tensor:
    """The first half of ``fused_moe``: act [num_slots, I'] with row s = SiLU(gate_e x_t) * up_e x_t
    (t = s // top_k, e its tile's expert) for the slots of ``sorted_slots``; other rows are left
    unwritten. gate/up [E, I', H] may be a rank's share of the intermediate columns.
    ``whole_rows``: one program per row tile (``fused_moe``'s ``foreign``)."""
    c = config or default_config(x.dtype)
    E, inter, H = gate.shape
    x, gate, up = x.contiguous(), gate.contiguous(), up.contiguous()
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)  # [num_slots, I']
    tiles = tile_expert.numel()
    if tiles:
        cols, programs = _column_grid(inter, c.block_n, whole_rows)
        _gate_up_kernel[(tiles, programs)](
            x, gate, up, act, sorted_slots, tile_expert, num_slots, top_k, inter, H, x.stride(0), gate.stride(0),
            gate.stride(1), act.stride(0), IEEE=x.dtype == torch.float32, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            BLOCK_K=c.block_k, COLS=cols, num_warps=c.num_warps, num_stages=c.num_stages)
    return act


def moe_down(act: torch.Tensor, sorted_slots: torch.Tensor, tile_expert: torch.Tensor, down: torch.Tensor,
             config: MoeKernelConfig | None = None, whole_rows: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The second half of ``fused_moe``: act [S, I] (whole intermediate rows) and down [E, H', I]
    -> y [S, H'] for the slots of ``sorted_slots`` (other rows unwritten). down may be a rank's
    share of the output rows. ``whole_rows``: one program per row tile."""
    c = config or default_config(act.dtype)
    E, H, inter = down.shape
    act, down = act.contiguous(), down.contiguous()
    y = torch.empty(act.shape[0], H, dtype=act.dtype, device=act.device) if out is None else out  # [S, H']
    tiles = tile_expert.numel()
    if tiles:
        cols, programs = _column_grid(H, c.block_n, whole_rows)
        _down_kernel[(tiles, programs)](
            act, down, y, sorted_slots, tile_expert, act.shape[0], H, inter, act.stride(0), down.stride(0),
            down.stride(1), y.stride(0), IEEE=act.dtype == torch.float32, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
            BLOCK_K=c.block_k, COLS=cols, num_warps=c.num_warps, num_stages=c.num_stages)
    return y


def combine_slots(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expert outputs y [T*k, H] (slot order) and router weights [T, k] float32 -> [T, H] in ``dtype``:
    bitwise ``layers.moe.combine(y.view(T, k, H), weights).to(dtype)``, in one pass."""
    T, k = weights.shape
    H = y.shape[-1]
    if y.shape[0] != T * k or weights.dtype != torch.float32:
        raise LogprobeError("weights", f"y {tuple(y.shape)} and weights {tuple(weights.shape)} {weights.dtype} do not "
                            "fit [T*k, H] and [T, k] float32")
    y, weights = y.contiguous(), weights.contiguous()
    out = torch.empty(T, H, dtype=dtype, device=y.device)  # [T, H]
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    # FMA contraction off: each product and each sum rounded on its own, as PyTorch's elementwise ops do
    _combine_kernel[(T, triton.cdiv(H, block))](y, weights, out, H, y.stride(0), out.stride(0), TOP_K=k,
                                                BLOCK_H=block, num_warps=4, enable_fp_fusion=False)
    return out


def combine_owned(y: torch.Tensor, weights: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Expert outputs y [T*k, H] by slot (only the ``own`` slots written), router weights [T, k]
    float32 and own [T, k] bool -> float32 [T, H]: ``out[t] = 0 + w y + ...`` over token t's own
    slots in slot order, zero where it has none; each product and sum rounded on its own. Bitwise
    ``combine_rows`` of the own slots' rows, without gathering them (expert parallelism, default
    mode: the slots of the experts this rank holds)."""
    T, k = weights.shape
    H = y.shape[-1]
    if y.shape[0] != T * k or own.shape != (T, k) or weights.dtype != torch.float32:
        raise LogprobeError("weights", f"y {tuple(y.shape)}, weights {tuple(weights.shape)} {weights.dtype} and own "
                            f"{tuple(own.shape)} do not fit [T*k, H], [T, k] float32, [T, k]")
    y, weights, own = y.contiguous(), weights.contiguous(), own.contiguous().to(torch.int8)
    out = torch.empty(T, H, dtype=torch.float32, device=y.device)  # [T, H]
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _combine_owned_kernel[(T, triton.cdiv(H, block))](y, weights, own, out, H, y.stride(0), out.stride(0), TOP_K=k,
                                                      BLOCK_H=block, num_warps=4, enable_fp_fusion=False)
    return out


def moe_reference(x: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """What ``fused_moe`` computes, in PyTorch: y [T*k, H], row t*k + j = expert ids[t, j] on x[t]."""
    T, k = ids.shape
    flat = ids.reshape(-1)  # [T*k]
    xs = x.repeat_interleave(k, dim=0)  # [T*k, H]: slot s reads token s // k
    y = xs.new_zeros(T * k, down.shape[1])
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero()[:, 0]
        h = F.silu(F.linear(xs[rows], gate[e])) * F.linear(xs[rows], up[e])  # [n, I]
        y[rows] = F.linear(h, down[e])
    return y


def combine_rows(y: torch.Tensor, row_weights: torch.Tensor, slots: torch.Tensor, top_k: int, tokens: int
                 ) -> torch.Tensor:
    """Rows y [n, H] of slots ``slots`` [n] (ascending, ``t * top_k + j``) and their router weights
    [n] float32 -> float32 [tokens, H]: ``out[t] = 0 + w y + ...`` over token t's rows in slot
    order (zero where a token has none), each product and sum rounded on its own: bitwise
    ``layers.moe.combine_local``, in one pass over y."""
    n, H = y.shape
    if row_weights.shape != (n,) or slots.shape != (n,) or row_weights.dtype != torch.float32:
        raise LogprobeError("weights", f"y {tuple(y.shape)}, weights {tuple(row_weights.shape)} {row_weights.dtype} "
                            f"and slots {tuple(slots.shape)} do not fit [n, H], [n] float32, [n]")
    y, row_weights = y.contiguous(), row_weights.contiguous()
    owner = (slots // top_k).long()  # [n]: each row's token
    # rows per token; a bincount would wait for the GPU (it sizes its output by the largest value)
    counts = torch.zeros(tokens, dtype=torch.long, device=y.device).index_add_(0, owner, torch.ones_like(owner))
    start = torch.zeros(tokens + 1, dtype=torch.int64, device=y.device)  # [tokens + 1]
    start[1:] = torch.cumsum(counts, 0)
    out = torch.empty(tokens, H, dtype=torch.float32, device=y.device)  # [tokens, H]
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _combine_rows_kernel[(tokens, triton.cdiv(H, block))](y, row_weights, start, out, H, y.stride(0), out.stride(0),
                                                          BLOCK_H=block, num_warps=4, enable_fp_fusion=False)
    return out


LEAVES_MAX = 8  # the most leaves of the deterministic combine's tree: expert-parallel sizes up to 8 split it


def tree_leaves(num_experts: int) -> int:
    """The leaves of deterministic mode's combine tree for ``num_experts`` experts: the largest
    power of two dividing it, at most ``LEAVES_MAX``; leaf g holds experts ``g * E / G .. (g + 1) *
    E / G - 1``. A model property, never the rank count's: every size adds in this one order.

    >>> tree_leaves(128), tree_leaves(60), tree_leaves(8), tree_leaves(7)
    (8, 4, 8, 1)
    """
    g = 1
    while g < LEAVES_MAX and num_experts % (2 * g) == 0:
        g *= 2
    return g


def combine_leaves(y: torch.Tensor, weights: torch.Tensor, leaf: torch.Tensor, leaves: int,
                   dtype: torch.dtype = torch.float32, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Deterministic mode's combine, one pass over y (``layers.moe.combine_tree``'s bits).

    y [T*k, H] by slot (only slots with a leaf in 0 .. leaves - 1 are read), router weights [T, k]
    float32, leaf [T, k] int (each slot's leaf, numbered from this rank's first; -1 or >= leaves:
    not here) -> [T, H] in ``dtype``: per leaf, ``s_g = 0 + w y + ...`` over token t's slots of
    leaf g in slot order (float32, each product and sum rounded on its own), then the leaves added
    as a fixed tree, neighbours first: ``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))``.
    ``positions`` [T / M] int (M rows per block): row block b is written at block ``positions[b]``
    (the order ``parallel.context.tree_positions`` reduces in)."""
    T, k = weights.shape
    H = y.shape[-1]
    if y.shape[0] != T * k or leaf.shape != (T, k) or weights.dtype != torch.float32 or leaves not in (1, 2, 4, 8):
        raise LogprobeError("weights", f"y {tuple(y.shape)}, weights {tuple(weights.shape)} {weights.dtype}, leaf "
                            f"{tuple(leaf.shape)} and {leaves} leaves do not fit [T*k, H], [T, k] float32, [T, k], "
                            "1/2/4/8")
    y, weights, leaf = y.contiguous(), weights.contiguous(), leaf.contiguous().to(torch.int32)
    out = torch.empty(T, H, dtype=dtype, device=y.device)  # [T, H]
    if T == 0:
        return out
    M = T // positions.numel() if positions is not None else T
    pos = positions.to(device=y.device, dtype=torch.int32) if positions is not None else leaf
    block = min(512, triton.next_power_of_2(H))
    _combine_leaves_kernel[(T, triton.cdiv(H, block))](
        y, weights, leaf, pos, out, H, M, y.stride(0), out.stride(0), TOP_K=k, LEAVES=leaves,
        PERMUTE=positions is not None, BLOCK_H=block, num_warps=4, enable_fp_fusion=False)
    return out
