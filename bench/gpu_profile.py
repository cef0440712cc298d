"""Where does logprobe's GPU time go on W1: which CUDA kernels, by total time?

Random-init bf16 Llama shapes (common.MODELS) on one CUDA GPU, the default budget: the first
``--profile-requests`` W1 requests run once (compiles), then once under torch.profiler; printed
per model: the top 25 CUDA kernels by total time (calls, ms, share).

    python bench/gpu_profile.py --models llama-8b --profile-requests 64
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_models, gpu_banner, kernel_profile, workload  # noqa: E402

from logprobe import EngineConfig  # noqa: E402
from logprobe.engine.runner import Engine  # noqa: E402


def profile_section(args) -> None:
    """Where logprobe's time goes on W1 (first ``--profile-requests`` requests, default budget), per model."""
    for name in args.models.split(","):
        _, ours, lc = build_models(name, baseline=False)
        reqs = workload("W1", lc.vocab_size)[:args.profile_requests]
        run = partial(Engine(ours, EngineConfig(progress=False), torch.device("cuda")).run, reqs)
        with torch.inference_mode():
            kernel_profile(run, f"{name} W1, first {len(reqs)} requests")
        del ours, run
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-1b,llama-8b")
    ap.add_argument("--profile-requests", type=int, default=64, help="W1 requests profiled")
    args = ap.parse_args()
    gpu_banner()
    profile_section(args)


if __name__ == "__main__":
    main()
