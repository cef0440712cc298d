"""How fast is the fused MoE kernel, against a grouped-GEMM floor and the PyTorch paths?

The MoE MLP alone at the Qwen3-30B-A3B layer shape (H 2048, I 768, 128 experts, top-8; common.py)
for T = ``--kernel-tokens`` (8192) tokens routed by a random router: logprobe's fused Triton kernel
(``kernels.moe.fused_moe``), its PyTorch reference ``moe_reference`` (a loop over the experts), the
model's PyTorch segment path (``Experts.reference``, also with deterministic mode's fixed 2048-row
tiles), against a grouped-GEMM floor: the same two GEMMs alone (gate|up, then down) as one
``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` call each over the expert-sorted rows
(else ``bmm`` over padded per-expert segments), and a dense lower bound (the same FLOPs with one
expert's weights). Printed: ms, TFLOP/s, ratio to the floor, max rel Δ against a float32
``moe_reference`` of the same values, whether 100 tokens' rows are bitwise the same alone and in
the batch; on CUDA, the combine of the k expert rows (PyTorch ops vs ``combine_slots``). The
kernel has no deterministic variant: deterministic mode runs it as is (fixed tiles, no split-K).
``--tune`` adds a sweep of ``MoeKernelConfig`` tiles. bench/gpu_moe.py ``--sections kernel`` runs
this script.

    python bench/gpu_moe_kernel.py --tune
    python bench/gpu_moe_kernel.py --kernel-tokens 32768 --tune
    python bench/gpu_moe_kernel.py --device cpu --tiny --tune     # CPU, under Triton's interpreter
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QWEN3_30B_A3B, QWEN3_MOE_TINY, log, matmul_ceiling, sync_time  # noqa: E402

from logprobe.config import Deterministic  # noqa: E402
from logprobe.kernels.moe import (  # noqa: E402
    DEFAULT_CONFIG,
    HALF_CONFIG,
    MoeKernelConfig,
    combine_slots,
    fused_moe,
    moe_reference,
)
from logprobe.layers.moe import Experts, combine, route  # noqa: E402

STD = 0.02
TINY = QWEN3_MOE_TINY


def bench_ms(fn, dev, rep=200):
    """Median ms: triton's do_bench on CUDA, a few timed calls on CPU."""
    if dev.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        times.append(sync_time(fn)[1] * 1e3)
    return sorted(times)[1]


def kernel_section(args, dev, tflops):
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # the fused kernel runs on CPU only under Triton's interpreter, which must be on before
        # triton is imported: run this section in a child process
        cmd = [sys.executable, __file__, *sys.argv[1:]]
        out = subprocess.run(cmd, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True)
        log("(in a child process under TRITON_INTERPRET=1)")
        log("\n".join(line for line in out.stdout.splitlines() if not line.startswith("device:")))
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        return
    shape = TINY if args.tiny else QWEN3_30B_A3B
    T, H, I = args.kernel_tokens, shape["hidden_size"], shape["moe_intermediate_size"]  # noqa: E741
    E, k = shape["num_experts"], shape["num_experts_per_tok"]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, generator=g, device=dev).to(dtype)  # post-RMSNorm scale
    router = (torch.randn(E, H, generator=g, device=dev) * STD).to(dtype)
    _, _, ids = route(F.linear(x, router), k, True)  # [T, k]
    gate, up = ((torch.randn(E, I, H, generator=g, device=dev) * STD).to(dtype) for _ in range(2))
    down = (torch.randn(E, H, I, generator=g, device=dev) * STD).to(dtype)
    fl = 2 * T * k * 3 * H * I
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    log(f"\n## MoE MLP alone: T={T} tokens, H={H}, I={I}, {E} experts, top-{k}, {str(dtype).removeprefix('torch.')} "
        f"(random router: rows per expert min {int(counts.min())}, mean {T * k / E:.0f}, max {int(counts.max())}; "
        f"{fl / 1e12:.3f} TFLOP)")
    ref32 = moe_reference(x.float(), ids, gate.float(), up.float(), down.float())  # [T*k, H]
    scale = float(ref32.abs().max())

    def rel(y):
        return float((y.float() - ref32).abs().max()) / scale

    with torch.device("meta"):
        experts = Experts(E, H, I)
    for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        setattr(experts, name, torch.nn.Parameter(w, requires_grad=False))
    tile = Deterministic().cuda_tile if dev.type == "cuda" else Deterministic().tile

    # the floor: the two GEMMs alone over expert-sorted rows (gathers, SiLU, scatter not included)
    order = torch.sort(ids.reshape(-1), stable=True).indices
    xs = x[order // k].contiguous()  # [T*k, H]
    act = (torch.randn(T * k, I, generator=g, device=dev)).to(dtype)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gu_t = torch.cat([gate, up], 1).transpose(-2, -1)  # [E, H, 2I] (view of [E, 2I, H])
    dn_t = down.transpose(-2, -1)  # [E, I, H]
    gmm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    floor_name, floor_fn = None, None
    if gmm is not None:
        try:
            fn = lambda: (gmm(xs, gu_t, offs=offs), gmm(act, dn_t, offs=offs))  # noqa: E731
            fn()
            floor_name = (f"grouped-GEMM floor: {'F.grouped_mm' if gmm is getattr(F, 'grouped_mm', None) else 'torch._grouped_mm'}"
                          " x2 (gate|up, down) over sorted rows")
            floor_fn = fn
        except Exception as e:  # noqa: BLE001 - e.g. no kernel for this GPU / dtype
            log(f"(grouped_mm failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}; using bmm)")
    if floor_fn is None:  # bmm over per-expert segments padded to the largest
        m = int(counts.max())
        xp = x.new_zeros(E, m, H)
        ap = x.new_zeros(E, m, I)
        floor_name = f"bmm floor over per-expert segments padded to {m} rows (pads count as work)"
        floor_fn = lambda: (torch.bmm(xp, gu_t), torch.bmm(ap, dn_t))  # noqa: E731
    w2 = torch.cat([gate[0], up[0]], 0)  # [2I, H]
    dense_fn = lambda: (F.linear(xs, w2), F.linear(act, down[0]))  # noqa: E731

    rows = [(floor_name, bench_ms(floor_fn, dev, args.rep), None, "—"),
            ("dense lower bound: [T*k, H] x [H, 2I] + [T*k, I] x [I, H], one expert's weights",
             bench_ms(dense_fn, dev, args.rep), None, "—")]
    few = 100 if T > 100 else T // 2

    def invariant(fn):
        return bool(torch.equal(fn(x[:few].clone(), ids[:few].clone()).reshape(few * k, H),
                                fn(x, ids).reshape(T * k, H)[:few * k]))

    cases = [("logprobe fused Triton kernel (kernels.moe.fused_moe, default tiles of the dtype)",
              lambda a, b: fused_moe(a, b, gate, up, down)),
             ("PyTorch reference moe_reference (loop over experts)", lambda a, b: moe_reference(a, b, gate, up, down)),
             ("PyTorch segment path Experts.reference (Numerics.triton = False)",
              lambda a, b: experts.reference(a, b, None)),
             (f"PyTorch segment path, deterministic fixed {tile}-row tiles", lambda a, b: experts.reference(a, b, tile))]
    for name, fn in cases:
        try:
            y = fn(x, ids)
            ms = bench_ms(lambda fn=fn: fn(x, ids), dev, args.rep)
            rows.append((name, ms, rel(y.reshape(T * k, H)), invariant(fn)))
            del y
        except Exception as e:  # noqa: BLE001
            rows.append((f"{name}: failed {type(e).__name__}: {' '.join(str(e).split())[:160]}", None, None, "—"))
    y_f, y_r = fused_moe(x, ids, gate, up, down), moe_reference(x, ids, gate, up, down)
    d_fr = float((y_f.float() - y_r.float()).abs().max()) / scale
    floor = rows[0][1]
    log(f"matmul ceiling {tflops:.0f} TFLOP/s" if tflops else "(no matmul ceiling on CPU)")
    log("| path | ms | TFLOP/s | time / floor | max rel Δ vs float32 reference | 100 tokens alone = in batch (bitwise) |")
    log("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, ms, d, inv in rows:
        if ms is None:
            log(f"| {name} | | | | | |")
            continue
        ds = f"{d:.2e}" if d is not None else "—"
        log(f"| {name} | {ms:.3f} | {fl / ms / 1e9:.1f} | {ms / floor:.2f} | {ds} | {inv} |")
    log(f"fused kernel vs {str(dtype).removeprefix('torch.')} moe_reference: max rel Δ {d_fr:.2e} (relative to "
        f"max |y| = {scale:.3g}); deterministic variant: none separate, deterministic mode runs the same kernel "
        f"(fixed tiles, no split-K)")
    if dev.type == "cuda":  # the weighted sum of the k expert rows: PyTorch ops vs the one-pass kernel
        y3 = fused_moe(x, ids, gate, up, down)  # [T*k, H]
        wts = torch.softmax(torch.randn(T, k, device=dev), -1)
        ms_pt = bench_ms(lambda: combine(y3.view(T, k, H), wts).to(dtype), dev, args.rep)
        ms_tr = bench_ms(lambda: combine_slots(y3, wts, dtype), dev, args.rep)
        same = torch.equal(combine_slots(y3, wts, dtype), combine(y3.view(T, k, H), wts).to(dtype))
        log(f"combine of the k = {k} expert rows, T = {T}: PyTorch ops {ms_pt:.3f} ms, combine_slots {ms_tr:.3f} ms "
            f"({ms_pt / ms_tr:.1f}x), bitwise equal: {same}")
        del y3
    if args.tune:
        configs = [DEFAULT_CONFIG, HALF_CONFIG, MoeKernelConfig(64, 128, 64, 4, 3),
                   MoeKernelConfig(128, 128, 64, 8, 3), MoeKernelConfig(128, 64, 64, 4, 3),
                   MoeKernelConfig(64, 64, 128, 4, 3), MoeKernelConfig(32, 128, 64, 4, 4),
                   MoeKernelConfig(128, 128, 32, 8, 4), MoeKernelConfig(16, 64, 128, 4, 4)]
        if dev.type == "cpu":
            configs = [MoeKernelConfig(16, 16, 16), MoeKernelConfig(32, 16, 32)]
        log("\n| BM | BN | BK | warps | stages | ms | TFLOP/s | time / floor | max rel Δ vs float32 reference |")
        log("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for c in configs:
            try:
                ms = bench_ms(lambda c=c: fused_moe(x, ids, gate, up, down, c), dev, args.rep)
                d = rel(fused_moe(x, ids, gate, up, down, c))
                log(f"| {c.block_m} | {c.block_n} | {c.block_k} | {c.num_warps} | {c.num_stages} | {ms:.3f} | "
                    f"{fl / ms / 1e9:.1f} | {ms / floor:.2f} | {d:.2e} |")
            except Exception as e:  # noqa: BLE001 - a tile the compiler or shared memory refuses
                log(f"| {c.block_m} | {c.block_n} | {c.block_k} | {c.num_warps} | {c.num_stages} | failed: "
                    f"{type(e).__name__}: {' '.join(str(e).split())[:120]} | | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu with --tiny for a smoke test")
    ap.add_argument("--tiny", action="store_true", help="the tiny Qwen3-MoE shape")
    ap.add_argument("--kernel-tokens", type=int, default=None, help="T (default 8192; --tiny 64)")
    ap.add_argument("--tune", action="store_true", help="sweep MoeKernelConfig tiles")
    ap.add_argument("--tiles", default=None, help="BM,BN,BK,warps,stages: the fused kernel's default tiles "
                    "for this run (labelled)")
    ap.add_argument("--rep", type=int, default=200, help="do_bench milliseconds per row")
    ap.add_argument("--tflops", type=float, default=None, help="the matmul ceiling, if measured already")
    args = ap.parse_args()
    if args.kernel_tokens is None:
        args.kernel_tokens = 64 if args.tiny else 8192
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --device cpu --tiny)")
    if args.tiles:
        import logprobe.kernels.moe as kmoe

        kmoe.DEFAULT_CONFIG = kmoe.HALF_CONFIG = kmoe.MoeKernelConfig(*(int(v) for v in args.tiles.split(",")))
        log(f"**fused MoE tiles for this run, every dtype: {kmoe.DEFAULT_CONFIG}** (not the library default)")
    tflops = args.tflops
    if dev.type == "cuda" and tflops is None:
        tflops = matmul_ceiling()
        log(f"{torch.cuda.get_device_name()}: bf16 8192^3 matmul {tflops:.0f} TFLOP/s")
    kernel_section(args, dev, tflops)


if __name__ == "__main__":
    main()
