"""``logprobe warmup``: load a model and run the warm-up rounds (``Scorer.warmup``) so that the
kernels it needs are compiled into Triton's cache and autotuned ones' choices written to the tuning
cache: the next process on this machine (a CLI job, a server restart, a trainer's scorer) starts warm.

    logprobe warmup --model Qwen/Qwen3.5-4B --device cuda
    logprobe warmup --model Qwen/Qwen3.5-4B --device cuda --deterministic   # that mode's kernels
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_warmup_parser(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("warmup", parents=[common], help="compile and tune the model's kernels ahead (first call fast)",
                       description="Load the model and score a few rounds of random token ids that take every "
                                   "path a job takes (a full pass, small and shared-prefix passes, a chunked "
                                   "sequence, top-k / entropy / temperature), so that kernels are compiled into "
                                   "Triton's cache and autotuned kernels' choices saved to $LOGPROBE_CACHE/kernels "
                                   "(default ~/.cache/logprobe/kernels). Run it once per machine, model and mode.")
    p.set_defaults(func=cmd_warmup)


def cmd_warmup(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    scorer = args.make_scorer(args)
    try:
        load = time.perf_counter() - t0
        report = scorer.warmup()
    finally:
        scorer.close()
    report = {"model": scorer.info.name, "device": scorer.info.device, "dtype": scorer.info.dtype,
              "max_batch_tokens": scorer.config.max_batch_tokens, "load_seconds": round(load, 3), **report}
    if args.json:
        print(json.dumps(report))
        return 0
    rounds = ", ".join(f"{k} {v:.2f} s" for k, v in report["rounds"].items())
    print(f"logprobe: warmed {report['model']} ({report['device']}, {report['dtype']}, budget "
          f"{report['max_batch_tokens']}): load {load:.2f} s, warm-up {report['seconds']:.2f} s ({rounds}); "
          f"{report['tuned']} kernel choices recorded"
          + (f", {report['graphs']} CUDA graphs captured (this process's)" if report.get("graphs") else ""),
          file=sys.stderr)
    return 0
