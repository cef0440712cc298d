"""Exactness of logprobe on the real default model: per-token |Δ| of log-probs against a float64
transformers forward of the same weights, on wikitext-2 test tokens.

    python3 bench/gpu_exact_default.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text PATH/wiki.test.raw --tokens 10240 --device cuda

For each logprobe dtype (bfloat16, float32) the reference is transformers' own GGUF load
(float32 dequantization) with every weight rounded to that dtype and then run in float64, so both
sides hold the same weight values and the difference is logprobe's arithmetic alone. Windows of
``--window`` tokens, back to back; every token after a window's first is scored.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--text", required=True, help="wikitext-2 raw test file (its start is enough)")
    ap.add_argument("--tokens", type=int, default=10240)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from logprobe import Scorer

    dev = torch.device(args.device)
    path = Path(args.gguf)
    text = Path(args.text).read_text(encoding="utf-8")
    if dev.type == "cuda":
        print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        scorer = Scorer(str(path), device=args.device, dtype=str(dtype).removeprefix("torch."))
        ids = scorer.tokenizer.encode(text[: args.tokens * 8])[: args.tokens + 1]
        wins = [ids[i:i + args.window + 1] for i in range(0, len(ids) - 1, args.window)]
        seqs = [{"prompt_token_ids": w[:1], "completion_token_ids": w[1:]} for w in wins if len(w) > 1]
        t0 = time.perf_counter()
        ours = torch.cat([r.logprobs.double().cpu() for r in scorer.logprobs(seqs)])
        sec = time.perf_counter() - t0
        # the reference: the same weight values (rounded to this dtype), float64 arithmetic
        ref_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32).eval()
        with torch.no_grad():
            for p in ref_model.parameters():
                p.data = p.data.to(dtype).double()
        ref_model.to(dev)
        ref = []
        with torch.no_grad():
            for w in wins:
                x = torch.tensor([w], device=dev)
                lp = ref_model(x).logits[0, :-1].log_softmax(-1)  # [n, V] float64, row i predicts token i + 1
                ref.append(lp.gather(1, x[0, 1:, None])[:, 0].cpu())
        ref = torch.cat(ref)
        d = (ours - ref).abs()
        nll_ours, nll_ref = -ours.mean().item(), -ref.mean().item()
        rows.append((str(dtype).removeprefix("torch."), len(d), d.mean().item(), d.max().item(),
                     torch.tensor(nll_ours).exp().item(), torch.tensor(nll_ref).exp().item(), sec))
        del scorer, ref_model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n## SmolLM2-135M-Instruct Q4_1 (real weights), wikitext-2 test, windows of {args.window}, "
          f"device {args.device}; reference: transformers float64 of the same weight values")
    print("| logprobe dtype | scored tokens | mean abs Δ | max abs Δ | PPL logprobe | PPL reference | logprobe s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r[0]} | {r[1]:,} | {r[2]:.2e} | {r[3]:.2e} | {r[4]:.4f} | {r[5]:.4f} | {r[6]:.2f} |")


if __name__ == "__main__":
    main()
