"""Host-side cost of loading a mixture of experts: ``Scorer(dir, device="cpu", dtype="bfloat16")``
against transformers' ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)`` + its
tokenizer (gpu_first_call.py's anchor) on the same bf16 checkpoint, from the page cache, on CPU.

The checkpoint: the Qwen3.5-35B-A3B shape (``common.HYBRID_MODELS``: 256 experts, Gated DeltaNet +
gated attention) cut to ``--layers`` layers, full attention every ``--full-every`` (2: one Gated
DeltaNet and one gated-attention layer in 2 layers), transformers' random init, saved in bf16 with
``save_pretrained`` (2 layers: 5.0 GiB). Each load is a fresh Python process (no import, cache or
allocator state carried over): ``load`` is timed inside it after its imports, ``process`` is the
whole subprocess (imports counted). logprobe reads the tokenizer with transformers, imported inside
``Scorer``, where the baseline imports it before its timer: a second logprobe row imports it first
too (the like-for-like "after imports" figure). Every run is made once to warm the page cache, then
``--repeats`` times; the best is printed with the others. ``--profile``: one more logprobe load
under cProfile, its top functions by cumulative and by own time.

    python bench/cpu_load.py                          # 2 layers, best of 2
    python bench/cpu_load.py --layers 3 --repeats 3
    python bench/cpu_load.py --profile --dir /tmp     # and where logprobe's load goes
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GiB, hf_config, write_hybrid_checkpoint  # noqa: E402

LOGPROBE = r"""
import time
start = time.perf_counter()
import json, sys, torch
from logprobe import Scorer
if sys.argv[2] == "1":  # as the baseline's timer: transformers (the tokenizer's reader) imported before it
    from transformers import AutoTokenizer
t = time.perf_counter()
s = Scorer(sys.argv[1], device="cpu", dtype="bfloat16")
print(json.dumps({"load": time.perf_counter() - t, "ready": time.perf_counter() - start}))
"""

TRANSFORMERS = r"""
import time
start = time.perf_counter()
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
t = time.perf_counter()
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
print(json.dumps({"load": time.perf_counter() - t, "ready": time.perf_counter() - start}))
"""

PROFILED = r"""
import cProfile, io, pstats, sys
from logprobe import Scorer
prof = cProfile.Profile()
prof.enable()
s = Scorer(sys.argv[1], device="cpu", dtype="bfloat16")
prof.disable()
for key in ("cumulative", "tottime"):
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(int(sys.argv[2]))
    print(out.getvalue())
"""


def run_child(code: str, argv: list[str]) -> dict:
    """The child's printed json plus ``process``: the subprocess's whole wall time."""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=1800)
    took = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), process=took)


def save(path: Path, layers: int, every: int) -> float:
    """The cut Qwen3.5-35B-A3B checkpoint at ``path`` (kept when already written); its GiB."""
    import torch

    _, cfg = hf_config("qwen35-35b-a3b", False, layers)
    cfg.layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    print(write_hybrid_checkpoint(cfg, path, torch.device("cpu"), torch.bfloat16), flush=True)
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / GiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--full-every", type=int, default=2, help="full attention every this many layers")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each, after one warming run")
    ap.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the checkpoint is written (kept)")
    ap.add_argument("--profile", action="store_true", help="also one logprobe load under cProfile")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"cpu-load-qwen35-35b-a3b-{args.layers}l"
    size = save(path, args.layers, args.full_every)
    print(f"checkpoint: {path} ({size:.2f} GiB)", flush=True)
    runs = {"logprobe Scorer": (LOGPROBE, ["0"]),
            "logprobe Scorer, transformers imported before the timer": (LOGPROBE, ["1"]),
            "transformers from_pretrained + tokenizer": (TRANSFORMERS, [])}
    got: dict[str, list[dict]] = {who: [] for who in runs}
    for code, extra in runs.values():
        run_child(code, [str(path), *extra])  # warms the page cache (and the disk's: every byte read once)
    for _ in range(args.repeats):  # interleaved: a neighbour's load on the machine falls on all
        for who, (code, extra) in runs.items():
            got[who].append(run_child(code, [str(path), *extra]))
            print(who, got[who][-1], flush=True)
    if args.profile:
        out = subprocess.run([sys.executable, "-c", PROFILED, str(path), "30"], capture_output=True, text=True)
        print(out.stdout or out.stderr[-3000:])
    base = min(r["load"] for r in got["transformers from_pretrained + tokenizer"])
    print(f"\nQwen3.5-35B-A3B shape, {args.layers} layers, {size:.2f} GiB bf16, page cache, best of {args.repeats}\n")
    print("| run | load s (after imports) | × transformers | process s (imports counted) | all loads s |")
    print("| --- | ---: | ---: | ---: | --- |")
    for who, rs in got.items():
        best = min(rs, key=lambda r: r["load"])
        loads = ", ".join(format(r["load"], ".2f") for r in rs)
        print(f"| {who} | {best['load']:.2f} | {best['load'] / base:.2f} | {min(r['process'] for r in rs):.2f} | "
              f"{loads} |")


if __name__ == "__main__":
    main()
