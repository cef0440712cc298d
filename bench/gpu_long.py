"""How does logprobe score one very long sequence, against transformers' trunk alone?

Workload W4 of common.py (one 32,768-token and one 131,072-token sequence, every token scored)
on random-init bf16 Llama shapes (default llama-8b), one CUDA GPU, at logprobe's defaults
(chunked under the budget, head included). Printed: seconds (best of ``--passes``), tokens/s,
MFU against the bf16 matmul ceiling measured in the run, peak memory above the weights and the
extra memory the head alone takes on the 128k sequence; then the 128k sequence through logprobe
against transformers' trunk alone (``hf.model``: decoder layers and final norm, no LM head, no
log-softmax) on the same weights in one forward (target: logprobe <= 1.15x the trunk).

    python bench/gpu_long.py                          # llama-8b
    python bench/gpu_long.py --models llama-1b --no-baseline
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GiB,
    build_models,
    extra_memory,
    free,
    gpu_banner,
    log,
    run_logprobe,
    sync_time,
    time_workload,
    workload,
)

from logprobe.engine.runner import pack  # noqa: E402
from logprobe.engine.scheduler import plan_work  # noqa: E402
from logprobe.layers.logprob_head import logprob_head  # noqa: E402


def against_trunk(ours, hf, req, batch_tokens) -> None:
    """logprobe scoring every token of ``req`` (defaults) against transformers' trunk alone."""
    ids = torch.tensor(req.tokens[:-1], device="cuda").view(1, -1)
    with torch.inference_mode():
        run_logprobe(ours, [req], batch_tokens)  # warm: this length's chunk shapes
        _, ours_s = sync_time(lambda: run_logprobe(ours, [req], batch_tokens))
        try:
            hf.model(input_ids=ids[:, :4096], use_cache=False)  # warm
            _, trunk_s = sync_time(lambda: hf.model(input_ids=ids, use_cache=False).last_hidden_state)
        except torch.OutOfMemoryError:
            log(f"  W4 {ids.shape[1]:,} tokens: transformers' trunk OOM; logprobe {ours_s:.2f} s")
            return
    log(f"  W4 {ids.shape[1]:,} tokens in one sequence: logprobe (all tokens scored, defaults) {ours_s:.2f} s, "
        f"transformers trunk alone {trunk_s:.2f} s: **{ours_s / trunk_s:.3f}x the trunk** (target <= 1.15)")


def head_memory(model, req) -> float:
    """Extra GiB the head takes on one long request (hidden states already computed)."""
    (batch,) = plan_work([req.tokens[:-1]], len(req.tokens), share=False, chunk=False)
    packed = pack(batch, [req], torch.device("cuda"))
    with torch.inference_mode():
        hidden = model(packed.input_ids, packed.positions, packed.meta)
        rows = hidden[packed.score_rows]
        del hidden
        _, mem = extra_memory(lambda: logprob_head(rows, model.head_params(), packed.targets, packed.temperature,
                                                   top_k=5, entropy=True))
    return mem / GiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-8b")
    ap.add_argument("--no-baseline", action="store_true", help="skip transformers' trunk")
    ap.add_argument("--batch-tokens", type=int, default=None, help="logprobe max_batch_tokens (default: the library's)")
    ap.add_argument("--passes", type=int, default=2, help="timed passes over W4; the best is reported")
    args = ap.parse_args()
    tflops = gpu_banner()
    table = []
    for mname in args.models.split(","):
        hf, ours, lc = build_models(mname, not args.no_baseline)
        weights = torch.cuda.memory_allocated()
        log(f"\n## {mname}: {sum(p.numel() for p in ours.parameters()) / 1e9:.2f} B params (ours), "
            f"{weights / GiB:.1f} GiB allocated with both models")
        run_logprobe(ours, workload("W2", lc.vocab_size)[:64], args.batch_tokens)  # warm-up
        reqs = workload("W4", lc.vocab_size)
        row, _ = time_workload(ours, lc, mname, "W4", reqs, args.batch_tokens, args.passes, tflops, weights)
        row["head_extra"] = head_memory(ours, reqs[-1])
        if hf is not None:
            against_trunk(ours, hf, reqs[-1], args.batch_tokens)
        table.append(row)
        log(f"  logprobe {mname} W4: {row['sec']:.2f} s, {row['tps']:,.0f} tok/s, MFU {row['mfu']:.3f}, "
            f"peak {row['peak']:.1f} GiB, head extra {row['head_extra']:.2f} GiB")
        hf = ours = None
        free()
    log(f"\n## W4 (bf16, random init; matmul ceiling {tflops:.0f} TFLOP/s measured in this run)")
    log("| model | sequences | needed tokens | scored tokens | logprobe s | tok/s (needed) | MFU | MFU (unique) | "
        "peak extra GiB |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in table:
        log(f"| {r['model']} | {r['seqs']} | {r['needed']:,} | {r['scored']:,} | {r['sec']:.2f} | {r['tps']:,.0f} | "
            f"{r['mfu']:.3f} | {r['mfu_unique']:.3f} | {r['peak']:.1f} (head {r['head_extra']:.2f}) |")


if __name__ == "__main__":
    main()
