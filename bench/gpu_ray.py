"""Ray Data on one GPU against the plain library, same rows, same weights (issue 18: "the scaling
seen on the GPU machine with one replica, what a user should expect per GPU").

A random-init Llama (``--model`` shape, bf16) saved once with ``save_pretrained``; RL groups like
bench/common.py's W1 (32 prompts of 256-2048 ids x 8 completions of 16-4096 ids, log-uniform)
written to a Parquet file. Wall-clock seconds of the whole workload:

* **library**: ``Scorer(dir, device="cuda")`` (load timed apart) + reading the file + one
  ``Scorer.logprobs`` call over every row;
* **ray**: ``ray_dataset.run_dataset("logprobs", ...)`` (what ``logprobe ray logprobs --replicas 1
  --gpus-per-replica 1`` runs) on a local ``ray.init(num_gpus=1)``: numbering the rows, the actor's
  start and model load, scoring batch by batch (``--batch-size`` rows each), writing Parquet.

Both in default mode (the defaults a user gets) and deterministic mode; in deterministic mode the
Ray rows must equal the library's bitwise (the script exits 1 otherwise), in default mode the max
|Δ| is printed (rows batched with other rows: float32 rounding).

The GPU machine has no Ray: carry ``ray`` and ``jsonschema`` (+ ``jsonschema-specifications``,
``referencing``, ``rpds-py``) wheels for its Python; pyarrow and pandas are in its image.

    python bench/gpu_ray.py                      # llama-1b, batch sizes 64 and 256
    python bench/gpu_ray.py --model tiny --device cpu --rows-scale 0.02   # smoke run on CPU
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SAVED_SHAPES, save_model  # noqa: E402  (the same random model, saved once)


def rl_groups(vocab: int, scale: float, seed: int = 11) -> list[dict]:
    """W1's shape: 32 prompts x 8 completions (lengths times ``scale``)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(max(1, int(n * scale)))]  # noqa: E731
    rows = []
    for g in range(32):
        prompt = tok(rng.randint(256, 2048))
        for _ in range(8):
            rows.append({"group": g, "prompt_token_ids": prompt,
                         "completion_token_ids": tok(round(math.exp(rng.uniform(math.log(16), math.log(4096)))))})
    return rows


def library(path: str, device: str, rows_file: str, deterministic: bool) -> tuple[float, float, list]:
    from logprobe import Scorer

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    s = Scorer(path, device=device, deterministic=deterministic)
    sync()
    t1 = time.perf_counter()
    rows = pq.read_table(rows_file).to_pylist()
    out = s.logprobs([{k: r[k] for k in ("prompt_token_ids", "completion_token_ids")} for r in rows])
    sync()
    t2 = time.perf_counter()
    s.close()
    del s
    if device == "cuda":
        torch.cuda.empty_cache()
    return t1 - t0, t2 - t0, [o.logprobs for o in out]


def on_ray(path: str, device: str, rows_file: str, out_dir: str, deterministic: bool, batch: int) -> tuple[float, pa.Table]:
    from logprobe.integrations.ray_dataset import read_output, run_dataset

    t = time.perf_counter()
    run_dataset("logprobs", rows_file, out_dir, {"model": path, "device": device, "deterministic": deterministic},
                {}, replicas=1, gpus_per_replica=1 if device == "cuda" else 0, batch_size=batch)
    return time.perf_counter() - t, read_output(out_dir).sort_by("index")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b", choices=sorted(SAVED_SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-sizes", default="64,256", help="Ray batch sizes (rows) to time; 64 is the CLI default")
    ap.add_argument("--rows-scale", type=float, default=1.0, help="length scale of the rows (smoke runs)")
    args = ap.parse_args()
    import ray

    vocab = SAVED_SHAPES[args.model]["vocab_size"]
    rows = rl_groups(vocab, args.rows_scale)
    tokens = sum(len(r["completion_token_ids"]) for r in rows)
    inputs = sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) - 1 for r in rows)
    table, bad = [], 0
    with tempfile.TemporaryDirectory() as d:
        path, rows_file = os.path.join(d, "model"), os.path.join(d, "rows.parquet")
        save_model(args.model, path, args.device)
        pq.write_table(pa.Table.from_pylist(rows), rows_file)
        t = time.perf_counter()
        ray.init(num_cpus=8, num_gpus=1 if args.device == "cuda" else 0, include_dashboard=False,
                 log_to_driver=False)
        print(f"ray.init {time.perf_counter() - t:.1f} s; {len(rows)} rows, {inputs:,} input tokens, "
              f"{tokens:,} scored", flush=True)
        for det in (False, True):
            mode = "deterministic" if det else "default"
            load, whole, want = library(path, args.device, rows_file, det)
            table.append((mode, "library", "-", load, whole, 0.0))
            print(table[-1], flush=True)
            for b in (int(x) for x in args.batch_sizes.split(",")):
                secs, got = on_ray(path, args.device, rows_file, os.path.join(d, f"out-{mode}-{b}"), det, b)
                diff = max(float((torch.tensor(g, dtype=torch.float32) - w).abs().max())
                           for g, w in zip(got["logprobs"].to_pylist(), want))
                bad += det and diff != 0.0
                table.append((mode, "ray, 1 replica x 1 GPU", b, None, secs, diff))
                print(table[-1], flush=True)
        ray.shutdown()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\n{args.model}, {name}, torch {torch.__version__}, {len(rows)} rows, {inputs:,} input tokens")
    print("| mode | run | batch rows | load s | whole s | input tok/s | vs library | max abs Δ |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = {m: w for m, r, _, _, w, _ in table if r == "library"}
    for mode, run, b, load, whole, diff in table:
        print(f"| {mode} | {run} | {b} | {'' if load is None else f'{load:.2f}'} | {whole:.2f} | "
              f"{inputs / whole:,.0f} | {base[mode] / whole:.2f}x | {diff:.2e} |")
    if bad:
        print("deterministic rows differ from the library's", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
