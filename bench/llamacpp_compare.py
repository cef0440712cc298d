"""Perplexity of the default Q4_1 GGUF: logprobe (packed and dense weights) vs llama.cpp, same token ids.

The wikitext-2 test split is read as the Hugging Face rows (as ``bench/cpu_perplexity.py``),
tokenized by logprobe's tokenizer, and the first ``--tokens`` ids cut into logprobe's "sliding"
windows (context 2048, stride 512, no prefix token). Every engine scores exactly those windows:

* logprobe ``Scorer.perplexity(ids, context_length=2048, stride=512, prefix=False)`` with
  ``load_model(weights="packed")`` (the default) and ``weights="dense"``;
* llama.cpp through llama-cpp-python (``logits_all=True``, one window at a time after
  ``reset()``, weight repacking off: ``use_extra_bufts = False``, see the field notes), in its own
  virtual environment (``--llama-python``) so it never shares a process or a numpy with torch; its
  logits go through a float64 log-softmax here.

Reported: perplexities, their relative difference, per-token |Δ NLL|, and wall and process CPU
time of each engine's scoring (model load excluded; one untimed warm-up forward each).

    python bench/llamacpp_compare.py --llama-python /tmp/lcpp-venv/bin/python            # 32768 tokens
    python bench/llamacpp_compare.py --llama-python /tmp/lcpp-venv/bin/python --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTEXT, STRIDE = 2048, 512


def worker(job_path: str, out_path: str) -> None:
    """Runs inside the llama-cpp-python environment: no torch, no logprobe."""
    import llama_cpp
    import numpy as np

    job = json.loads(Path(job_path).read_text())
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def params_without_repack():
        p = default_params()
        p.use_extra_bufts = False  # the AMX repacked kernels crash on this CPU (field notes)
        return p

    llama_cpp.llama_cpp.llama_model_default_params = params_without_repack
    llm = llama_cpp.Llama(model_path=job["model"], n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=512,
                          logits_all=True, n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False)
    ids = job["ids"]
    llm.reset()
    llm.eval(ids[:256])  # warm-up
    nll: list[float] = []
    c0, t0 = time.process_time(), time.perf_counter()
    for begin, end, score_begin in job["windows"]:
        llm.reset()
        llm.eval(ids[begin:end - 1])
        rows = np.asarray(llm.scores[score_begin - 1 - begin:end - 1 - begin], dtype=np.float64)  # [n, V]
        m = rows.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(rows - m).sum(axis=1))
        targets = np.asarray(ids[score_begin:end])
        nll.extend((lse - rows[np.arange(len(targets)), targets]).tolist())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    Path(out_path).write_text(json.dumps({"nll": nll, "wall": wall, "cpu": cpu,
                                          "version": llama_cpp.__version__}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path,
                    default=Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw-v1/wiki.test.raw")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python (skip if absent)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--engines", default="packed,dense", help="logprobe weight modes to run")
    args = ap.parse_args()

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import cpu_model, git_rev, read_wikitext

    from logprobe import Scorer
    from logprobe.layers.quant_linear import weight_bytes
    from logprobe.loading import load_model
    from logprobe.scoring.windows import sliding_windows

    torch.set_num_threads(args.threads)
    print(f"device : {cpu_model()}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}, "
          f"torch {torch.__version__}, logprobe git {git_rev()}")
    results: dict[str, dict] = {}
    ids = windows = model_path = None
    for mode in args.engines.split(","):
        loaded = load_model(None, "cpu", "float32", weights=mode)
        scorer = Scorer(loaded, progress=False)
        if ids is None:
            model_path = scorer.info.path
            ids = scorer.tokenizer.encode(read_wikitext(args.data))[:args.tokens]
            windows = sliding_windows(len(ids), CONTEXT, STRIDE)
            print(f"model  : {model_path}\ndata   : first {len(ids)} tokens, {len(windows)} windows "
                  f"(context {CONTEXT}, stride {STRIDE}), {sum(w.end - w.begin for w in windows)} forward tokens")
        scorer.perplexity(ids[:256], context_length=CONTEXT, stride=STRIDE, prefix=False)  # warm-up
        c0, t0 = time.process_time(), time.perf_counter()
        res = scorer.perplexity(ids, context_length=CONTEXT, stride=STRIDE, prefix=False, return_token_nlls=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        mem = weight_bytes(loaded.model)
        results[f"logprobe {mode}"] = {"nll": res.token_nlls[0], "wall": wall, "cpu": cpu, "bytes": mem["total"]}
        print(f"logprobe {mode}: ppl {res.perplexity:.4f} in {wall:.1f} s (CPU {cpu:.1f} s), weights "
              f"{mem['total'] / 2**20:.1f} MiB", flush=True)
        del scorer, loaded

    if args.llama_python:
        with tempfile.TemporaryDirectory() as tmp:
            job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
            job.write_text(json.dumps({"model": model_path, "ids": ids, "threads": args.threads,
                                       "windows": [(w.begin, w.end, w.score_begin) for w in windows]}))
            subprocess.run([args.llama_python, __file__, "--worker", str(job), str(out)], check=True)
            r = json.loads(out.read_text())
        results[f"llama.cpp {r['version']}"] = {"nll": r["nll"], "wall": r["wall"], "cpu": r["cpu"], "bytes": None}
        print(f"llama.cpp: ppl {math.exp(sum(r['nll']) / len(r['nll'])):.4f} in {r['wall']:.1f} s "
              f"(CPU {r['cpu']:.1f} s)", flush=True)

    base_name = next(iter(results))
    base = torch.tensor(results[base_name]["nll"], dtype=torch.float64)
    fwd = sum(w.end - w.begin for w in windows)
    print(f"\n| engine | perplexity | Δ vs {base_name} | per-token mean / max abs Δ NLL | wall s | CPU s "
          "| forward tok/s | weight MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        nll = torch.tensor(r["nll"], dtype=torch.float64)
        assert len(nll) == len(base), (name, len(nll), len(base))
        ppl = math.exp(float(nll.mean()))
        d = (nll - base).abs()
        rel = ppl / math.exp(float(base.mean())) - 1
        mib = f"{r['bytes'] / 2**20:.1f}" if r["bytes"] else "—"
        print(f"| {name} | {ppl:.4f} | {100 * rel:+.3f}% | {float(d.mean()):.4f} / {float(d.max()):.4f} | "
              f"{r['wall']:.1f} | {r['cpu']:.1f} | {fwd / r['wall']:.0f} | {mib} |")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
