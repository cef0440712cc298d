"""What do the engine's options cost on whole workloads: shared-prefix packing, deterministic mode,
the host overlap?

Random-init bf16 Llama shapes (common.MODELS) on one CUDA GPU. Per model, each option off then on,
with every other setting at its default: ``share_prefixes`` on W2 and W1; ``deterministic`` on a
W3 slice and a W1 slice (the first ``--det-windows`` requests; best of two runs each, and the
first 3 requests alone against inside the slice, bitwise); with ``--overlap``, ``overlap_host`` on
W1 and W2 (off: results read before the next batch launches); with ``--det-triton``, deterministic
mode with the Triton fixed-tile matmul. Printed: seconds off / on, their ratio, max |Δ| between them.

    python bench/gpu_engine.py --models llama-1b,llama-8b --det-windows 32
    python bench/gpu_engine.py --models llama-1b,llama-8b --overlap --det-only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_models, free, gpu_banner, log, run_logprobe, sync_time, workload  # noqa: E402

from logprobe.config import Deterministic  # noqa: E402


def engine_modes_section(args) -> None:
    """Issue 4 on the GPU: W2 and W1 with and without shared-prefix packing, and the cost of
    deterministic mode on a W3 slice (the first ``--det-windows`` windows) and a W1 slice."""
    table = []
    for mname in args.models.split(","):
        _, ours, lc = build_models(mname, False)
        run_logprobe(ours, workload("W2", lc.vocab_size)[:64], args.batch_tokens)  # warm-up
        cases = [(w, workload(w, lc.vocab_size), "share_prefixes") for w in ("W2", "W1")]
        cases += [("W3 slice", workload("W3", lc.vocab_size)[:args.det_windows], "deterministic"),
                  ("W1 slice", workload("W1", lc.vocab_size)[:args.det_windows], "deterministic")]
        if args.det_only:
            cases = cases[2:]
        if args.det_triton:
            cases += [(w, reqs, "deterministic, Triton matmul") for w, reqs, o in cases if o == "deterministic"]
        if args.overlap:  # issue 19: results read after the next batch launched (default) vs before
            cases = [(w, workload(w, lc.vocab_size), "overlap_host") for w in ("W1", "W2")] + cases
        for wname, reqs, option in cases:
            base_opt = {"share_prefixes": False} if option == "share_prefixes" else {}
            on_opt = {} if option == "share_prefixes" else {"deterministic": True}
            if option == "overlap_host":  # "off" is the engine before the overlap; "on" the default
                base_opt, on_opt = {"overlap_host": False}, {}
            # deterministic Linears: cuBLAS on fixed 2048-row tiles (default) or the Triton matmul
            if "Triton" in option:
                on_opt["deterministic"] = Deterministic(matmul="triton")
            with torch.inference_mode():
                run_logprobe(ours, reqs[:8], args.batch_tokens, **on_opt)  # warm-up of this mode
                base, t_base = sync_time(lambda r=reqs, o=base_opt, m=ours: run_logprobe(m, r, args.batch_tokens, **o))
                on, t_on = sync_time(lambda r=reqs, o=on_opt, m=ours: run_logprobe(m, r, args.batch_tokens, **o))
                if option not in ("share_prefixes", "overlap_host"):  # short runs: best of two, so a one-off first-call cost does not count
                    t_base = min(t_base, sync_time(lambda r=reqs, o=base_opt, m=ours: run_logprobe(
                        m, r, args.batch_tokens, **o))[1])
                    t_on = min(t_on, sync_time(lambda r=reqs, o=on_opt, m=ours: run_logprobe(
                        m, r, args.batch_tokens, **o))[1])
                if option not in ("share_prefixes", "overlap_host"):  # bitwise: the first 3 requests alone vs in the whole slice
                    alone = run_logprobe(ours, reqs[:3], args.batch_tokens, **on_opt)
                    same = all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(alone, on[:3]))
                    log(f"{mname} {wname} {option}: first 3 requests alone vs in the slice bitwise: {same}")
            d = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(base, on))
            table.append((mname, wname, option, sum(r.num_inputs for r in reqs), t_base, t_on, d))
            log(f"{mname} {wname} {option}: off {t_base:.2f} s, on {t_on:.2f} s, max |Δ| {d:.2e}")
        ours = None
        free()
    log("\n| model | workload | option | input tokens | off s | on s | on / off | max abs Δ |")
    log("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for m, w, o, n, a, b, d in table:
        log(f"| {m} | {w} | {o} | {n:,} | {a:.2f} | {b:.2f} | {b / a:.2f} | {d:.2e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,llama-1b,llama-8b")
    ap.add_argument("--batch-tokens", type=int, default=None, help="logprobe max_batch_tokens (default: the library's)")
    ap.add_argument("--det-only", action="store_true", help="only the deterministic-mode rows (and --overlap's)")
    ap.add_argument("--overlap", action="store_true",
                    help="also W1 and W2 with the host overlap off (before) and on (default)")
    ap.add_argument("--det-triton", action="store_true", help="also deterministic mode with the Triton "
                    "fixed-tile matmul instead of cuBLAS row tiles")
    ap.add_argument("--det-windows", type=int, default=32, help="requests in the deterministic slices")
    args = ap.parse_args()
    gpu_banner()
    engine_modes_section(args)


if __name__ == "__main__":
    main()
