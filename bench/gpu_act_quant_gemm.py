"""How fast are the 8-bit activation-quantized GEMMs (``kernels/act_quant.py``), against bf16 and cuBLAS FP8?

One CUDA GPU, llama-8b's projection shapes at M = 8,192 rows: bf16 ``F.linear``; ``torch._scaled_mm``
with row-wise scales (cuBLAS FP8, where this torch has it; also with fast accumulation); logprobe's
FP8 per-channel, FP8 128-block and INT8 kernels (each over a few tile configs, the best kept, a
non-default config named), the per-channel kernel on Triton FP8 MMA (deterministic mode's); the
fused quantizer. Printed: ms (TFLOP/s), and each kernel's max rel Δ against the float64 product of
the same codes. bench/gpu_act_quant.py ``--sections gemm`` runs this script.

    python bench/gpu_act_quant_gemm.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import log  # noqa: E402

from logprobe.kernels.act_quant import (  # noqa: E402
    ActQuantConfig,
    quantize_rows,
    quantize_rows_reference,
    rowwise_scaled_mm,
    scaled_matmul,
    scaled_matmul_reference,
)

CONFIGS = [ActQuantConfig(), ActQuantConfig(128, 256, 128, 8, 3), ActQuantConfig(128, 128, 128, 4, 4),
           ActQuantConfig(64, 128, 128, 4, 4), ActQuantConfig(128, 64, 128, 4, 4)]


def bench_ms(fn, rep=100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, rep=rep)


def gemm_section() -> None:
    log("## GEMMs, M = 8192 (ms, median of do_bench; TFLOP/s in brackets)")
    log("| N | K | bf16 F.linear | _scaled_mm FP8 row-wise (bf16 default) | _scaled_mm fast accum | FP8 per-channel exact fp16 MMA (float32 "
        "default; best cfg) | FP8 128-block exact | INT8 | FP8 per-channel Triton FP8 MMA (deterministic bf16) | "
        "quantize [M, K] | max rel Δ vs float64: exact kernels | Triton FP8 MMA | _scaled_mm | fast accum |")
    log("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    g = torch.Generator(device="cuda").manual_seed(0)
    for N, K in [(6144, 4096), (28672, 4096), (4096, 4096), (4096, 14336)]:
        cells, errs = gemm_row(8192, N, K, g)
        log(f"| {N} | {K} | " + " | ".join(cells) + f" | {max(errs[2:5]):.1e} | {errs[5]:.1e} | {errs[0]:.1e} | "
            f"{errs[1]:.1e} |")


def gemm_row(M: int, N: int, K: int, g) -> tuple[list[str], float]:
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g) * 0.02

    def tf(ms: float) -> str:
        return f"{ms:.3f} ({2 * M * N * K / ms / 1e9:.0f})"

    wb = w.to(torch.bfloat16)
    cells, errs = [tf(bench_ms(lambda: F.linear(x, wb)))], []
    wc, ws = quantize_rows_reference(w, "float", None)
    xc, xs = quantize_rows(x, "float", None)
    for fast in (False, True):
        try:
            cells.append(tf(bench_ms(lambda fast=fast: rowwise_scaled_mm(xc, xs, wc, ws, None, fast))))
            ref = scaled_matmul_reference(xc[:256], xs[:256], K, wc, ws, K, None, torch.float64)
            y = rowwise_scaled_mm(xc[:256].contiguous(), xs[:256], wc, ws, None, fast)
            errs.append(float((y.double() - ref).abs().max() / ref.abs().max()))  # bf16 output rounding included
            if fast:  # how many bf16 outputs the truncated sums move, against the promoted ones
                slow = rowwise_scaled_mm(xc[:256].contiguous(), xs[:256], wc, ws, None, False)
                cells[-1] += f", {float((y != slow).float().mean()):.1%} of outputs differ"
        except Exception as e:  # noqa: BLE001 - reported in the table
            cells.append(f"n/a ({type(e).__name__})")
            errs.append(float("nan"))
    for kind, ga, gb in (("float", None, None), ("float", 128, 128), ("int", None, None)):
        cells.append(kernel_cell(x, w, kind, ga or K, gb or K, tf, errs))
    cells.append(kernel_cell(x, w, "float", K, K, tf, errs, mma=True))
    cells.append(f"{bench_ms(lambda: quantize_rows(x, 'float', None)):.3f}")
    return cells, errs


def kernel_cell(x, w, kind: str, ga: int, gb: int, tf, errs: list[float], mma: bool = False) -> str:
    K = x.shape[1]
    wc, ws = quantize_rows_reference(w, kind, gb if gb < K else None)
    xc, xs = quantize_rows(x, kind, ga if ga < K else None)
    best = None
    for i, cfg in enumerate(CONFIGS):
        cfg = dataclasses.replace(cfg, fp8_tensor_cores=mma)
        try:
            t = bench_ms(lambda cfg=cfg: scaled_matmul(xc, xs, ga, wc, ws, gb, None, torch.bfloat16, cfg,
                                                       deterministic=True))  # the Triton kernel, never _scaled_mm
        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped, and said
            log(f"(config {cfg} failed: {type(e).__name__})")
            continue
        if best is None or t < best[0]:
            best = (t, i)
    y = scaled_matmul(xc[:256], xs[:256], ga, wc, ws, gb, None, torch.float32,
                      dataclasses.replace(CONFIGS[best[1]], fp8_tensor_cores=mma))
    ref = scaled_matmul_reference(xc[:256], xs[:256], ga, wc, ws, gb, None, torch.float64)
    errs.append(float((y.double() - ref).abs().max() / ref.abs().max()))
    return tf(best[0]) + ("" if best[1] == 0 else f" cfg{best[1]}")


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    gemm_section()


if __name__ == "__main__":
    main()
