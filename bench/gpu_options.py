"""What do per-request options cost: temperature, top-k and entropy on every request of W1?

Random-init bf16 Llama shapes (common.MODELS) on one CUDA GPU, at the default budget: W1 with every
request plain, then with temperature 0.7, top-5 and entropy, best of ``--passes`` each (every pass
logged); printed: seconds of each and the cost of the options. No baseline.

    python bench/gpu_options.py --models llama-1b,llama-8b
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
    top-5 and entropy, at the default budget, best of ``--passes`` each (no baseline)."""
    log("\n## W1 with per-request options (temperature 0.7 + top-5 + entropy) against plain")
    log("| model | plain s | options s | cost |\n| --- | ---: | ---: | ---: |")
    for name in args.models.split(","):
        _, ours, lc = build_models(name, baseline=False)
        plain = workload("W1", lc.vocab_size)
        rich = [replace(r, temperature=0.7, top_k=5, entropy=True) for r in plain]
        engine = Engine(ours, EngineConfig(progress=False), torch.device("cuda"))
        with torch.inference_mode():
            engine.run(rich[:32])  # compiles the top-k / entropy variants
            t = {k: best_of(args.passes, partial(engine.run, reqs), f"{name} W1 {k}")[1]
                 for k, reqs in (("plain", plain), ("options", rich))}
        log(f"| {name} | {t['plain']:.2f} | {t['options']:.2f} | {t['options'] / t['plain'] - 1:+.1%} |")
        del ours, engine
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-1b,llama-8b")
    ap.add_argument("--passes", type=int, default=2, help="timed passes of each; the best is reported")
    args = ap.parse_args()
    gpu_banner()
    options_section(args)


if __name__ == "__main__":
    main()
