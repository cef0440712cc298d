"""Which attention runs a packed batch of W1 sequences fastest: the portable per-sequence SDPA loop,
varlen FlashAttention-2 or FlexAttention with a document mask?

One CUDA GPU: W1's first sequences (common.py) packed up to 32,768 tokens, llama-8b's heads (32 q,
8 kv, D 128), bf16, random q / k / v: block-diagonal causal attention by logprobe's portable loop
(SDPA per sequence), varlen FlashAttention-2 in one call (what logprobe runs), FlexAttention with a
document block mask (compiled). Printed: ms, TFLOP/s on the causal FLOPs, max |Δ| against the
loop. bench/gpu_attention.py times the backends at long context.

    python bench/gpu_attention_w1.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_ms, gpu_banner, log, workload  # noqa: E402

from logprobe.layers import attention  # noqa: E402
from logprobe.layers.attention_gpu import flash_varlen_attention  # noqa: E402


def attention_section(args) -> None:
    """Block-diagonal causal attention over one packed W1-like batch, llama-8b heads (32 q, 8 kv, D 128):
    the portable per-sequence SDPA loop, varlen FlashAttention-2 (one call), FlexAttention with a
    document block mask (compiled)."""
    lengths, used = [], 0
    for r in workload("W1", 1000):
        if used + r.num_inputs > 32768:
            break
        lengths.append(r.num_inputs)
        used += r.num_inputs
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    T, Hq, Hkv, D = cu[-1], 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(T, h, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (Hq, Hkv, Hkv))
    scale = D**-0.5
    fl = sum(2 * Hq * D * n * n for n in lengths)  # causal QK and PV
    log(f"\n## attention: one packed batch of {len(lengths)} W1 sequences, {T} tokens, 32 q / 8 kv heads, D 128, bf16")
    meta = attention.AttentionMeta.packed(lengths)
    real = attention.flash_varlen_attention
    attention.flash_varlen_attention = lambda *a, **kw: None  # the portable loop
    loop = lambda: attention.packed_attention(q, k, v, meta, 0, scale)  # noqa: E731
    ref = loop()
    rows = [("portable loop (SDPA per sequence)", bench_ms(loop, rep=300), 0.0)]
    attention.flash_varlen_attention = real
    fa = lambda: flash_varlen_attention(q, k, v, cu, cu, scale)  # noqa: E731
    rows.append(("varlen FlashAttention-2 (kept)", bench_ms(fa, rep=300), float((fa().float() - ref.float()).abs().max())))
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                      torch.tensor(lengths, device="cuda"))

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        bm = create_block_mask(mask_mod, None, None, T, T, device="cuda")
        flex = torch.compile(flex_attention)
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, D]
        fx = lambda: flex(qt, kt, vt, block_mask=bm, scale=scale, enable_gqa=True)[0].transpose(0, 1)  # noqa: E731
        rows.append(("FlexAttention + document block mask", bench_ms(fx, rep=300),
                     float((fx().float() - ref.float()).abs().max())))
    except Exception as e:  # report, don't stop the benchmark
        log(f"FlexAttention failed: {type(e).__name__}: {str(e)[:200]}")
    log("| attention | ms | TFLOP/s | max abs Δ vs loop |")
    log("| --- | ---: | ---: | ---: |")
    for name, ms, d in rows:
        log(f"| {name} | {ms:.3f} | {fl / ms / 1e9:.0f} | {d:.2e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = ap.parse_args()
    gpu_banner()
    attention_section(args)


if __name__ == "__main__":
    main()
