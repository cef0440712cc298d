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
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GiB,
    flops,
    free,
    llama_config,
    log,
    matmul_ceiling,
    run_transformers,
    sync_time,
    unique_flops,
    workload,
)

from logprobe import EngineConfig  # noqa: E402
from logprobe.engine.runner import Engine  # noqa: E402
from logprobe.models.llama import LlamaModel  # noqa: E402


def native_from_hf(hf, dtype: torch.dtype, device="cuda"):
    """logprobe's native model (``loading.llama.build_native``, the loader's own builder) of a transformers
    Llama's weights, cast to ``dtype``; returns (model, native config)."""
    # imported here: gpu_tp.py --old-src imports this file over older src trees, which lack it
    from logprobe.loading.hf import native_config
    from logprobe.loading.llama import build_native

    lc, why = native_config(hf.config.to_dict())
    if lc is None:
        raise SystemExit(why)
    with torch.device("meta"):
        names = set(LlamaModel(lc).state_dict().keys())
    tensors = [(k.removeprefix("model."), v.to(dtype)) for k, v in hf.state_dict().items()
               if k.removeprefix("model.") in names]
    return build_native(lc, tensors, torch.device(device), dtype), lc

def build_models(name: str, baseline: bool):
    """Random-init (seed 0) bf16 transformers Llama of ``MODELS[name]`` on CUDA and logprobe's
    native model sharing its weights: (transformers model or None, native model, native config)."""
    import transformers as tf

    cfg = llama_config(name)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = tf.LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    hf.eval()
    ours, lc = native_from_hf(hf, torch.bfloat16)
    return (hf if baseline else None), ours, lc

def best_of(passes: int, fn, label: str):
    """``fn()`` timed ``passes`` times (each pass logged: a first one may compile or warm caches);
    the last result and the best time."""
    secs = []
    for _ in range(max(1, passes)):
        out, sec = sync_time(fn)
        secs.append(sec)
    log(f"  {label} passes: " + ", ".join(f"{t:.2f}" for t in secs) + " s")
    return out, min(secs)

def gpu_banner() -> float:
    """Exits with a one-line message without a CUDA GPU; else logs the device and versions and
    measures the matmul ceiling (TFLOP/s, returned)."""
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import transformers
    import triton

    p = torch.cuda.get_device_properties(0)
    log(f"device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / GiB:.0f} GiB; torch {torch.__version__}, "
        f"triton {triton.__version__}, transformers {transformers.__version__}")
    tflops = matmul_ceiling()
    log(f"bf16 8192^3 matmul: {tflops:.0f} TFLOP/s")
    return tflops

def run_logprobe(model, reqs, batch_tokens, **options):
    """``Engine(model).run(reqs)`` on CUDA. ``options``: EngineConfig fields (``share_prefixes``,
    ``deterministic``, ...); ``batch_tokens`` None: the library's default budget (chosen from free
    memory when the engine starts)."""
    engine = Engine(model, EngineConfig(max_batch_tokens=batch_tokens, progress=False, **options),
                    torch.device("cuda"))
    return engine.run(reqs)

def time_workload(model, lc, mname: str, wname: str, reqs, batch_tokens, passes: int, tflops: float,
                  weights: int) -> tuple[dict, torch.Tensor]:
    """logprobe on one workload, best of ``passes``: the table row (seconds, tok/s of needed tokens,
    peak extra GiB above ``weights``, MFU on all needed / unique tokens) and the logprobs."""
    needed = sum(r.num_inputs for r in reqs)
    fl = flops(lc, [(r.num_inputs, r.num_scored) for r in reqs])
    free()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        res, sec = best_of(passes, lambda: run_logprobe(model, reqs, batch_tokens), f"logprobe {mname} {wname}")
    peak = torch.cuda.max_memory_allocated()
    row = dict(model=mname, wl=wname, seqs=len(reqs), needed=needed, scored=sum(r.num_scored for r in reqs),
               sec=sec, tps=needed / sec, peak=(peak - weights) / GiB, mfu=fl / sec / (tflops * 1e12),
               mfu_unique=unique_flops(lc, reqs) / sec / (tflops * 1e12))
    return row, torch.cat([r.logprobs for r in res])



def profile_pass(model, reqs, batch_tokens, label: str) -> None:
    """One more pass under torch.profiler: the GPU's kernel time by kind (the library's own
    ``executor.profile.kernel_family``) and its 12 largest kernels, against the pass's wall time
    (the share the GPU was busy)."""
    from torch.profiler import ProfilerActivity, profile

    from logprobe.executor.profile import kernel_family

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        run_logprobe(model, reqs, batch_tokens)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels = {}
    for e in prof.key_averages():
        cuda = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if cuda and getattr(getattr(e, "device_type", None), "name", "") == "CUDA":
            kernels[e.key] = kernels.get(e.key, 0.0) + cuda / 1e3  # ms
    total = sum(kernels.values())
    kinds: dict[str, float] = {}
    for name, ms in kernels.items():
        kind = kernel_family(name)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    log(f"\n### {label}: one pass under torch.profiler, wall {wall * 1e3:.0f} ms (with the profiler's cost), "
        f"kernels {total:.0f} ms ({total / 1e3 / wall:.0%} busy)")
    log("| kind | ms | share of kernel time |\n| --- | ---: | ---: |")
    for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        log(f"| {k} | {ms:.1f} | {ms / max(total, 1e-9):.1%} |")
    log("| kernel (12 largest) | ms | share |\n| --- | ---: | ---: |")
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]:
        log(f"| {name[:90]} | {ms:.1f} | {ms / max(total, 1e-9):.1%} |")


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
    ap.add_argument("--profile", action="store_true",
                    help="after timing, one more pass under torch.profiler: kernel time by kind, the largest kernels")
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
            if args.profile:
                try:
                    profile_pass(ours, reqs, args.batch_tokens, f"{mname} {wname}")
                except Exception as e:  # noqa: BLE001 - the timed rows still print
                    log(f"profile of {mname} {wname} failed: {type(e).__name__}: {e}")
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
