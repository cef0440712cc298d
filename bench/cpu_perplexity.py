"""CPU perplexity benchmark: logprobe vs plain transformers on the same sliding windows.

Reads the wikitext-2 test split as the Hugging Face rows, tokenizes it with the default model's
tokenizer, keeps the first ``--tokens`` ids and scores them twice with the "sliding" policy
(context 2048, stride 512, no prefix token):

* logprobe: ``Scorer.perplexity(ids, context_length=2048, stride=512, prefix=False)``;
* transformers: the same GGUF loaded with ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``
  in float32, one forward per window (batch 1) and batches of up to 4 equal-length windows
  (batch 4), ``model(input_ids).logits`` -> float32 ``log_softmax`` -> gather. The faster batch
  size is the baseline.

Each engine gets one untimed warm-up forward first. The timings are wall-clock; the log also prints
process CPU time and the load average, so a run that shared the cores with something else shows. Run from the repository root:

    .venv/bin/python bench/cpu_perplexity.py                 # full run: 32768 tokens
    .venv/bin/python bench/cpu_perplexity.py --tokens 4096   # smoke run
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from logprobe import Scorer  # noqa: E402
from logprobe.scoring.windows import Window, sliding_windows  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

WIKITEXT = REPO / ".." / "shared" / "data" / "wikitext-2-raw-v1" / "wiki.test.raw"  # the CPU benches' text

def read_wikitext(path: Path) -> str:
    """The test split as the Hugging Face rows, joined with blank lines (the HF perplexity guide)."""
    txt = open(path, encoding="utf-8", newline="").read()
    rows = [ln + "\n" for ln in txt.split("\n")[:-1]]
    rows = [r if r.strip() else "" for r in rows]
    return "\n\n".join(rows)

def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"

def mem_gib() -> float | None:
    try:
        for line in open("/proc/meminfo", encoding="utf-8"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None

def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + (" (+ uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


CONTEXT, STRIDE = 2048, 512


def run_logprobe(scorer: Scorer, ids: list[int]) -> tuple[float, int, float, float]:
    scorer.perplexity(ids[:min(len(ids), 256)], context_length=CONTEXT, stride=STRIDE, prefix=False)  # warm-up
    c0, t0 = time.process_time(), time.perf_counter()
    res = scorer.perplexity(ids, context_length=CONTEXT, stride=STRIDE, prefix=False)
    return res.perplexity, res.num_tokens, time.perf_counter() - t0, time.process_time() - c0


def load_hf(gguf_path: str):
    from transformers import AutoModelForCausalLM

    p = Path(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    return model.eval()


def batches(windows: list[Window], batch_size: int) -> list[list[Window]]:
    """Consecutive windows of equal length, at most ``batch_size`` per batch (no padding)."""
    out: list[list[Window]] = []
    for w in windows:
        if out and len(out[-1]) < batch_size and out[-1][0].end - out[-1][0].begin == w.end - w.begin:
            out[-1].append(w)
        else:
            out.append([w])
    return out


def run_transformers(model, ids: list[int], windows: list[Window], batch_size: int) -> tuple[float, int, float, float]:
    ids_t = torch.tensor(ids, dtype=torch.long)
    with torch.inference_mode():
        _ = model(ids_t[:256].unsqueeze(0)).logits  # warm-up
        c0, t0 = time.process_time(), time.perf_counter()
        nll, n = 0.0, 0
        for group in batches(windows, batch_size):
            input_ids = torch.stack([ids_t[w.begin:w.end] for w in group])
            logits = model(input_ids).logits
            logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V] float32
            # row r predicts the token at position r + 1 within the window
            tok_lp = logp[:, :-1].gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
            for b, w in enumerate(group):
                s = tok_lp[b, w.score_begin - w.begin - 1:]
                nll -= float(s.double().sum())
                n += s.numel()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return math.exp(nll / n), n, seconds, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=WIKITEXT, help="wiki.test.raw (wikitext-2-raw-v1)")
    ap.add_argument("--tokens", type=int, default=32768, help="score the first N tokens")
    ap.add_argument("--batch-sizes", default="1,4", help="transformers batch sizes to try (comma-separated)")
    args = ap.parse_args()

    import transformers

    mem = mem_gib()
    print(f"device : {cpu_model()}, {os.cpu_count()} logical cores, "
          f"{f'{mem:.1f} GiB' if mem else '? GiB'} RAM, torch threads {torch.get_num_threads()}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}, "
          f"logprobe git {git_rev()}")

    scorer = Scorer(progress=False)
    text = read_wikitext(args.data)
    ids = scorer.tokenizer.encode(text)
    print(f"model  : {scorer.info.path} ({scorer.info.backend}, {scorer.info.dtype}, {scorer.info.device})")
    print(f"data   : {args.data} -> {len(ids)} tokens, keeping the first {min(args.tokens, len(ids))}")
    ids = ids[:args.tokens]
    if scorer.tokenizer.add_bos:  # Scorer.perplexity(prefix=False) puts BOS first for such models
        ids = [scorer.tokenizer.bos_id] + ids
    windows = sliding_windows(len(ids), CONTEXT, STRIDE)
    fwd_tokens = sum(w.end - w.begin for w in windows)
    print(f"windows: {len(windows)} (context {CONTEXT}, stride {STRIDE}), {fwd_tokens} forward tokens\n")

    rows = []
    load = os.getloadavg()[0]
    ppl, n, sec, cpu = run_logprobe(scorer, ids)
    rows.append(("logprobe", ppl, n, sec))
    print(f"logprobe done: ppl {ppl:.4f} in {sec:.1f} s (process CPU {cpu:.1f} s = {cpu / sec:.2f} cores busy; "
          f"1-min load average before {load:.2f})", flush=True)
    gguf_path = scorer.info.path
    del scorer

    t0 = time.perf_counter()
    model = load_hf(gguf_path)
    print(f"transformers load: {time.perf_counter() - t0:.1f} s "
          f"(attn_implementation={model.config._attn_implementation})", flush=True)
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        load = os.getloadavg()[0]
        ppl, n, sec, cpu = run_transformers(model, ids, windows, bs)
        rows.append((f"transformers bs{bs}", ppl, n, sec))
        print(f"transformers bs{bs} done: ppl {ppl:.4f} in {sec:.1f} s (process CPU {cpu:.1f} s = "
              f"{cpu / sec:.2f} cores busy; 1-min load average before {load:.2f})", flush=True)

    lp = rows[0]
    base = min(rows[1:], key=lambda r: r[3])
    print()
    print("| engine | perplexity | scored tokens | forward tokens | seconds | scored tok/s | forward tok/s "
          "| speed ratio logprobe/this | \\|Δ ppl\\| vs logprobe |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, ppl, n, sec in rows:
        speed = "—" if name == "logprobe" else f"{sec / lp[3]:.2f}×"
        dppl = "—" if name == "logprobe" else f"{abs(ppl - lp[1]):.2e}"
        mark = " (baseline)" if name == base[0] else ""
        print(f"| {name}{mark} | {ppl:.4f} | {n} | {fwd_tokens} | {sec:.1f} | {n / sec:.0f} | "
              f"{fwd_tokens / sec:.0f} | {speed} | {dppl} |")
    print(f"logprobe git at the end: {git_rev()}")
    print(f"\nspeed ratio logprobe/transformers (baseline {base[0]}): {base[3] / lp[3]:.2f}×, "
          f"|Δ perplexity| {abs(base[1] - lp[1]):.2e}")


if __name__ == "__main__":
    main()
