"""How close is the fused log-prob head to the LM-head matmul alone, and to the other fused heads?

One CUDA GPU: the bf16 8192^3 matmul ceiling, then the head at M = ``--head-tokens`` (16,384)
tokens, V = 128,256, H = 4,096, bf16: the LM-head matmul alone (the floor), the plain float32
log_softmax head, logprobe's fused kernel (+entropy, +top-20, +top-64, +top-256), logprobe's PyTorch chunked head, a
packed Q6_K head (chunked, then on its resident bf16 copy), Liger-Kernel and Cut Cross-Entropy
(``reduction="none"``, where installed): ms, ratio to the matmul, TFLOP/s, extra memory and
max |Δ logprob| against the float32 head (float32 products of the same bf16 values); and the
kernel's lse / entropy / top-20 / rank against it. ``--tune`` / ``--tune-topk`` sweep tile
configs first; ``--triton-matmul`` adds a plain Triton matmul with the kernel's tiles.

    python bench/gpu_head.py
    python bench/gpu_head.py --tune --rep 100
    python bench/gpu_head.py --tune-topk --rep 100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GiB, bench_ms, extra_memory, gpu_banner, log  # noqa: E402

from logprobe.kernels.gguf_quants import GGML_TYPES, block_values, split_blocks  # noqa: E402
from logprobe.kernels.logprob_head import DEFAULT_CONFIG, LAUNCH_ERRORS, KernelConfig, fused_logprob_head  # noqa: E402
from logprobe.layers.logprob_head import HeadParams, logprob_head  # noqa: E402
from logprobe.layers.quant_linear import GGUFLinear, PackedEmbedding  # noqa: E402


def head_section(args, tflops: float) -> None:
    M, V, H = args.head_tokens, 128256, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=g)  # post-norm scale
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.05).to(torch.bfloat16)  # logits std ~3
    y = torch.randint(0, V, (M,), device="cuda", generator=g)
    inv_t = torch.ones(M, device="cuda")
    matmul_flops = 2 * M * V * H
    log(f"\n## head: M={M} tokens, V={V}, H={H}, bf16 (matmul ceiling {tflops:.0f} TFLOP/s)")

    # the float32 head: float32 products of the same bf16 values, chunked (no TF32)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = logprob_head(h.float(), HeadParams(w.float()), y, 1.0, top_k=20, entropy=True, backend="torch",
                       token_chunk=4096, vocab_chunk=16384)
    torch.cuda.empty_cache()

    if args.tune:
        log("\nkernel configs (plain, no entropy/top-k):")
        log("| BM | BN | BK | warps | stages | group | waves | TMA | flatten | ms | ratio to matmul |")
        log("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |")
        mm = bench_ms(lambda: h @ w.T, rep=100)
        best = (float("inf"), DEFAULT_CONFIG)
        old = dict(tma=False, flatten=False)  # pointer loads, nested loops (the first version)
        for c in [KernelConfig(**old), KernelConfig(**old, num_stages=4), KernelConfig(**old, block_n=128, num_stages=4),
                  KernelConfig(flatten=False), KernelConfig(tma=False), KernelConfig(),
                  KernelConfig(num_stages=4), KernelConfig(flatten=False, num_stages=4),
                  KernelConfig(block_n=128, num_stages=4), KernelConfig(block_k=128, num_stages=2),
                  KernelConfig(waves=2), KernelConfig(waves=16)]:
            try:
                ms = bench_ms(lambda c=c: fused_logprob_head(h, w, y, inv_t, config=c), rep=100)
            except Exception as e:  # e.g. out of shared memory for a tile shape
                log(f"| {c.block_m} | {c.block_n} | {c.block_k} | {c.num_warps} | {c.num_stages} | "
                    f"{c.group_m} | {c.waves} | {c.tma} | {c.flatten} | failed: {type(e).__name__}: "
                    f"{' '.join(str(e).split())[:160]} | |")
                continue
            log(f"| {c.block_m} | {c.block_n} | {c.block_k} | {c.num_warps} | {c.num_stages} | {c.group_m} | "
                f"{c.waves} | {c.tma} | {c.flatten} | {ms:.2f} | {ms / mm:.3f} |")
            best = min(best, (ms, c), key=lambda x: x[0])
        cfg = best[1]
        log(f"best: {cfg}")
    else:
        cfg = DEFAULT_CONFIG
    if args.tune_topk:
        log("\nkernel configs with top-k (entropy off):")
        log("| top-k waves | flatten | row max first | top-20 ms | × matmul | top-5 ms | × matmul |")
        log("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
        mm = bench_ms(lambda: h @ w.T, rep=100)
        for c in [KernelConfig(), KernelConfig(topk_rowmax=False), KernelConfig(topk_waves=2),
                  KernelConfig(topk_rowmax=False, topk_flatten=True)]:
            cells = []
            for k in (20, 5):
                try:
                    ms = bench_ms(lambda c=c, k=k: fused_logprob_head(h, w, y, inv_t, top_k=k, config=c), rep=args.rep)
                    cells += [f"{ms:.2f}", f"{ms / mm:.3f}"]
                except Exception as e:
                    cells += [f"failed: {type(e).__name__}: {' '.join(str(e).split())[:100]}", ""]
            log(f"| {c.topk_waves} | {c.topk_flatten} | {c.topk_rowmax} | {' | '.join(cells)} |")
        wide_topk_table(h, w, y, inv_t, mm, args.rep)

    rows = []

    def add(name, fn, lp_of=None):
        torch.cuda.empty_cache()
        try:
            out, mem = extra_memory(fn)
            ms = bench_ms(fn, rep=args.rep)
        except torch.OutOfMemoryError:
            rows.append((name, None, None, None))
            return
        except LAUNCH_ERRORS as e:  # a wide top-k whose sorts do not fit this GPU: a row, not an end
            log(f"{name}: did not launch ({type(e).__name__})")
            rows.append((name, None, None, None))
            return
        lp = lp_of(out) if lp_of else None
        d = float((lp.float() - ref.logprobs).abs().max()) if lp is not None else None
        rows.append((name, ms, mem, d))
        del out

    add("LM-head matmul alone (bf16 out, floor)", lambda: h @ w.T)
    if args.triton_matmul:
        out = torch.empty(M, V, device="cuda", dtype=torch.bfloat16)
        add("Triton plain matmul, same tiles as the kernel (bf16 out)", lambda: triton_matmul(h, w, out, cfg))
        del out
    add("plain float32 head: (h@W.T).float().log_softmax().gather",
        lambda: (h @ w.T).float().log_softmax(-1).gather(1, y[:, None])[:, 0], lambda o: o)
    fk = dict(config=cfg)
    add("logprobe fused kernel", lambda: fused_logprob_head(h, w, y, inv_t, **fk), lambda o: o[0])
    add("logprobe fused kernel + entropy", lambda: fused_logprob_head(h, w, y, inv_t, entropy=True, **fk),
        lambda o: o[0])
    add("logprobe fused kernel + top-20", lambda: fused_logprob_head(h, w, y, inv_t, top_k=20, **fk),
        lambda o: o[0])
    add("logprobe fused kernel + entropy + top-20",
        lambda: fused_logprob_head(h, w, y, inv_t, top_k=20, entropy=True, **fk), lambda o: o[0])
    for k in (64, 256):  # wide top-k (sorted key merges): distillation's top-64 / top-256
        add(f"logprobe fused kernel + top-{k}", lambda k=k: fused_logprob_head(h, w, y, inv_t, top_k=k, **fk),
            lambda o: o[0])
    add("logprobe PyTorch chunked head + top-64 (before: wide top-k fell back here)",
        lambda: logprob_head(h, HeadParams(w), y, top_k=64, backend="torch"), lambda o: o.logprobs)
    add("logprobe PyTorch chunked head (512x8192, fallback)",
        lambda: logprob_head(h, HeadParams(w), y, backend="torch"), lambda o: o.logprobs)
    packed = packed_head(V, H)  # random Q6_K blocks (not W): time only, against the matmul
    add("packed Q6_K LM head, chunked (before: expands every chunk)",
        lambda: logprob_head(h, packed, y, backend="torch"))
    packed.weight.resident()  # built once, outside the timing (the first batch's cost)
    add("packed Q6_K LM head, fused kernel on its resident bf16 copy (now)", lambda: logprob_head(h, packed, y))
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="none")
        add("Liger-Kernel fused linear CE (reduction=none)", lambda: liger(w, h, y), lambda o: -o)
    except ImportError as e:
        log(f"Liger-Kernel not available: {e}")
    try:
        from cut_cross_entropy import linear_cross_entropy

        add("Cut Cross-Entropy (reduction=none)", lambda: linear_cross_entropy(h, w, y, reduction="none"),
            lambda o: -o)
    except ImportError as e:
        log(f"cut_cross_entropy not available: {e}")

    # other outputs of the kernel against the float32 head
    lp, lse, rank, ent, tid, tlp = fused_logprob_head(h, w, y, inv_t, top_k=20, entropy=True, config=cfg)
    log(f"kernel vs float32 head: |Δ lse| max {float((lse - ref.logsumexp).abs().max()):.2e}, "
        f"|Δ entropy| max {float((ent - ref.entropy).abs().max()):.2e}, "
        f"|Δ top-20 logprob| max {float((tlp - ref.topk_logprobs).abs().max()):.2e}, "
        f"rank mismatches {int((rank != ref.ranks).sum())}/{M} (max |Δ rank| "
        f"{int((rank - ref.ranks).abs().max())}), top-20 id mismatches "
        f"{int((tid != ref.topk_ids).sum())}/{M * 20}")

    mm = rows[0][1]
    log("\n| head | ms | ratio to matmul | TFLOP/s (matmul FLOPs) | extra memory GiB | max abs Δ logprob vs float32 head |")
    log("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, ms, mem, d in rows:
        if ms is None:
            log(f"| {name} | OOM | | | | |")
            continue
        ds = f"{d:.2e}" if d is not None else "—"
        log(f"| {name} | {ms:.2f} | {ms / mm:.3f} | {matmul_flops / ms / 1e9:.0f} | {mem / GiB:.2f} | {ds} |")


def wide_topk_table(h, w, y, inv_t, mm: float, rep: int) -> None:
    """k = 32 / 64 / 128 / 256 on the insertion path (``insert_top_k`` >= k; 128 or 64 rows per
    program) against the sorted key merges: ms, × matmul, and whether the
    ids and values equal the sorted path's: both are exact, but a different tile shape (rows per
    program, warps) rounds some float32 dot products differently, which can swap near-ties, so
    only rows of the same tile shape must say True."""
    log("\nwide top-k: insertion into registers vs sorted key merges (entropy off):")
    log("| k | path | block_m | warps | ms | × matmul | same as sorted merges |")
    log("| ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for k in (32, 64, 128, 256):
        try:  # the sorted merges' output, where they launch (at k = 256 their sorts may not fit)
            ref = fused_logprob_head(h, w, y, inv_t, top_k=k, config=KernelConfig(insert_top_k=20))
        except LAUNCH_ERRORS:
            ref = None
        for c in (KernelConfig(insert_top_k=20), KernelConfig(insert_top_k=256), KernelConfig(insert_top_k=256, block_m=64),
                  KernelConfig(insert_top_k=256, num_warps=4)):
            path = "insertion" if k <= c.insert_top_k else "sorted merges"
            try:
                out = fused_logprob_head(h, w, y, inv_t, top_k=k, config=c)
                same = "—" if ref is None else torch.equal(out[4], ref[4]) and torch.equal(out[5], ref[5])
                ms = bench_ms(lambda c=c, k=k: fused_logprob_head(h, w, y, inv_t, top_k=k, config=c), rep=rep)
                cells = f"{ms:.2f} | {ms / mm:.3f} | {same}"
            except Exception as e:  # noqa: BLE001 - a config that does not launch is a row, not an end
                cells = f"failed: {type(e).__name__}: {' '.join(str(e).split())[:80]} | | "
            bm = c.wide_block_m if path == "sorted merges" else c.block_m
            log(f"| {k} | {path} | {bm} | {c.num_warps} | {cells} |")


def triton_matmul(a, b, out, cfg):
    """out = a @ b.T with the fused kernel's tiles and loops: separates its main loop from its epilogue."""
    M, K = a.shape
    N = b.shape[0]
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _mm[grid](a, b, out, M, N, K, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, G=cfg.group_m,
              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


if torch.cuda.is_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _mm(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            G: tl.constexpr):
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        group = pid // (G * num_n)
        first = group * G
        gs = tl.minimum(num_m - first, G)
        pm = first + (pid % (G * num_n)) % gs
        pn = (pid % (G * num_n)) // gs
        rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (pn * BN + tl.arange(0, BN)).to(tl.int64)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            x = tl.load(a_ptr + rm[:, None] * K + ks[None, :], mask=(rm < M)[:, None], other=0.0)
            y = tl.load(b_ptr + rn[:, None] * K + ks[None, :], mask=(rn < N)[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(y), acc)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])



def packed_head(V: int, H: int, qtype: str = "Q6_K") -> HeadParams:
    """A [V, H] LM head of random GGUF ``qtype`` blocks (small valid scales) as the head sees a
    packed one: ``HeadParams`` over ``PackedEmbedding(...).weight`` (a ``PackedRows``)."""
    type_id = next(t for t, (name, _) in GGML_TYPES.items() if name == qtype)
    raw = np.random.default_rng(1).integers(0, 256, V * (H // block_values(qtype)) * GGML_TYPES[type_id][1],
                                            dtype=np.uint8)
    b = split_blocks(raw, type_id, (V, H))
    b["d"] = (torch.rand(b["d"].shape) * 1e-3 + 1e-4).half()
    layer = GGUFLinear(qtype, *(b[k].cuda() if k in b else None for k in ("d", "qs", "m")))
    return HeadParams(PackedEmbedding(layer, torch.bfloat16).weight)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-tokens", type=int, default=16384)
    ap.add_argument("--rep", type=int, default=300, help="do_bench milliseconds per head row")
    ap.add_argument("--tune", action="store_true", help="sweep kernel tile configs first")
    ap.add_argument("--tune-topk", action="store_true", help="sweep the top-k settings (splits, flattening)")
    ap.add_argument("--triton-matmul", action="store_true", help="also time a plain Triton matmul")
    args = ap.parse_args()
    head_section(args, gpu_banner())


if __name__ == "__main__":
    main()
