"""Engine throughput on CPU against the batch token budget (no server): 120 random-id requests of
32-256 tokens, top_k=1 (what lm-eval's requests ask), default model, float32.

    .venv/bin/python bench/cpu_engine_budget.py
"""

from __future__ import annotations

import random
import time

from logprobe import EngineConfig, Scorer
from logprobe.engine.request import ScoreRequest


def main() -> None:
    s = Scorer(device="cpu", dtype="float32", progress=False)
    rng = random.Random(0)
    reqs = [ScoreRequest([rng.randrange(1000, 40000) for _ in range(rng.randint(32, 256))], 1, 1.0, 1)
            for _ in range(120)]
    total = sum(r.num_inputs for r in reqs)
    print("| budget | tokens/s | s |\n| ---: | ---: | ---: |")
    for budget in [256, 512, 1024, 2048, 4096, 8192]:
        scorer = Scorer(s.loaded, config=EngineConfig(max_batch_tokens=budget))
        scorer.engine.run(reqs[:4])  # warm-up
        t = time.perf_counter()
        scorer.engine.run(reqs)
        dt = time.perf_counter() - t
        print(f"| {budget} | {total / dt:.0f} | {dt:.1f} |", flush=True)


if __name__ == "__main__":
    main()
