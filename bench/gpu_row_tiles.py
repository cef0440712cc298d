"""Is cuBLAS on fixed row tiles a batch-invariant product, and what does it cost against the
fixed-tile Triton matmul of deterministic mode?

One CUDA GPU, llama-8b's projection shapes (qkv, o, gate+up, down) at M = 32,768 rows, bf16:
cuBLAS ``F.linear`` (TFLOP/s), ``kernels.matmul.invariant_linear`` at a few tile configs and
cuBLAS over 2048- and 4096-row tiles (TFLOP/s and speed relative to cuBLAS; for the tiles, whether
a row's result is bitwise the same at another position in the tile among other rows), and whether
rows 0..99 of the Triton product are bitwise the same alone and inside M. bench/gpu_matmul.py
sweeps the Triton configs themselves.

    python bench/gpu_row_tiles.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_ms, gpu_banner, log  # noqa: E402

from logprobe.kernels.matmul import DEFAULT_CONFIG as MM_DEFAULT  # noqa: E402
from logprobe.kernels.matmul import MatmulConfig, invariant_linear  # noqa: E402


def matmul_section(args) -> None:
    """Deterministic mode's fixed-tile Triton matmul (kernels/matmul.py) against cuBLAS
    (``F.linear``) on llama-8b's projection shapes at M = 32,768 rows, for a few tile configs;
    then M = 100 + the same rows in a larger batch, to show the rows' bits do not move."""
    M = 32768
    shapes = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate+up", 4096, 28672), ("down", 14336, 4096)]
    configs = [MM_DEFAULT, MatmulConfig(128, 256, 64, 8, 8, 3), MatmulConfig(128, 256, 64, 8, 8, 4),
               MatmulConfig(256, 128, 64, 8, 8, 3), MatmulConfig(128, 128, 128, 8, 8, 3),
               MatmulConfig(64, 256, 64, 8, 4, 4)]
    rows = []
    for name, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        flop = 2 * M * N * K
        t_ref = bench_ms(lambda x=x, w=w: F.linear(x, w), args.rep)
        cells = []
        for c in configs:
            try:
                t = bench_ms(lambda x=x, w=w, c=c: invariant_linear(x, w, config=c), args.rep)
                cells.append(f"{flop / t / 1e9:.0f} ({t_ref / t:.2f})")
            except Exception as e:  # a config the compiler or shared memory refuses
                cells.append(f"fail: {type(e).__name__}")
        small = invariant_linear(x[:100].clone(), w)
        same = bool(torch.equal(small, invariant_linear(x, w)[:100]))
        # the alternative: cuBLAS on fixed-shape row tiles (same shape -> same kernel); is a row's
        # result independent of its position in the tile and of the other rows?
        for tile in (2048, 4096):
            t = bench_ms(lambda x=x, w=w, tile=tile: [F.linear(x[i:i + tile], w) for i in range(0, M, tile)], args.rep)
            a = F.linear(x[:tile], w)[:100]
            shifted = torch.cat([x[tile:tile + 37], x[:100], x[2 * tile:3 * tile - 137]])  # [tile, K]
            b = F.linear(shifted, w)[37:137]
            cells.append(f"{flop / t / 1e9:.0f} ({t_ref / t:.2f}) {'bitwise' if torch.equal(a, b) else 'DIFFERS'}")
        rows.append((name, K, N, flop / t_ref / 1e9, cells, same))
        del x, w
        torch.cuda.empty_cache()
    names = ["x".join(str(v) for v in (c.block_m, c.block_n, c.block_k)) + f"/w{c.num_warps}s{c.num_stages}"
             for c in configs] + ["cuBLAS 2048-row tiles", "cuBLAS 4096-row tiles"]
    log("\n| shape | K | N | cuBLAS TFLOP/s | " + " | ".join(names) + " | rows bitwise |")
    log("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " | --- |")
    for name, K, N, ref, cells, same in rows:
        log(f"| {name} | {K} | {N} | {ref:.0f} | " + " | ".join(cells) + f" | {same} |")
    log("(Triton cells: TFLOP/s (speed relative to cuBLAS))")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rep", type=int, default=300, help="do_bench milliseconds per cell")
    args = ap.parse_args()
    gpu_banner()
    matmul_section(args)


if __name__ == "__main__":
    main()
