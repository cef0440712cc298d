"""How exact are logprobe's log-probs on the GPU, in bfloat16 and float32, against float64?

One CUDA GPU: random-init SmolLM2-135M-shaped weights (seed 0, bf16 values; the GGUF cannot travel
to the GPU machine), 16 random sequences of 50-1500 ids (seed 7), every token scored. Reference:
transformers in eager float64 on the same weights. Printed: mean and max per-token |Δ| of logprobe
in float32 (TF32 off) and in bfloat16. bench/gpu_exact_default.py does the same for the default
model's GGUF on a real text.

    python bench/gpu_exact.py
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_models, gpu_banner, log, native_from_hf, run_logprobe  # noqa: E402

from logprobe.engine.request import ScoreRequest  # noqa: E402


def exact_section(args) -> None:
    """bf16 and float32 logprobe vs float64 logits of the same (bf16-valued) random SmolLM2 weights."""
    hf, ours_bf16, lc = build_models("smollm2-135m", True)
    ref = tf.LlamaForCausalLM(hf.config).to("cuda", torch.float64)
    ref.load_state_dict({k: v.double() for k, v in hf.state_dict().items()})
    ref.eval()
    ours_f32, _ = native_from_hf(hf, torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rng = random.Random(7)
    reqs = []
    for _ in range(16):
        n = rng.randint(50, 1500)
        reqs.append(ScoreRequest([rng.randrange(3, lc.vocab_size) for _ in range(n)], 1))
    refs = []
    with torch.inference_mode():
        for r in reqs:
            logits = ref(input_ids=torch.tensor([r.tokens[:-1]], device="cuda")).logits[0]
            lp = logits.log_softmax(-1).gather(1, torch.tensor(r.tokens[1:], device="cuda")[:, None])[:, 0]
            refs.append(lp.cpu())
    refs = torch.cat(refs)
    log(f"\n## exactness: random-init SmolLM2-135M shape, {len(reqs)} sequences, {refs.numel()} scored tokens, "
        "float64 reference of the same weights (transformers, eager float64)")
    log("| logprobe dtype | mean abs Δ | max abs Δ |")
    log("| --- | ---: | ---: |")
    for name, m in [("float32", ours_f32), ("bfloat16", ours_bf16)]:
        with torch.inference_mode():
            got = torch.cat([x.logprobs for x in run_logprobe(m, reqs, 8192)]).double()
        d = (got - refs).abs()
        log(f"| {name} | {float(d.mean()):.2e} | {float(d.max()):.2e} |")
    torch.backends.cuda.matmul.allow_tf32 = False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = ap.parse_args()
    gpu_banner()
    exact_section(args)


if __name__ == "__main__":
    main()
