"""What do per-request options cost: temperature, top-k and entropy on every request of W1?

Random-init bf16 Llama shapes (common.MODELS) on one CUDA GPU, at the default budget: W1 with every
request plain, then with temperature 0.7, top-5 and entropy, then with the top ``--top-ks`` log-probs
at every scored position (distillation's wide top-k: 64 and 256 by default), best of ``--passes``
each (every pass logged); printed: seconds of each and its ratio to plain, measured in the same run.

    python bench/gpu_options.py --models llama-1b,llama-8b
    python bench/gpu_options.py --models llama-8b --top-ks 20,64,256
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import best_of, build_models, gpu_banner, log, workload  # noqa: E402

from logprobe import EngineConfig  # noqa: E402
from logprobe.engine.runner import Engine  # noqa: E402


def options_section(args) -> None:
    """Issue 19's per-request options on whole W1: every request plain, then with temperature 0.7,
    top-5 and entropy, then top-k for each of ``--top-ks``, at the default budget, best of
    ``--passes`` each; each variant's time against plain's of the same run."""
    top_ks = [int(k) for k in args.top_ks.split(",") if k]
    log("\n## W1 with per-request options against plain (options: temperature 0.7 + top-5 + entropy)")
    log("| model | variant | s | × plain |\n| --- | --- | ---: | ---: |")
    for name in args.models.split(","):
        _, ours, lc = build_models(name, baseline=False)
        plain = workload("W1", lc.vocab_size)
        variants = {"plain": plain, "options": [replace(r, temperature=0.7, top_k=5, entropy=True) for r in plain]}
        variants.update({f"top-{k}": [replace(r, top_k=k) for r in plain] for k in top_ks})
        engine = Engine(ours, EngineConfig(progress=False), torch.device("cuda"))
        t = {}
        with torch.inference_mode():
            for label, reqs in variants.items():
                engine.run(reqs[:32])  # compiles this variant's kernels
                t[label] = best_of(args.passes, partial(engine.run, reqs), f"{name} W1 {label}")[1]
        for label, secs in t.items():
            log(f"| {name} | {label} | {secs:.2f} | {secs / t['plain']:.2f}× |")
        del ours, engine
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-1b,llama-8b")
    ap.add_argument("--passes", type=int, default=2, help="timed passes of each; the best is reported")
    ap.add_argument("--top-ks", default="64,256", help="top-k rows (distillation), comma-separated; '' for none")
    args = ap.parse_args()
    gpu_banner()
    options_section(args)


if __name__ == "__main__":
    main()
