"""First-call cost on the GPU (issue 19: "first-call compile/autotune time reported and kept below
10 s, or cached on disk"): what a user waits for before the first answer, with Triton's kernel cache
empty and then warm.

A random-init Llama of the chosen shape is saved once (bf16 safetensors, ``save_pretrained``). Then,
each in a fresh Python process (what a new ``logprobe`` command or server start is):

* ``load``: ``Scorer(dir, device="cuda")`` (read and place the weights);
* ``first``: the first ``Scorer.logprobs`` call on 8 RL sequences (compiles every Triton kernel the
  call meets, sets up cuBLAS and FlashAttention);
* ``second``: the same call again (the steady state);
* first - second: the one-off cost.

Runs: ``cold`` (an empty ``TRITON_CACHE_DIR``), ``warm`` (the cache the cold run filled), for the
default mode and ``--deterministic``.

    python bench/gpu_first_call.py                     # llama-1b shape
    python bench/gpu_first_call.py --model llama-8b
    python bench/gpu_first_call.py --model tiny --device cpu   # smoke run of the script on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAVED_SHAPES, save_model  # noqa: E402

CHILD = r"""
import json, random, sys, time
import torch
from logprobe import Scorer
path, det, dev, vocab = sys.argv[1], sys.argv[2] == "1", sys.argv[3], int(sys.argv[4])
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
t0 = time.perf_counter()
s = Scorer(path, device=dev, deterministic=det)
sync()
t1 = time.perf_counter()
rng = random.Random(0)
seqs = []
for _ in range(8):
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(256, 1024))]
    seqs.append({"prompt_token_ids": prompt, "completion_token_ids": [rng.randrange(3, vocab) for _ in range(300)]})
a = s.logprobs(seqs, top_k=5, entropy=True)
sync()
t2 = time.perf_counter()
b = s.logprobs(seqs, top_k=5, entropy=True)
sync()
t3 = time.perf_counter()
same = all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
print(json.dumps({"load": t1 - t0, "first": t2 - t1, "second": t3 - t2, "same": same,
                  "budget": s.config.max_batch_tokens}))
"""


def child(path: str, det: bool, cache: str, device: str, vocab: int) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", CHILD, path, "1" if det else "0", device, str(vocab)], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b", choices=sorted(SAVED_SHAPES))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (with --model tiny)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "model")
        t = time.perf_counter()
        save_model(args.model, path, args.device)
        print(f"{args.model}: saved in {time.perf_counter() - t:.1f} s", flush=True)
        rows = []
        for det in (False, True):
            cache = os.path.join(root, f"triton-{int(det)}")
            for run in ("cold", "warm"):
                r = child(path, det, cache, args.device, SAVED_SHAPES[args.model]["vocab_size"])
                rows.append((run, "deterministic" if det else "default", r))
                print(run, det, r, flush=True)
    print("\n| run | mode | load s | first call s | second call s | one-off s | budget | same bits |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for run, mode, r in rows:
        print(f"| {run} | {mode} | {r['load']:.2f} | {r['first']:.2f} | {r['second']:.2f} | "
              f"{r['first'] - r['second']:.2f} | {r['budget']} | {r['same']} |")


if __name__ == "__main__":
    main()
