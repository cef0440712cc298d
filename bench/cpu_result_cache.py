"""A repeated evaluation with the result cache (``Scorer(cache=DIR)``): the same multiple-choice
style pairs (a context from a text, four one-line continuations each) scored cold, then again from
the cache, on the default model, CPU. Prints seconds per run, the speed-up and whether every number
came back bitwise equal.

    python bench/cpu_result_cache.py --text ../shared/data/wikitext-2-raw-v1/wiki.test.raw --questions 50
"""

from __future__ import annotations

import argparse
import tempfile
import time

from logprobe import Scorer


def pairs_from(text: str, questions: int, choices: int = 4) -> list[tuple[str, str]]:
    lines = [x.strip() for x in text.splitlines() if len(x.strip()) > 80]
    out = []
    for q in range(questions):
        ctx = lines[q * (choices + 1)][:600]
        for c in range(choices):
            out.append((ctx, " " + lines[q * (choices + 1) + 1 + c][:80]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", required=True)
    ap.add_argument("--questions", type=int, default=50)
    args = ap.parse_args()
    pairs = pairs_from(open(args.text, encoding="utf-8").read(), args.questions)
    with tempfile.TemporaryDirectory() as d:
        rows = []
        for label in ("cold (misses, stored)", "repeated (hits)"):
            t_load = time.perf_counter()
            s = Scorer(cache=d, progress=False)  # a fresh scorer each time: the cache is on disk
            t = time.perf_counter()
            res = s.loglikelihood(pairs)
            end = time.perf_counter()
            rows.append((label, end - t, res, end - t_load))
            s.close()
    (l0, t0, r0, w0), (l1, t1, r1, w1) = rows
    print(f"{len(pairs)} pairs ({args.questions} questions x 4 choices), default model, CPU")
    print("| run | scoring s | with the load and weight fingerprint s |\n| --- | ---: | ---: |")
    for label, t, _, w in rows:
        print(f"| {label} | {t:.3f} | {w:.3f} |")
    print(f"speed-up {t0 / t1:.1f}x scoring, {w0 / w1:.1f}x with the load; numbers equal: {r0 == r1}")


if __name__ == "__main__":
    main()
