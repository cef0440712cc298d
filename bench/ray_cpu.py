"""Ray Data on one CPU machine against the plain library, same rows, same model (issue 18).

    .venv/bin/python bench/ray_cpu.py [--rows 64] [--batch-size 16] [--replicas 1,2] [--cpus-per-replica 1] [--threads N]

One fixed synthetic RL dataset (seeded: prompts of 64-128 ids, completions of 32-64 ids, ids
inside the vocabulary) written to a temporary Parquet file, the default model
(SmolLM2-135M-Instruct Q4_1 GGUF), CPU float32, deterministic mode. Wall-clock seconds of the
whole workload:

* **library**: ``Scorer(device="cpu", dtype="float32", deterministic=True)`` (model load, timed
  apart too) + reading the Parquet file + one ``Scorer.logprobs`` call over every row;
* **ray, R replicas**: ``ray_dataset.run_dataset("logprobs", ...)``, what ``logprobe ray logprobs
  --input FILE --output DIR --replicas R --cpus-per-replica C --deterministic`` runs, on a local
  Ray started once with ``ray.init(num_cpus=2)`` (its start-up is timed apart, not in the rows/s):
  reading and numbering the rows, starting the actors, one model load per actor, scoring, writing
  the Parquet output.

``run_dataset`` cuts the numbered rows into blocks of ``--batch-size`` rows, so every replica gets
blocks even of a one-file input (before commit 4512614 the input was one block and a second
replica loaded the model and idled).

Every Ray output row must equal the library's row bitwise (logprobs as float32 bits, sum_logprob,
is_greedy); the script exits 1 otherwise. Also printed: the model load and the torch thread count
inside a Ray worker of C CPUs (Ray sets ``OMP_NUM_THREADS`` to a worker's CPUs), and the load
average before and after (other work on the machine shows there).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from logprobe import Scorer


def make_rows(n: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"r{i}",
             "prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(64, 128))],
             "completion_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(32, 64))]}
            for i in range(n)]


def worker_probe(cpus: float) -> tuple[float, int]:
    """Model load seconds and torch threads inside a Ray worker holding ``cpus`` CPUs."""
    import ray

    @ray.remote(num_cpus=cpus)
    def probe() -> tuple[float, int]:
        import torch as t

        from logprobe import Scorer as S

        t0 = time.perf_counter()
        S(device="cpu", dtype="float32", deterministic=True, progress=False)
        return time.perf_counter() - t0, t.get_num_threads()

    return ray.get(probe.remote())


def same_bits(got: pa.Table, want: list, rows: list[dict]) -> int:
    """Rows of ``got`` (a run's output) that differ from the library's; 0 when all equal bitwise."""
    out = sorted(got.to_pylist(), key=lambda r: r["index"])
    if [r["index"] for r in out] != list(range(len(rows))):
        return len(rows)
    bad = 0
    for o, w, r in zip(out, want, rows):
        lp = np.asarray(o["logprobs"], dtype=np.float32)
        ref = w.logprobs.numpy()
        ok = (o["error"] is None and o["id"] == r["id"] and lp.shape == ref.shape
              and np.array_equal(lp.view(np.uint32), ref.view(np.uint32))
              and o["sum_logprob"] == w.sum_logprob and o["is_greedy"] == (w.ranks == 0).tolist())
        bad += not ok
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--replicas", default="1,2", help="comma-separated replica counts, one Ray run each")
    ap.add_argument("--cpus-per-replica", type=float, default=1)
    ap.add_argument("--batch-size", type=int, default=16, help="rows per Ray batch (the CLI's default is 64)")
    ap.add_argument("--ray-cpus", type=int, default=2, help="ray.init(num_cpus=...)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the library run (default: torch's choice; a Ray worker gets its CPUs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-probe", action="store_true", help="skip the model load timed in a Ray worker")
    args = ap.parse_args()
    replicas = [int(x) for x in args.replicas.split(",") if x]
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()

    t0 = time.perf_counter()
    scorer = Scorer(device="cpu", dtype="float32", deterministic=True, progress=False)
    t_load = time.perf_counter() - t0
    rows = make_rows(args.rows, scorer.info.vocab_size, args.seed)
    tokens = sum(len(r["completion_token_ids"]) for r in rows)
    inputs = sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows)
    tmp = tempfile.TemporaryDirectory(prefix="ray_cpu_")
    path = os.path.join(tmp.name, "rollouts.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)

    t1 = time.perf_counter()
    seqs = pq.read_table(path, columns=["prompt_token_ids", "completion_token_ids"]).to_pylist()
    want = scorer.logprobs(seqs)
    t_score = time.perf_counter() - t1
    lib_threads = torch.get_num_threads()
    del scorer

    results = [("library (load + read + 1 logprobs call)", t_load + t_score, 0),
               ("  of which scoring (read + logprobs)", t_score, 0)]

    import ray
    import ray.data

    from logprobe.integrations import ray_dataset

    t2 = time.perf_counter()
    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    t_init = time.perf_counter() - t2
    ray.data.DataContext.get_current().enable_progress_bars = False
    kwargs = {"model": None, "device": "cpu", "dtype": "float32", "deterministic": True, "max_batch_tokens": 8192,
              "tensor_parallel_size": 1}
    options = {"temperature": 1.0, "top_k": 0, "entropy": False}
    failed = 0
    try:
        probe = None if args.no_probe else worker_probe(args.cpus_per_replica)
        for n in replicas:
            out = os.path.join(tmp.name, f"out_{n}")
            s = ray_dataset.run_dataset("logprobs", path, out, kwargs, options, replicas=n,
                                        cpus_per_replica=args.cpus_per_replica, batch_size=args.batch_size)
            bad = same_bits(ray_dataset.read_output(out), want, rows)
            failed += bad or s.failed or s.written != len(rows) or s.tokens != tokens
            results.append((f"ray run_dataset, {n} replica{'s' * (n > 1)} x {args.cpus_per_replica:g} CPU",
                            s.elapsed_s, bad))
    finally:
        ray.shutdown()
        tmp.cleanup()

    base = results[0][1]
    print(f"{args.rows} rows, {tokens} completion tokens scored ({inputs} input tokens), batch size "
          f"{args.batch_size}; torch {torch.__version__}, {os.cpu_count()} CPUs, library torch threads {lib_threads}")
    print(f"model load: library {t_load:.2f} s" + ("" if probe is None else
          f"; in a Ray worker of {args.cpus_per_replica:g} CPU {probe[0]:.2f} s ({probe[1]} torch threads)")
          + f"; ray.init(num_cpus={args.ray_cpus}) {t_init:.2f} s (not in the rows below)")
    print(f"| {'run':<44} | {'rows':>5} | {'tokens':>6} | {'s':>7} | {'rows/s':>7} | {'tokens/s':>8} | "
          f"{'vs library':>10} | {'bitwise':>7} |")
    for label, sec, bad in results:
        same = "-" if label.startswith(("library", " ")) else ("yes" if not bad else f"{bad} differ")
        print(f"| {label:<44} | {args.rows:>5} | {tokens:>6} | {sec:7.2f} | {args.rows / sec:7.2f} | "
              f"{tokens / sec:8.0f} | {base / sec:9.2f}x | {same:>7} |")
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    if failed:
        print("FAILED: Ray rows differ from the library's (or rows missing/failed)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
