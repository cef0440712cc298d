"""How fast does logprobe score whole workloads, against transformers on the same weights?

Random-init bf16 Llama shapes (common.MODELS, seed 0) on one CUDA GPU, the workloads W1 (RL
groups), W2 (multiple choice), W3 (perplexity windows) of common.py; W4 (long context) is
bench/gpu_long.py. Per model and workload: logprobe seconds (best of ``--passes``), tokens/s of
the needed tokens, MFU against the bf16 matmul ceiling measured in the run (all needed tokens,
and unique tokens after shared prefixes run once), peak memory above the weights, then the
transformers baseline (right-padded batches sorted by length, ``model(...).logits`` -> float32
log_softmax -> gather) at the best of ``--budgets``, its speed-up and max |Δ| against logprobe.
OOM is reported as OOM.

    python bench/gpu_workloads.py --models llama-1b,llama-8b --workloads W1,W3 --budgets 32768
    python bench/gpu_workloads.py --models llama-8b --workloads W1,W3,W2 --elementwise-ab
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GiB,
    best_of,
    build_models,
    free,
    gpu_banner,
    log,
    run_logprobe,
    run_transformers,
    sync_time,
    time_workload,
    workload,
)

from logprobe import EngineConfig  # noqa: E402
from logprobe.engine.runner import Engine  # noqa: E402


def baseline(args, hf, mname, wname, reqs, ours_lp, weights):
    """transformers at each of ``--budgets``: the best (seconds, budget, extra GiB, max |Δ|) or None (OOM)."""
    best = None
    for budget in args.budgets:
        free()
        torch.cuda.reset_peak_memory_stats()
        try:
            with torch.inference_mode():
                bres, bsec = best_of(args.passes, lambda b=budget: run_transformers(hf, reqs, b),
                                     f"transformers {mname} {wname} budget {budget}")
        except torch.OutOfMemoryError:
            log(f"  transformers {mname} {wname} budget {budget}: OOM")
            continue
        bpeak = torch.cuda.max_memory_allocated()
        d = float((torch.cat(bres) - ours_lp).abs().max())
        log(f"  transformers {mname} {wname} budget {budget}: {bsec:.2f} s, "
            f"{(bpeak - weights) / GiB:.1f} GiB, max |Δ| vs logprobe {d:.3f}")
        if best is None or bsec < best[0]:
            best = (bsec, budget, (bpeak - weights) / GiB, d)
        del bres
    return best


def elementwise_ab(args, ours, mname, wname, reqs, ours_lp, row):
    """The same run with RMSNorm / rotary / SiLU-multiply as PyTorch ops instead of Triton kernels."""
    ours.use_triton_elementwise(False)
    with torch.inference_mode():
        res, sec_t = sync_time(lambda: run_logprobe(ours, reqs, args.batch_tokens))
    ours.use_triton_elementwise(True)
    d = float((torch.cat([r.logprobs for r in res]) - ours_lp).abs().max())
    row["torch_elementwise"], sec = sec_t, row["sec"]
    log(f"  logprobe {mname} {wname} with PyTorch elementwise ops: {sec_t:.2f} s, MFU (unique) "
        f"{row['mfu_unique'] * sec / sec_t:.3f}; Triton ones {sec:.2f} s ({sec_t / sec:.3f}x faster), "
        f"max |Δ| between them {d:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,llama-1b,llama-8b")
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--budgets", default="8192,32768", help="transformers padded-token budgets to try")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="logprobe max_batch_tokens (default: the library's, chosen from free memory)")
    ap.add_argument("--elementwise-ab", action="store_true",
                    help="also time logprobe with RMSNorm/rotary/SiLU-multiply as PyTorch ops")
    ap.add_argument("--passes", type=int, default=2, help="timed passes of each engine over a workload; the best "
                    "is reported, each is logged")
    args = ap.parse_args()
    args.budgets = [int(b) for b in args.budgets.split(",")]
    wnames = args.workloads.split(",")
    if "W4" in wnames:
        sys.exit("W4 is bench/gpu_long.py's")
    tflops = gpu_banner()
    table = []
    for mname in args.models.split(","):
        hf, ours, lc = build_models(mname, not args.no_baseline)
        weights = torch.cuda.memory_allocated()
        log(f"\n## {mname}: {sum(p.numel() for p in ours.parameters()) / 1e9:.2f} B params (ours), "
            f"{weights / GiB:.1f} GiB allocated with both models")
        # warm-up: compiles the Triton kernels and sets up cuBLAS / SDPA
        run_logprobe(ours, workload("W2", lc.vocab_size)[:64], args.batch_tokens)
        budget = Engine(ours, EngineConfig(max_batch_tokens=args.batch_tokens), torch.device("cuda")).config
        log(f"logprobe max_batch_tokens {budget.max_batch_tokens}"
            + (" (the library's default for this model and free memory)" if args.batch_tokens is None else ""))
        for wname in wnames:
            reqs = workload(wname, lc.vocab_size)
            row, ours_lp = time_workload(ours, lc, mname, wname, reqs, args.batch_tokens, args.passes, tflops,
                                         weights)
            if args.elementwise_ab:
                elementwise_ab(args, ours, mname, wname, reqs, ours_lp, row)
            if hf is not None:
                row["base"] = baseline(args, hf, mname, wname, reqs, ours_lp, weights)
            table.append(row)
            log(f"  logprobe {mname} {wname}: {row['sec']:.2f} s, {row['tps']:,.0f} tok/s, MFU {row['mfu']:.3f}, "
                f"peak {row['peak']:.1f} GiB")
        hf = ours = None
        free()
    log(f"\n## workloads (bf16, random init; matmul ceiling {tflops:.0f} TFLOP/s measured in this run; "
        f"logprobe max_batch_tokens {args.batch_tokens or 'default, per model above'})")
    log("MFU: FLOPs of all needed tokens (the work as posed) / time / ceiling; MFU (unique): FLOPs left "
        "after shared prefixes run once (what the GPU actually computed) / time / ceiling")
    log("| model | workload | sequences | needed tokens | scored tokens | logprobe s | tok/s (needed) | MFU | "
        "MFU (unique) | peak extra GiB | transformers s (budget) | transformers extra GiB | speed-up | max abs Δ |")
    log("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in table:
        b = r.get("base")
        if "base" not in r:
            bs = "| — | — | — | —"
        elif b is None:
            bs = "| OOM | OOM | — | —"
        else:
            bs = f"| {b[0]:.2f} ({b[1]}) | {b[2]:.1f} | {b[0] / r['sec']:.2f}x | {b[3]:.3f}"
        log(f"| {r['model']} | {r['wl']} | {r['seqs']} | {r['needed']:,} | {r['scored']:,} | {r['sec']:.2f} | "
            f"{r['tps']:,.0f} | {r['mfu']:.3f} | {r['mfu_unique']:.3f} | {r['peak']:.1f} {bs} |")


if __name__ == "__main__":
    main()
