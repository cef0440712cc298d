"""Which kernel runs W1's packed attention fastest, at each head_dim: PyTorch's FlashAttention-2
(varlen), the project's Triton kernel (``kernels.attention``; its shipped config and others), and
cuDNN's ragged path? Exact?

W1's sequences as the engine packs them (bench/common.py's W1): each prompt once as its own
segment, each completion a segment of its own rows over the prompt's keys (causal aligned
bottom-right), in batches of ``--batch-tokens`` query rows. Random bf16 q/k/v, 32 query heads over
8 key/value heads (``--heads``). Per head_dim: milliseconds summed over the batches (the median of
``triton.testing.do_bench``), TFLOP/s of the causal work, × FlashAttention-2, the largest
|Δ| against FlashAttention-2's output, and on one completion with context each kernel's error
against the float64 definition (``varlen_reference``).

    python bench/gpu_varlen_attention.py
    python bench/gpu_varlen_attention.py --head-dims 64 --configs 64:64:4:3,128:64:8:2,64:128:4:2 --cudnn

A config is ``tile rows:key block:warps:stages`` (``kernels.attention.CONFIGS``); the first of each
head_dim is the shipped one. ``--cudnn`` adds ``aten._cudnn_attention_forward`` with the
cumulative offsets (torch 2.11 on an H200: 14-41 TFLOP/s, and its causal mask top-left, wrong
for completions over a prompt: docs/perf.md, "Attention").
"""

from __future__ import annotations

import argparse

import torch
from common import bench_ms, log, workload

import logprobe.kernels.attention as kernel
from logprobe.layers.attention_gpu import cu_tensors, flash_varlen_attention


def w1_segments() -> list[tuple[int, int]]:
    """(context keys, own rows) of W1's segments in the engine's order: a prompt, then its completions."""
    segs, last = [], None
    for r in workload("W1", 32000):
        p = r.score_begin
        prompt = tuple(r.tokens[:p])
        if prompt != last:
            segs.append((0, p))
            last = prompt
        segs.append((p, len(r.tokens) - 1 - p))  # the last token is a target, never an input
    return segs


def batches(segs: list[tuple[int, int]], budget: int) -> list[list[tuple[int, int]]]:
    out, cur, rows = [], [], 0
    for c, n in segs:
        if cur and rows + n > budget:
            out.append(cur)
            cur, rows = [], 0
        cur.append((c, n))
        rows += n
    return out + [cur]


def offsets(batch) -> tuple[list[int], list[int]]:
    cu_q, cu_k = [0], [0]
    for c, n in batch:
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + c + n)
    return cu_q, cu_k


def run_config(q, k, v, cu_q, cu_k, cu, scale, config):
    """The project's kernel with ``config`` in place of the shipped one for q's head_dim."""
    d = q.shape[-1]
    shipped = kernel.CONFIGS[d]
    kernel.CONFIGS[d] = config
    try:
        rows, _ = kernel.tile_shape(d, q.shape[1], k.shape[1])
        plan = tuple(torch.tensor(x, dtype=torch.int32, device="cuda") for x in kernel.block_plan(cu_q, cu_k, rows))
        fn = lambda: kernel.varlen_triton(q, k, v, *cu, plan, scale)  # noqa: E731
        out = fn()
        return bench_ms(fn, rep=100, warmup=10), out
    finally:
        kernel.CONFIGS[d] = shipped


def cudnn_ragged(q, k, v, cu, max_q, max_k, scale):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, *cu, max_q, max_k, False, 0.0, True, False,
                                                   scale=scale)[0]


def time_batch(batch, d: int, heads: tuple[int, int], configs: list, cudnn: bool, g) -> tuple[dict, dict]:
    """One batch: each kernel's ms and (max |Δ| against FlashAttention-2, max error against float64
    on its first completion over a prompt), keyed by kernel name."""
    hq, hkv = heads
    scale = d**-0.5
    cu_q, cu_k = offsets(batch)
    q = torch.randn(cu_q[-1], hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(cu_k[-1], hkv, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    cu = cu_tensors(cu_q, cu_k, q.device)
    fa = lambda: flash_varlen_attention(q, k, v, cu_q, cu_k, scale, cu=cu)  # noqa: E731
    outs, ms = {"flash-attention-2": fa()}, {"flash-attention-2": bench_ms(fa, rep=100, warmup=10)}
    for config in configs:
        name = f"triton {':'.join(map(str, config))}"
        ms[name], outs[name] = run_config(q, k, v, cu_q, cu_k, cu, scale, config)
    if cudnn:
        max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
        max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
        fn = lambda: cudnn_ragged(q, k, v, cu, max_q, max_k, scale)  # noqa: E731
        outs["cudnn ragged"], ms["cudnn ragged"] = fn(), bench_ms(fn, rep=20, warmup=2)
    s = next(i for i, (c, _) in enumerate(batch) if c)  # a completion over its prompt
    (a, b), (c, e) = cu_q[s:s + 2], cu_k[s:s + 2]
    ref = kernel.varlen_reference(q[a:b].double(), k[c:e].double(), v[c:e].double(), [0, b - a], [0, e - c], scale)
    base = outs["flash-attention-2"].float()
    errs = {name: (float((o.float() - base).abs().max()), float((o[a:b].double() - ref).abs().max()))
            for name, o in outs.items()}
    return ms, errs


def head_dim_rows(args, d: int) -> None:
    heads = tuple(int(x) for x in args.heads.split(","))
    configs = [kernel.CONFIGS[d]] + [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",") if c]
    total, worst, work = {}, {}, 0.0
    g = torch.Generator(device="cuda").manual_seed(0)
    for batch in batches(w1_segments(), args.batch_tokens):
        work += sum(4 * d * heads[0] * n * (c + (n + 1) / 2) for c, n in batch)
        ms, errs = time_batch(batch, d, heads, configs, args.cudnn, g)
        for name in ms:
            total[name] = total.get(name, 0.0) + ms[name]
            worst[name] = tuple(max(x, y) for x, y in zip(worst.get(name, (0.0, 0.0)), errs[name]))
    fa = total["flash-attention-2"]
    log(f"\n### head_dim {d}, {heads[0]} query heads over {heads[1]}, batches of {args.batch_tokens} rows")
    log("| kernel | ms (W1) | TFLOP/s | × FlashAttention-2 | max abs Δ vs FlashAttention-2 | max abs err vs float64 |")
    log("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, t in total.items():
        log(f"| {name} | {t:.2f} | {work / t / 1e9:.0f} | {fa / t:.2f} | {worst[name][0]:.2e} | {worst[name][1]:.2e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--heads", default="32,8", help="query heads, key/value heads")
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--configs", default="", help="more configs to time, rows:block:warps:stages, comma-separated")
    ap.add_argument("--cudnn", action="store_true", help="also cuDNN's ragged path (slow: minutes)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_varlen_attention.py needs a CUDA GPU")
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for d in (int(x) for x in args.head_dims.split(",")):
        head_dim_rows(args, d)


if __name__ == "__main__":
    main()
