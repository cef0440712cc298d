"""Attention backends on the GPU at long context (issue 19): which kernel runs the 128k request.

Times, for llama-8b's attention shape (32 query heads, 8 key/value heads, head_dim 128, bf16),
the backends PyTorch ships, on the cases logprobe meets:
  * ``square``   one causal sequence of ``--tokens`` (what transformers' trunk runs, in one call);
  * ``chunk``    the last ``--chunk`` queries of a ``--tokens`` sequence against all its keys,
                 causal aligned bottom-right (what logprobe runs per chunk over its KV cache);
  * ``packed``   ``--packed`` sequences of 2048 tokens in one varlen call (W3-like batches).
Backends: the varlen FlashAttention-2 call logprobe makes (``layers.attention_gpu``), the varlen
cuDNN call (``aten._cudnn_attention_forward`` with cumulative offsets), and SDPA with each backend
forced on the dense [1, H, T, D] layout (the ``square`` case only: SDPA's causal mask is top-left).
Each row: milliseconds, TFLOP/s on the causal FLOPs, max |Δ| against FlashAttention-2, and for the
varlen backends whether the first sequence's rows are bitwise the same alone and packed.

    python3 bench/gpu_attention.py                       # 32k square, 32k-of-128k chunk, 16x2048
    python3 bench/gpu_attention.py --tokens 131072 --chunk 32768
"""

from __future__ import annotations

import argparse
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from logprobe.layers import attention
from logprobe.layers.attention import AttentionMeta, KVCache, Segment, packed_attention
from logprobe.layers.attention_gpu import flash_varlen_attention

HQ, HKV, D = 32, 8, 128


def log(msg: str = "") -> None:
    print(msg, flush=True)


def causal_flops(cu_q: list[int], cu_k: list[int]) -> float:
    """2 products x 2 FLOPs x visible (query, key) pairs x HQ x D, bottom-right causal."""
    pairs = 0
    for (qa, qb), (ka, kb) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
        n, m = qb - qa, kb - ka
        pairs += n * (m - n) + n * (n + 1) // 2
    return 4.0 * pairs * HQ * D


def cudnn_varlen(q, k, v, cu_q, cu_k, scale):
    cq = torch.tensor(cu_q, dtype=torch.int32, device=q.device)
    ck = torch.tensor(cu_k, dtype=torch.int32, device=q.device)
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    out = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cq, ck, max_q, max_k, False, 0.0, True, False,
                                                  scale=scale)
    return out[0]


def library(q, k, v, cu_q, cu_k, scale, kv_block):
    """The library's entry point on the same layout: each sequence's earlier keys (m - n of them)
    in a KV cache (a fresh one per call: extending it is part of the cost), its own keys after them.
    Only one sequence over a cache, or sequences without earlier keys, are laid out here (None else)."""
    segs = []
    for (qa, qb), (ka, kb) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
        n, m = qb - qa, kb - ka
        if len(cu_q) == 2 and m > n:  # one chunk over a cache
            cache = KVCache([k[:m - n]], [v[:m - n]])
            meta = AttentionMeta([Segment(0, n, ((0, m - n),))], cache=cache, past=m - n, kv_block=kv_block)
            return packed_attention(q, k[m - n:], v[m - n:], meta, 0, scale)
        segs.append(Segment(qa, qb, ((ka, ka + m - n),) if m > n else ()))
    if any(s.context for s in segs):  # several sequences with earlier keys: not laid out here
        return None
    return packed_attention(q, k, v, AttentionMeta(segs, kv_block=kv_block), 0, scale)


def with_long_rows(rows, fn, *a):
    saved = attention.LONG_ROWS
    attention.LONG_ROWS = rows
    try:
        return fn(*a)
    finally:
        attention.LONG_ROWS = saved


def case(name, lens_q, lens_k, args, gen, sdpa=True):
    cu_q, cu_k = [0], [0]
    for n, m in zip(lens_q, lens_k):
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + m)
    q = torch.randn(cu_q[-1], HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(cu_k[-1], HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(cu_k[-1], HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 1 / math.sqrt(D)
    flops = causal_flops(cu_q, cu_k)
    log(f"\n## {name}: queries {lens_q[:3]}{'...' if len(lens_q) > 3 else ''} keys {lens_k[:3]} "
        f"({flops / 1e12:.1f} TFLOP causal)")
    log("| backend | ms | TFLOP/s | max abs Δ vs FA2 | first sequence alone = packed (varlen rows) |")
    log("| --- | ---: | ---: | ---: | --- |")
    ref = flash_varlen_attention(q, k, v, cu_q, cu_k, scale)
    fns = {"FA2 varlen (logprobe today)": lambda: flash_varlen_attention(q, k, v, cu_q, cu_k, scale),
           "cuDNN varlen": lambda: cudnn_varlen(q, k, v, cu_q, cu_k, scale),
           "logprobe packed_attention (default mode)": lambda: library(q, k, v, cu_q, cu_k, scale, None),
           "logprobe packed_attention (deterministic)": lambda: library(q, k, v, cu_q, cu_k, scale, 64)}
    for rows in args.long_rows:  # the default path with another threshold (attention.LONG_ROWS)
        fns[f"logprobe packed_attention, LONG_ROWS {rows}"] = partial(with_long_rows, rows, library, q, k, v,
                                                                      cu_q, cu_k, scale, None)
    if sdpa and len(lens_q) == 1 and lens_q[0] == lens_k[0]:
        qd, kd, vd = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
        for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            def run(b=b):
                with sdpa_kernel(b):
                    o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
                return o[0].transpose(0, 1)
            fns[f"SDPA {b.name}"] = run

        def default():
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
            return o[0].transpose(0, 1)
        fns["SDPA default choice"] = default
    for label, fn in fns.items():
        try:
            out = fn()
            torch.cuda.synchronize()
            if out is None:
                continue
        except Exception as exc:  # a backend that refuses the shape is a row, not a crash
            log(f"| {label} | – | – | {type(exc).__name__}: {str(exc).splitlines()[0][:90]} | |")
            continue
        ms = do_bench(fn, rep=args.rep)
        delta = (out.float() - ref.float()).abs().max().item()
        alone = "–"
        if ("cuDNN varlen" in label or "FA2" in label) and len(lens_q) > 1:
            n0, m0 = lens_q[0], lens_k[0]
            one = {"FA2 varlen (logprobe today)": flash_varlen_attention,
                   "cuDNN varlen": cudnn_varlen}[label](q[:n0], k[:m0], v[:m0], [0, n0], [0, m0], scale)
            alone = "bitwise" if torch.equal(one, out[:n0]) else f"differs ({(one.float() - out[:n0].float()).abs().max().item():.1e})"
        if label.startswith("logprobe"):
            alone = "run twice: " + ("bitwise" if torch.equal(fn(), out) else "differs")
        log(f"| {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {delta:.2e} | {alone} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=32768)
    ap.add_argument("--square", type=int, default=32768)
    ap.add_argument("--packed", type=int, default=16)
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--long-rows", default="", help="comma-separated LONG_ROWS values to time the library with too")
    ap.add_argument("--cases", default="all", help="all, or 'w1': only the packed cases of W1-like batches")
    args = ap.parse_args()
    args.long_rows = [int(r) for r in args.long_rows.split(",") if r]
    log(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    log(f"SDPA enabled: flash {torch.backends.cuda.flash_sdp_enabled()}, cudnn {torch.backends.cuda.cudnn_sdp_enabled()}, "
        f"efficient {torch.backends.cuda.mem_efficient_sdp_enabled()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.cases == "w1":
        case("packed 16 x 2048", [2048] * 16, [2048] * 16, args, gen)
        case("packed 8 x 4096", [4096] * 8, [4096] * 8, args, gen)
        case("packed 32 x 1024", [1024] * 32, [1024] * 32, args, gen)
        for n in (1024, 2048):
            case(f"square {n}", [n], [n], args, gen, sdpa=False)
        return
    case("square", [args.square], [args.square], args, gen)
    case("chunk", [args.chunk], [args.tokens], args, gen)
    case("chunk + short", [args.chunk, 512], [args.tokens, 512], args, gen)
    case("packed", [2048] * args.packed, [2048] * args.packed, args, gen)
    case("packed, shared prefix", [1000, 300, 300], [1000, 1300, 1300], args, gen)
    for n in (1024, 2048, 4096, 8192, 16384):  # where cuDNN starts to pay (LONG_ROWS)
        case(f"square {n}", [n], [n], args, gen, sdpa=False)
        case(f"chunk {n} of {4 * n}", [n], [4 * n], args, gen)


if __name__ == "__main__":
    main()
