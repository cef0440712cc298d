"""Quick CPU cost of deterministic mode, prefix sharing and chunking on the default model.

    .venv/bin/python bench/cpu_deterministic.py [--windows 8] [--repeats 2] [--threads N] [--only-windows]

* perplexity windows: the first ``windows * 512`` wikitext-2 test tokens (random ids when the
  data checkout is missing) as non-overlapping 512-token windows, one forward of all of them
  (max_batch_tokens 8192), fast vs deterministic, alternating, best of ``repeats``;
* multiple choice: one 400-token context, 8 continuations of 20 tokens, shared vs not;
* chunking: one 2048-token sequence at budgets 4096 (whole) and 512 (4 chunks).
Prints wall seconds, process CPU seconds and the load average (other work on the machine shows).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2-raw-v1" / "wiki.test.raw"


def timed(scorer: Scorer, reqs: list[ScoreRequest]) -> tuple[float, float, list]:
    c0, t0 = time.process_time(), time.perf_counter()
    out = scorer.engine.run(reqs)
    return time.perf_counter() - t0, time.process_time() - c0, out


def compare(name: str, engines: dict[str, Scorer], reqs: list[ScoreRequest], repeats: int) -> None:
    best: dict[str, tuple[float, float]] = {}
    outs = {}
    for _ in range(repeats):
        for label, s in engines.items():
            wall, cpu, outs[label] = timed(s, reqs)
            if label not in best or wall < best[label][0]:
                best[label] = (wall, cpu)
    base = next(iter(best.values()))[0]
    rows = sum(r.num_inputs for r in reqs)
    labels = list(engines)
    diff = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(outs[labels[0]], outs[labels[1]]))
    for label, (wall, cpu) in best.items():
        print(f"{name:>16} {label:>14}: {wall:7.2f} s wall  {cpu:7.2f} s cpu  ({rows / wall:6.0f} input tok/s)"
              f"  x{wall / base:.2f}")
    print(f"{name:>16} max |Δ logprob| between the two: {diff:.2e}   load {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--only-windows", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = Scorer(progress=False, device="cpu", dtype="float32")
    det = Scorer(base.loaded, config=EngineConfig(deterministic=True))
    n = args.windows * 512
    if DATA.exists():
        ids = base.tokenizer.encode(DATA.read_text(encoding="utf-8")[: n * 8])[:n + 1]
    else:
        ids = torch.randint(0, base.info.vocab_size, (n + 1,)).tolist()
    windows = [ScoreRequest(ids[i:i + 513], 1) for i in range(0, n, 512)]
    timed(base, windows[:1])  # warm-up
    timed(det, windows[:1])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {len(windows)} windows of 512 inputs")
    compare("512-tok windows", {"fast": base, "deterministic": det}, windows, args.repeats)
    if args.only_windows:
        return

    rng = random.Random(0)
    ctx = ids[:400]
    mc = [ScoreRequest(ctx + [rng.randrange(base.info.vocab_size) for _ in range(20)], 400) for _ in range(8)]
    flat = Scorer(base.loaded, config=EngineConfig(share_prefixes=False))
    compare("mc 400+8x20", {"unshared": flat, "shared": base}, mc, args.repeats)
    flat_det = Scorer(base.loaded, config=EngineConfig(share_prefixes=False, deterministic=True))
    compare("mc det", {"unshared": flat_det, "shared": det}, mc, args.repeats)

    long = [ScoreRequest((ids * 2)[:2049], 1)]
    chunked = Scorer(base.loaded, config=EngineConfig(max_batch_tokens=512))
    compare("2048 tokens", {"whole": base, "chunks of 512": chunked}, long, args.repeats)


if __name__ == "__main__":
    main()
