"""Batch-invariant matrix product in Triton: ``y = x @ W.T (+ b)`` with one fixed tile shape.

cuBLAS picks its kernel (tile shape, split-K) from the matrix shape, so a row's result can change
with how many rows came with it. Here every output tile [BLOCK_M, BLOCK_N] is computed by exactly
one program, as a K loop of ``tl.dot`` over BLOCK_K slices in order from a float32 accumulator at
zero (no split-K, no stream-K), and the tile shape never depends on M or N: row i's numbers depend
only on row i, W and b (batch invariance), and column j's only on x, W's row j and b_j (so a
subset of W's rows gives bitwise the same columns: tensor-parallel invariance). This is what
deterministic mode runs on CUDA (``layers.linear.Linear`` under ``Numerics.row_tile``). The pure-PyTorch
reference is ``F.linear`` (equal within float32 rounding of the accumulation order, tested).

Tiles are numbered in groups of GROUP_M row tiles (column tiles varying fastest within a group) so
tiles running together share their weight tiles in L2. Two ways to run them, per ``MatmulConfig``:
  * one program per tile (``persistent=False``), or a fixed grid of one program per SM, each
    looping over tiles ``pid, pid + P, ...`` (``persistent``): each tile is still one program's
    whole K loop, so the numbers are the same bits; only which program computes a tile moves;
  * operands read through pointers, or through Hopper's tensor memory accelerator (``tma``: 16-bit
    dtypes on capability >= 9, K rows 16-byte aligned); out-of-range rows, columns and K read as
    zeros either way. The path depends on the dtype, the device and K, never on M or N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LogprobeError
from . import interpreting, triton_available

INTERPRETER_PROGRAMS = 3  # persistent grid under the CPU interpreter: few, so programs loop over tiles

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Tile number -> (row tile, column tile): groups of GROUP_M row tiles, column tiles
        varying fastest within a group, so tiles running together share weight tiles in L2."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m

    @triton.jit
    def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """This program's (row tile, column tile), one program per tile."""
        return tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    @triton.jit
    def _tile_product(x_ptr, w_ptr, x_desc, w_desc, pid_m, pid_n, M, N, K, stride_xm, stride_wn,
                      IEEE: tl.constexpr, TMA: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """float32 [BM, BN] = x tile @ W tile.T: zero, then BLOCK_K steps over K in order."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if TMA:  # 16-bit operands only (never IEEE); the descriptors read out-of-range as 0
            for k0 in range(0, K, BLOCK_K):
                x = x_desc.load([pid_m * BLOCK_M, k0])  # [BM, BK]
                w = w_desc.load([pid_n * BLOCK_N, k0])  # [BN, BK]
                acc = tl.dot(x, w.T, acc)
        else:
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
            rk = tl.arange(0, BLOCK_K)  # [BK]
            xp = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]  # [BM, BK]
            wp = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BK, BN]: W^T tile
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                x = tl.load(xp, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
                w = tl.load(wp, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
                if IEEE:
                    acc = tl.dot(x, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, w, acc)
                xp += BLOCK_K
                wp += BLOCK_K
        return acc

    @triton.jit
    def _store_tile(acc, b_ptr, y_ptr, y_desc, pid_m, pid_n, M, N, stride_ym,
                    HAS_BIAS: tl.constexpr, TMA_STORE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(+ bias in float32), round to y's dtype, write: the same bits through either store."""
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = acc.to(y_ptr.dtype.element_ty)
        if TMA_STORE:  # the descriptor drops rows / columns past M / N
            y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out)
        else:
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
            yp = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
            tl.store(yp, out, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit(do_not_specialize=["M"])  # M changes every batch: one compiled kernel for all
    def _matmul(x_ptr, w_ptr, b_ptr, y_ptr, x_desc, w_desc, y_desc, M, N, K, stride_xm, stride_wn, stride_ym,
                HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, TMA_STORE: tl.constexpr,
                PERSISTENT: tl.constexpr, PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        if PERSISTENT:  # PROGRAMS programs, each computing tiles pid, pid + PROGRAMS, ... whole
            tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
            for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
                pid_m, pid_n = tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
                acc = _tile_product(x_ptr, w_ptr, x_desc, w_desc, pid_m, pid_n, M, N, K, stride_xm, stride_wn,
                                    IEEE, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
                _store_tile(acc, b_ptr, y_ptr, y_desc, pid_m, pid_n, M, N, stride_ym,
                            HAS_BIAS, TMA_STORE, BLOCK_M, BLOCK_N)
        else:
            pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = _tile_product(x_ptr, w_ptr, x_desc, w_desc, pid_m, pid_n, M, N, K, stride_xm, stride_wn,
                                IEEE, TMA, BLOCK_M, BLOCK_N, BLOCK_K)
            _store_tile(acc, b_ptr, y_ptr, y_desc, pid_m, pid_n, M, N, stride_ym, HAS_BIAS, TMA_STORE, BLOCK_M, BLOCK_N)


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    """Tile shape and how tiles run. ``tma``: read x and W through TMA descriptors where the
    device, dtype and K allow (else pointers, same tiles); ``tma_store``: write y through a
    descriptor too (when its rows are 16-byte aligned; the same bits). ``persistent``: one program
    per SM looping over tiles; ``flatten`` / ``warp_specialize``: the compiler hints of that loop
    (``tl.range``). The default, TMA + persistent + flatten at 128x256x64, 8 warps, 3 stages, ran
    llama-8b's shapes at 0.88-1.00 of cuBLAS on an H200, where the earlier pointer kernel at
    256x128 ran at 0.67-0.76 in the same run (bench/gpu_matmul.py, docs/perf.md).

    ``free_sms``: multiprocessors the persistent grid leaves to kernels running beside it (the
    collectives of tensor and expert parallelism). A grid of one program per SM waits, beside
    NCCL's resident blocks, for the SMs those hold, and its last programs then finish their whole
    share of tiles late: 1.49-1.50x the time alone on two H200s, against 1.05-1.09x with 16 SMs
    left free (bench/gpu_matmul_nccl.py). Which program computes a tile is all it moves: the
    same bits."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True
    tma_store: bool = True
    persistent: bool = True
    flatten: bool = True
    warp_specialize: bool = False
    free_sms: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.free_sms, bool) or not isinstance(self.free_sms, int) or self.free_sms < 0:
            raise LogprobeError("free_sms", f"must be a non-negative integer, got {self.free_sms!r}")


DEFAULT_CONFIG = MatmulConfig()


def check_operands(x: torch.Tensor, weight: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], weight [N, K] of one 16/32-bit float dtype on a device a Triton kernel can run
    on; both returned with unit stride in K."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise LogprobeError("x", f"shapes {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise LogprobeError("x", f"dtypes {x.dtype} and {weight.dtype} must match (bf16, fp16 or fp32)")
    if not triton_available() or not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        raise LogprobeError("device", f"{what} runs on CUDA (or CPU under TRITON_INTERPRET=1)")
    return (x if x.stride(1) == 1 else x.contiguous()), (weight if weight.stride(1) == 1 else weight.contiguous())


def uses_tma(x: torch.Tensor, config: MatmulConfig) -> bool:
    """Whether ``invariant_linear(x, ..., config)`` reads through TMA descriptors: the config asks,
    16-bit operands with K > 0 and K's rows a multiple of 16 bytes, on a GPU of capability >= 9 (or
    under the CPU interpreter, which runs descriptors too: that is how CPU tests reach this path).
    A function of the dtype, device and K alone, so every M and N takes the same path."""
    K = x.shape[1]
    if not config.tma or x.dtype == torch.float32 or K == 0 or (K * x.element_size()) % 16:
        return False
    if x.device.type == "cpu":
        return interpreting()
    return torch.cuda.get_device_capability(x.device)[0] >= 9


def _addressable(t: torch.Tensor) -> torch.Tensor:
    """t if a TMA descriptor can read it (16-byte aligned base and row stride), else an aligned
    copy: where the rows sit in memory must not switch the path."""
    if t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(0) >= t.shape[1]:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _programs(device: torch.device, tiles: int, free_sms: int = 0) -> tuple[int, int]:
    """(PROGRAMS constexpr, grid size) of the persistent kernel: one program per SM but
    ``free_sms`` (a constant of the device and config, so one compiled kernel each; at least one
    program), never more programs than tiles."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = INTERPRETER_PROGRAMS
    programs = max(1, sms - free_sms)
    return programs, min(programs, tiles)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     config: MatmulConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype. Row i depends only on x's
    row i, column j only on weight's row j (and b_j): the same bits for any M, N and any config
    with the same tile shape and path (``uses_tma``)."""
    x, weight = check_operands(x, weight, "the invariant matmul")
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    c = config
    tma = uses_tma(x, c)
    tma_store = tma and c.tma_store and (N * y.element_size()) % 16 == 0
    x_desc, w_desc, y_desc = x, weight, y  # placeholders the pointer path never reads
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x, weight = _addressable(x), _addressable(weight)
        x_desc = TensorDescriptor.from_tensor(x, [c.block_m, c.block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k])
        if tma_store:
            y_desc = TensorDescriptor.from_tensor(y, [c.block_m, c.block_n])
    tiles = triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
    programs, grid = _programs(x.device, tiles, c.free_sms) if c.persistent else (1, tiles)
    _matmul[(grid,)](x, weight, bias, y, x_desc, w_desc, y_desc, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
                     HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, TMA=tma, TMA_STORE=tma_store,
                     PERSISTENT=c.persistent, PROGRAMS=programs, FLATTEN=c.flatten, WARP_SPECIALIZE=c.warp_specialize,
                     BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                     num_warps=c.num_warps, num_stages=c.num_stages)
    return y


def config_leaving(free_sms: int) -> MatmulConfig:
    """``DEFAULT_CONFIG`` with ``free_sms`` multiprocessors left to kernels running beside it."""
    return DEFAULT_CONFIG if free_sms == 0 else MatmulConfig(free_sms=free_sms)
