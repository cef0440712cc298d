"""How fast are GGUF-quantized weights on the GPU, against the same shape in bf16?

One CUDA GPU: random-init llama-8b (common.MODELS) on W3 (perplexity windows) in bf16, then with
every decoder Linear replaced by random ``--gguf-types`` blocks (random codes, small valid scales:
a speed stand-in, not a quantization), each timed with the one-pass Triton expansion (default) and
the PyTorch expansion (before). Printed: seconds, tokens/s, speed against bf16, packed GiB.

    python bench/gpu_gguf.py --gguf-types Q4_K,Q8_0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GiB,
    build_models,
    decoder_linears,
    free,
    gpu_banner,
    log,
    run_logprobe,
    sync_time,
    workload,
)

from logprobe.kernels.gguf_quants import GGML_TYPES, block_values, split_blocks  # noqa: E402
from logprobe.layers.quant_linear import GGUFLinear  # noqa: E402


def random_gguf(model, qtype: str) -> int:
    """Replace every decoder Linear by a ``GGUFLinear`` of random ``qtype`` blocks of its shape
    (random codes, small random scales: a speed stand-in, not a quantization of the weights).
    Returns the packed bytes."""
    type_id = next(t for t, (name, _) in GGML_TYPES.items() if name == qtype)
    rng = np.random.default_rng(0)
    total = 0
    for parent, name in decoder_linears(model):
        m = getattr(parent, name)
        N, K = m.weight.shape
        raw = rng.integers(0, 256, N * (K // block_values(qtype)) * GGML_TYPES[type_id][1], dtype=np.uint8)
        b = split_blocks(raw, type_id, (N, K))
        # valid small scales (random bytes could be inf/NaN as f16)
        b["d"] = (torch.rand(b["d"].shape) * 1e-3 + 1e-4).half()
        if "m" in b:
            b["m"] = (torch.rand(b["m"].shape) * 1e-3).half()
        q = GGUFLinear(qtype, *(b[k].cuda() if k in b else None for k in ("d", "qs", "m")), bias=m.bias)
        total += q.packed_bytes()
        setattr(parent, name, q)
    torch.cuda.empty_cache()
    return total


def gguf_section(args) -> None:
    """Issue 19: GGUF layers on CUDA, llama-8b of random blocks per ``--gguf-types`` on W3, the
    one-pass Triton expansion (default) and the PyTorch expansion (before), against the same shape
    in bf16, one run."""
    _, dense, lc = build_models("llama-8b", False)
    reqs = workload("W3", lc.vocab_size)
    needed = sum(r.num_inputs for r in reqs)
    with torch.inference_mode():
        run_logprobe(dense, reqs[:4], args.batch_tokens)
        _, t_d = sync_time(lambda: run_logprobe(dense, reqs, args.batch_tokens))
    log(f"\n## GGUF on CUDA, llama-8b W3 ({needed:,} tokens, budget {args.batch_tokens or 'default'})")
    log("| weights | expansion | s | tok/s | vs bf16 | packed linear GiB |")
    log("| --- | --- | ---: | ---: | ---: | ---: |")
    log(f"| bf16 | - | {t_d:.2f} | {needed / t_d:,.0f} | 1.00x | - |")
    dense = None
    free()
    for qtype in args.gguf_types.split(","):
        _, quant, _ = build_models("llama-8b", False)
        packed = random_gguf(quant, qtype)
        for one_pass in (True, False):
            GGUFLinear.one_pass = one_pass
            with torch.inference_mode():
                run_logprobe(quant, reqs[:4], args.batch_tokens)
                _, t = sync_time(lambda q=quant: run_logprobe(q, reqs, args.batch_tokens))
            log(f"| {qtype} | {'Triton one pass' if one_pass else 'PyTorch'} | {t:.2f} | {needed / t:,.0f} | "
                f"{t_d / t:.2f}x | {packed / GiB:.2f} |")
        GGUFLinear.one_pass = True
        quant = None
        free()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf-types", default="Q4_K,Q8_0", help="block types to time")
    ap.add_argument("--batch-tokens", type=int, default=None, help="logprobe max_batch_tokens (default: the library's)")
    args = ap.parse_args()
    gpu_banner()
    gguf_section(args)


if __name__ == "__main__":
    main()
