"""Deterministic mode's batch-invariant Triton matmul (``kernels/matmul.py``) against cuBLAS on one GPU.

For each shape (default: llama-8b's projections at M = 8192 rows, bf16 in, bf16 out) one markdown
table: cuBLAS ``F.linear``, then each candidate ``MatmulConfig`` below: milliseconds (median of
``triton.testing.do_bench`` after a warm-up call), TFLOP/s, speed relative to cuBLAS, and checks
of the config's output:
  * max |Δ| against the float32 product of the same bf16 inputs (cuBLAS bf16's own Δ on its row:
    the bf16 rounding level both should sit at);
  * rows: rows 0..99 computed alone are bitwise the same as inside the full M (batch invariance);
  * columns: the last N/2 columns computed from ``weight[N//2:]`` alone are bitwise the same as
    inside the full product (tensor-parallel invariance).
A summary table (ratio to cuBLAS per config and shape) comes last. Path: ``tma`` where the
config's TMA descriptors are in use on this device, else ``pointers``.

    python bench/gpu_matmul.py                                   # every config, llama-8b shapes
    python bench/gpu_matmul.py --configs default,tma-p-128x256-s3 --m 16384
    python bench/gpu_matmul.py --shapes 6144x4096,4096x14336     # NxK pairs
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from logprobe.kernels.matmul import DEFAULT_CONFIG, MatmulConfig, invariant_linear, uses_tma

SHAPES = {"llama-8b": [("qkv", 6144, 4096), ("gate+up", 28672, 4096), ("o", 4096, 4096), ("down", 4096, 14336)]}

# name -> config; "-p-": persistent (one program per SM, flattened tile loop), "ptrstore": y written
# through pointers (frees the epilogue's shared memory for a fourth stage), "ws": warp-specialized loop
CONFIGS = {
    "default": DEFAULT_CONFIG,  # = tma-p-128x256-s3
    "ptr-256x128-s3": MatmulConfig(256, 128, 64, 8, 8, 3, tma=False, persistent=False, flatten=False),  # before
    "ptr-p-256x128-s3": MatmulConfig(256, 128, 64, 8, 8, 3, tma=False),
    "tma-256x128-s3": MatmulConfig(256, 128, 64, 8, 8, 3, persistent=False, flatten=False),
    "tma-128x256-s3": MatmulConfig(128, 256, 64, 8, 8, 3, persistent=False, flatten=False),
    "tma-p-128x256-s3": MatmulConfig(128, 256, 64, 8, 8, 3, tma=True, persistent=True, flatten=True),
    "tma-p-128x256-s4-ptrstore": MatmulConfig(128, 256, 64, 8, 8, 4, tma=True, tma_store=False, persistent=True,
                                              flatten=True),
    "tma-p-256x128-s3": MatmulConfig(256, 128, 64, 8, 8, 3, tma=True, persistent=True, flatten=True),
    "tma-p-256x128-s4-ptrstore": MatmulConfig(256, 128, 64, 8, 8, 4, tma=True, tma_store=False, persistent=True,
                                              flatten=True),
    "tma-p-128x128-s4": MatmulConfig(128, 128, 64, 8, 8, 4, tma=True, persistent=True, flatten=True),
    "tma-p-128x256-s3-noflat": MatmulConfig(128, 256, 64, 8, 8, 3, flatten=False),
    "tma-p-128x256-s3-ws": MatmulConfig(128, 256, 64, 8, 8, 3, tma=True, persistent=True, flatten=True,
                                        warp_specialize=True),
    "tma-p-128x256-s3-ws-g16": MatmulConfig(128, 256, 64, 16, 8, 3, tma=True, persistent=True, flatten=True,
                                            warp_specialize=True),
}


def log(*a):
    print(*a, flush=True)


def bench_ms(fn, rep: int) -> float:
    import triton.testing

    fn()  # compile and warm up outside the timing
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, rep=rep, return_mode="median")


def parse_shapes(spec: str) -> list[tuple[str, int, int]]:
    """A named set, or comma-separated NxK pairs."""
    if spec in SHAPES:
        return SHAPES[spec]
    out = []
    for item in spec.split(","):
        n, k = (int(v) for v in item.lower().split("x"))
        out.append((item, n, k))
    return out


def checks(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, ref: torch.Tensor, cfg: MatmulConfig) -> tuple:
    """(max |Δ| to the float32 product, rows 0..99 bitwise alone vs in the batch, last N/2 columns
    bitwise from weight[N//2:] alone vs in the full product)."""
    err = float((y.float() - ref).abs().max())
    rows = torch.equal(invariant_linear(x[:100].clone(), w, config=cfg), y[:100])
    half = w.shape[0] // 2
    cols = torch.equal(invariant_linear(x, w[half:], config=cfg), y[:, half:])
    return err, rows, cols


def shape_table(name: str, M: int, N: int, K: int, configs: dict, rep: int) -> dict[str, float | None]:
    """Print one shape's table; -> {config: ratio to cuBLAS (None if it failed)}."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float())  # [M, N] float32 product of the same bf16 inputs
    tflop = 2 * M * N * K / 1e12
    t_ref = bench_ms(lambda: F.linear(x, w), rep)
    cub_err = float((F.linear(x, w).float() - ref).abs().max())
    log(f"\n### {name}: M = {M}, N = {N}, K = {K}\n")
    log("| kernel | path | ms | TFLOP/s | vs cuBLAS | max abs Δ vs float32 | rows bitwise | columns bitwise |")
    log("| --- | --- | ---: | ---: | ---: | ---: | --- | --- |")
    log(f"| cuBLAS F.linear | | {t_ref:.3f} | {tflop / t_ref * 1e3:.0f} | 1.00 | {cub_err:.2e} | | |")
    ratios = {}
    for cname, cfg in configs.items():
        path = "tma" if uses_tma(x, cfg) else "pointers"
        try:
            t = bench_ms(lambda cfg=cfg: invariant_linear(x, w, config=cfg), rep)
            err, rows, cols = checks(x, w, invariant_linear(x, w, config=cfg), ref, cfg)
        except Exception as e:  # a config the compiler or shared memory refuses: report, go on
            log(f"| {cname} | {path} | fail: {type(e).__name__}: {str(e)[:80]} | | | | | |")
            ratios[cname] = None
            continue
        ratios[cname] = t_ref / t
        log(f"| {cname} | {path} | {t:.3f} | {tflop / t * 1e3:.0f} | {t_ref / t:.2f} | {err:.2e} | {rows} | {cols} |")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-8b", help="llama-8b, or comma-separated NxK pairs (N outputs, K inputs)")
    ap.add_argument("--m", type=int, default=8192, help="rows of x")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of: " + ", ".join(CONFIGS))
    ap.add_argument("--rep", type=int, default=200, help="do_bench milliseconds per measurement")
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_matmul.py needs a CUDA GPU (none found): nothing measured")
    shapes = parse_shapes(args.shapes)
    props = torch.cuda.get_device_properties(0)
    import triton

    log(f"## Invariant matmul vs cuBLAS on {props.name} (capability {props.major}.{props.minor}, "
        f"{props.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}")
    for cname in names:
        log(f"- {cname}: {CONFIGS[cname]}")
    summary = {}
    for name, N, K in shapes:
        summary[name] = shape_table(name, args.m, N, K, {c: CONFIGS[c] for c in names}, args.rep)
        torch.cuda.empty_cache()  # the shape's operands are gone: hand their memory back
    log("\n### Speed relative to cuBLAS (higher is faster)\n")
    log("| config | " + " | ".join(summary) + " |")
    log("| --- | " + " | ".join("---:" for _ in summary) + " |")
    for cname in names:
        cells = [f"{r[cname]:.2f}" if r[cname] is not None else "fail" for r in summary.values()]
        log(f"| {cname} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
