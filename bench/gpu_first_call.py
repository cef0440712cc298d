"""Time to first score: what a user waits for in a new process (a CLI job, a restarted server, a
trainer's new scorer) before the first answer, with every cache empty and then with each cache.

A random-init checkpoint of the chosen shape is saved once (bf16 safetensors, ``save_pretrained``):
``llama-1b`` / ``llama-8b`` (``common.save_model``), ``qwen35-4b`` / ``qwen35-9b`` / ``qwen35-35b-a3b``
(the hybrids: fla-core's autotuned rule kernels), the other families' shapes of
``bench/gpu_families.py`` (``gemma3-4b``, ``gpt-oss-20b`` with MXFP4 experts, ``glm4-9b``,
``phi4-mini``, ``gemma4-e4b``; their default layer cuts) and the mixtures of experts of
``bench/gpu_moe_parallel.py`` (``qwen3-30b-a3b``, ``mla``: DeepSeek-V3's latent attention and router,
``glm-air``: GLM-4.5's). ``NAME@N`` keeps the first N layers (``--layers`` for every model). Then
each run is a fresh Python process:

* ``load``: ``Scorer(dir, device="cuda")``; ``ready``: from the process's start to the same point
  (the imports counted: transformers' import alone is 5-10 s on the GPU image);
* ``first``: the first ``Scorer.logprobs`` call on the whole workload (W1: 256 RL sequences);
* ``second``: the same call again (the steady state); ``same``: bitwise the first call's numbers.

Runs, in order (each its own process; "empty" = a new folder):
  none        Triton's cache empty, the tuning cache empty, no shipped tables: a new machine before
              tuning tables existed
  again       a second process with both caches the first filled (the persistent cache)
  shipped     Triton's cache empty, the tuning cache empty, the first run's tuning file given as the
              shipped table (what a machine of a shipped GPU meets on its first process)
  triton      Triton's cache warm, no tuning cache, no shipped tables (a second process before the
              tuning cache: fla's kernels timed again)
  fresh       Triton's cache and the tuning cache empty, the package's own shipped tables: what a
              user meets on a new machine (``--runs fresh,again``: the per-family table; ``again``
              then reuses fresh's caches)
and ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, device_map="cuda")`` and its
tokenizer in its own process (the load target's anchor): ``load`` after its imports, ``ready``
from the process's start.

The first run's tuning file is copied to ``--out`` (the table to ship in src/logprobe/kernels/tuned/).

    python bench/gpu_first_call.py --models qwen35-4b,llama-1b --out /tmp/tuned
    python bench/gpu_first_call.py --models qwen35-35b-a3b --layers 16 --loads-only   # loads, disk and cache
    python bench/gpu_first_call.py --models qwen35-35b-a3b --layers 16 --loads-only --tp 2  # and at TP = 2
    python bench/gpu_first_call.py --models glm-air@4,gemma4-e4b@12 --loads-only      # the families' loads
    python bench/gpu_first_call.py --runs fresh,again --models gpt-oss-20b,qwen3-30b-a3b@16,mla@8  # families
    python bench/gpu_first_call.py --models tiny --device cpu     # smoke run of the script on CPU
    python bench/gpu_first_call.py --runs fresh,again --models tiny-moe,gpt-oss-20b --device cpu
    python bench/gpu_first_call.py --models qwen35-35b-a3b --layers 4 --loads-only --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    FAMILY_SHAPES,
    HYBRID_MODELS,
    SAVED_SHAPES,
    family_config,
    hf_config,
    moe_config,
    save_model,
    write_gpt_oss,
    write_hf,
    write_hybrid_checkpoint,
    write_moe_checkpoint,
)

# the mixtures of experts of common.MOE_SHAPES this script writes; on CPU their tiny twins
# (``tiny-moe``: the shape "tiny", ``tiny-v3``)
MOES = {"qwen3-30b-a3b": "qwen3-30b-a3b", "mla": "mla", "glm-air": "glm-air", "tiny-moe": "tiny", "tiny-v3": "tiny-v3"}

CHILD = r"""
import time
start = time.perf_counter()  # the process's own start: imports count, as a user waits for them
import json, sys
import torch
sys.path.insert(0, sys.argv[5])
from common import workload
from logprobe import Scorer
path, det, dev, vocab = sys.argv[1], sys.argv[2] == "1", sys.argv[3], int(sys.argv[4])
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
t0 = time.perf_counter()
s = Scorer(path, device=dev, deterministic=det)
sync()
t1 = time.perf_counter()
seqs = [{"prompt_token_ids": r.tokens[:r.score_begin], "completion_token_ids": r.tokens[r.score_begin:]}
        for r in workload("W1", vocab)]
if dev == "cpu":
    seqs = seqs[:4]
a = s.logprobs(seqs)
sync()
t2 = time.perf_counter()
b = s.logprobs(seqs)
sync()
t3 = time.perf_counter()
same = all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
tuning = getattr(s.engine, "tuning", None)
import collections, os, pathlib
cubins = list(pathlib.Path(os.environ.get("TRITON_CACHE_DIR", "/nonexistent")).rglob("*.cubin"))
compiled = len(cubins)
kernels = dict(collections.Counter(c.stem for c in cubins).most_common())  # a name twice: two specializations
print(json.dumps({"compiled": compiled, "kernels": kernels, "ready": t1 - start, "load": t1 - t0, "first": t2 - t1, "second": t3 - t2, "same": same,
                  "budget": s.config.max_batch_tokens, "seeded": tuning.seeded if tuning else 0,
                  "tuned": tuning.tuned if tuning else 0, "first_logprob": float(a[0].logprobs[0])}))
"""

HF_LOAD = r"""
import time
start = time.perf_counter()
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
t = time.perf_counter()
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map=sys.argv[2], dtype=torch.bfloat16)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
torch.cuda.synchronize() if sys.argv[2] == "cuda" else None
print(json.dumps({"load": time.perf_counter() - t, "ready": time.perf_counter() - start}))
"""


LOAD_ONLY = r"""
import time
start = time.perf_counter()
import json, sys, torch
from logprobe import Scorer
if sys.argv[4:] == ["first"]:  # the baseline's accounting: transformers (the tokenizer's) imported before the timer
    from transformers import AutoTokenizer
t = time.perf_counter()
s = Scorer(sys.argv[1], device=sys.argv[2], tensor_parallel_size=int(sys.argv[3]))
torch.cuda.synchronize() if sys.argv[2] == "cuda" else None
print(json.dumps({"load": time.perf_counter() - t, "ready": time.perf_counter() - start}))
s.close() if int(sys.argv[3]) > 1 else None
"""


def evict(path: Path) -> None:
    """Drop the checkpoint's files from the page cache (``POSIX_FADV_DONTNEED``): the next read
    comes from the disk, as on a machine that has not read them since it started."""
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_rows(name: str, path: Path, device: str, tp: int = 1) -> list[tuple[str, dict]]:
    """Loads alone, from the disk (evicted first) and from the page cache, logprobe and transformers
    (and logprobe at ``tp`` ranks, the default expert-parallel size: until its ranks are ready);
    logprobe once more with transformers imported before its timer, as the baseline's is (``Scorer``
    imports it for the tokenizer inside its own)."""
    rows = []
    runs = [("logprobe", LOAD_ONLY, ["1"]), ("transformers", HF_LOAD, []),
            ("logprobe, transformers imported before its timer too", LOAD_ONLY, ["1", "first"])]
    runs += [(f"logprobe TP = {tp}", LOAD_ONLY, [str(tp)])] if tp > 1 else []
    for cache in ("disk", "page cache"):
        for who, code, extra in runs:
            if cache == "disk":
                evict(path)
            r = run_child(code, [str(path), device, *extra], dict(os.environ))
            rows.append((f"load from {cache}: {who}", r))
            print(name, who, cache, r, flush=True)
    return rows


def run_child(code: str, argv: list[str], env: dict, fatal: bool = True) -> dict:
    """The child's JSON line; a failure ends the script (``fatal``) or is a row saying why."""
    out = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        if fatal:
            raise SystemExit(out.stderr[-3000:])
        return {"error": out.stderr.strip().splitlines()[-1][:200] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def save(name: str, path: Path, device: str, layers: int = 0) -> int:
    """Write the checkpoint of shape ``name`` (``layers`` of them, 0 for the shape's own or its
    default cut); returns its vocabulary size."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if name in SAVED_SHAPES:
        save_model(name, str(path), device)
        return SAVED_SHAPES[name]["vocab_size"]
    if name in FAMILY_SHAPES:
        cfg, _ = family_config(name, device == "cpu", str(layers) if layers else "")
        (write_gpt_oss if name == "gpt-oss-20b" else write_hf)(cfg, path, torch.device(device), dtype)
        return cfg.vocab_size
    if name in MOES:
        write_moe_checkpoint(MOES[name], layers, path, device=device)
        return moe_config(MOES[name], layers).vocab_size
    _, cfg = hf_config(name, device == "cpu", layers)
    write_hybrid_checkpoint(cfg, path, torch.device(device), dtype)
    return cfg.vocab_size


def model_rows(name: str, root: Path, device: str, det: bool, out: Path | None, runs: list[str],
               layers: int = 0) -> list[tuple[str, dict]]:
    path = root / name
    t = time.perf_counter()
    vocab = save(name, path, device, layers)
    print(f"{name}: saved in {time.perf_counter() - t:.1f} s", flush=True)
    nothing = root / "nothing-shipped"
    nothing.mkdir(exist_ok=True)
    bench = str(Path(__file__).resolve().parent)
    argv = [str(path), "1" if det else "0", device, str(vocab), bench]

    def env(triton: str, tuning: str, shipped: Path | None) -> dict:
        e = dict(os.environ, TRITON_CACHE_DIR=str(root / triton), LOGPROBE_CACHE=str(root / tuning))
        e.pop("LOGPROBE_SHIPPED_TUNING", None)
        return e if shipped is None else dict(e, LOGPROBE_SHIPPED_TUNING=str(shipped))

    tag = f"{name}-{int(det)}"
    first_cache = root / f"c-{tag}" / "kernels"
    own = None if "fresh" in runs else nothing  # "again" ships what the first of none / fresh did
    setups = {"none": (f"t-{tag}", f"c-{tag}", nothing), "fresh": (f"t-{tag}", f"c-{tag}", None),
              "again": (f"t-{tag}", f"c-{tag}", own), "shipped": (f"t2-{tag}", f"c2-{tag}", first_cache),
              "triton": (f"t-{tag}", f"c3-{tag}", nothing)}
    rows = [(run, run_child(CHILD, argv, env(*setups[run]))) for run in runs]
    if not det:
        rows.append(("transformers", run_child(HF_LOAD, [str(path), device], dict(os.environ), fatal=False)))
    if out is not None and first_cache.is_dir():
        out.mkdir(parents=True, exist_ok=True)
        for f in first_cache.glob("*.json"):
            shutil.copy(f, out / f"{name}-{f.name}")
    for run, r in rows:
        print(name, "deterministic" if det else "default", run, r, flush=True)
    twice = {k: n for k, n in rows[0][1].get("kernels", {}).items() if n > 1}
    if twice:
        print(f"{name}: kernels compiled more than once in its cache (specializations): {twice}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen35-4b",
                    help=f"comma list of {sorted(SAVED_SHAPES) + sorted(HYBRID_MODELS) + list(FAMILY_SHAPES) + list(MOES)}, "
                         "each NAME or NAME@LAYERS")
    ap.add_argument("--runs", default="none,again,shipped,triton",
                    help="comma list of none, fresh, again, shipped, triton (see above; shipped needs none first)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (with --models tiny)")
    ap.add_argument("--modes", default="default", help="default, deterministic or both (comma list)")
    ap.add_argument("--out", type=Path, default=None, help="copy the first run's tuning file here")
    ap.add_argument("--dir", type=Path, default=None, help="where checkpoints and caches go (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=0, help="hybrids: this many layers (0: all)")
    ap.add_argument("--loads-only", action="store_true",
                    help="only the loads, from the disk (evicted) and the page cache, against transformers")
    ap.add_argument("--tp", type=int, default=1,
                    help="with --loads-only: also logprobe at this many ranks (the TP start: workers + their shards)")
    args = ap.parse_args()
    table = []
    if args.loads_only:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            for spec in args.models.split(","):
                name, _, cut = spec.partition("@")
                path = Path(tmp) / name
                t = time.perf_counter()
                save(name, path, args.device, int(cut or args.layers))
                size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30
                print(f"{spec}: {size:.1f} GiB saved in {time.perf_counter() - t:.1f} s", flush=True)
                table += [(spec, run, r) for run, r in load_rows(spec, path, args.device, args.tp)]
                shutil.rmtree(path, ignore_errors=True)  # the next model's room on the disk
        print("\n| model | run | load s (after imports) | ready s (from the process's start) |")
        print("| --- | --- | ---: | ---: |")
        for name, run, r in table:
            print(f"| {name} | {run} | {r['load']:.2f} | {r['ready']:.2f} |")
        return
    runs = args.runs.split(",")
    if not set(runs) <= {"none", "fresh", "again", "shipped", "triton"} or ("shipped" in runs and "none" not in runs):
        sys.exit(f"--runs: {args.runs!r}: a comma list of none, fresh, again, shipped, triton (shipped after none)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for spec in args.models.split(","):
            name, _, cut = spec.partition("@")
            for mode in args.modes.split(","):
                det = mode == "deterministic"
                rows = model_rows(name, Path(tmp), args.device, det, args.out, runs, int(cut or args.layers))
                table += [(spec, mode, run, r) for run, r in rows]
            shutil.rmtree(Path(tmp) / name, ignore_errors=True)  # the next model's room on the disk
    print("\n| model | mode | run | load s | ready s | first call s | second call s | one-off s | budget | seeded | tuned | "
          "Triton kernels in its cache | same |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, mode, run, r in table:
        if run == "transformers":
            if "error" in r:
                print(f"| {name} | | transformers from_pretrained: failed ({r['error']}) | | | | | | | | | | |")
                continue
            print(f"| {name} | | transformers from_pretrained | {r['load']:.2f} | {r['ready']:.2f} | | | | | | | | |")
            continue
        print(f"| {name} | {mode} | {run} | {r['load']:.2f} | {r['ready']:.2f} | {r['first']:.2f} | {r['second']:.2f} | "
              f"{r['first'] - r['second']:.2f} | {r['budget']} | {r['seeded']} | {r['tuned']} | {r['compiled']} | "
              f"{r['same']} |")


if __name__ == "__main__":
    main()
