"""Deterministic mode's cost, and tensor and data parallelism, on GPUs: default against deterministic
mode (TP-invariant products, ``det``; cuBLAS row tiles, ``det-notp``) on one GPU; TP = 1 vs TP = 2 vs
2 data-parallel replicas; the TP = 1 path against an older checkout (``--old-src``).

A random-init bf16 Llama (default llama-8b) is written once as a Hugging Face directory (the
workers read their shards from it, as users' models are read), then scored through the public
API (``Scorer``, default ``max_batch_tokens``) on the workloads of bench/common.py:
W1 RL groups (32 prompts x 8 completions) and W3 perplexity windows (256k tokens, 2048 / 512).
Printed per configuration and mode (default, deterministic): seconds, input tokens/s, MFU on the
unique-token FLOPs against the summed matmul ceiling of the GPUs used, per-token max / mean
|Δ log-prob| against TP = 1 of the same mode, and a bitwise flag.

    python bench/gpu_tp.py --workloads W1,W3 --modes default,det,det-notp --configs TP=1   # one GPU
    python bench/gpu_tp.py --workloads W1,W3                    # needs 2 GPUs for TP / DP rows
    python bench/gpu_tp.py --old-src old_src --skip-parallel    # TP = 1 today vs an older src/ tree
    python bench/gpu_tp.py --model llama-70b --fp8 --configs TP=2 --workloads W1 --modes default --requests 64
        # a 70B shape as FP8 blocks (71 GB: more than one H100 holds) at TP = 2, the first 64 of W1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    FP8_CONFIG,
    bench_ms,
    byte_tokenizer,
    fp8_blocks,
    llama_config,
    matmul_ceiling,
    unique_flops,
    workload,
    write_shards,
)

from logprobe.config import Deterministic  # noqa: E402
from logprobe.loading.hf import native_config  # noqa: E402
from logprobe.models.llama import LlamaModel  # noqa: E402


def write_checkpoint(name: str, path: Path, fp8: bool = False) -> None:
    """``MODELS[name]`` as a Hugging Face directory: random bf16 weights (seeded per tensor, made
    on CUDA), config.json and a byte-level tokenizer; ``fp8``: every projection as DeepSeek-style
    FP8 blocks (``fp8_blocks``: codes + ``weight_scale_inv``, ``FP8_CONFIG``), embeddings, head and
    norms in bf16. Nothing is done if ``path`` has a config."""

    from logprobe.loading.hf import native_config

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(name)
    lc, _ = native_config(cfg.to_dict())
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaModel(lc).state_dict().items()}
    files, part, size = [], {}, 0
    for i, (k, shape) in enumerate(sorted(shapes.items())):
        g = torch.Generator("cuda").manual_seed(i)
        t = torch.ones(shape, device="cuda") if len(shape) == 1 else torch.randn(shape, generator=g, device="cuda") * 0.02
        key = "lm_head.weight" if k == "lm_head.weight" else "model." + k
        if fp8 and len(shape) == 2 and "_proj" in k:
            codes, scale = fp8_blocks(t)
            part[key], part[key.removesuffix(".weight") + ".weight_scale_inv"] = codes.cpu(), scale.cpu()
        else:
            part[key] = t.to(torch.bfloat16).cpu()
        size += part[key].numel() * part[key].element_size()
        if size > 4 << 30:
            files.append(part)
            part, size = {}, 0
    files.append(part)
    write_shards(files, path)
    if fp8:
        cfg.quantization_config = FP8_CONFIG
    cfg.save_pretrained(str(path))
    byte_tokenizer().save_pretrained(str(path))


T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


def timed(engine, reqs):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = engine.run(reqs)
    torch.cuda.synchronize()
    return time.perf_counter() - t, torch.cat([r.logprobs for r in out])


MODES = {"default": {}, "det": dict(deterministic=True),  # det: TP-invariant (Triton fixed tiles), the default
         "det-notp": dict(deterministic=Deterministic(tp_invariant=False)),  # batch-invariant at this TP size only
         "det-notp-triton": dict(deterministic=Deterministic(tp_invariant=False, matmul="triton"))}


def run_config(label, scorer, loads, reqs_by_w, modes, ref, rows, gpus, ceiling, lc):
    from logprobe.config import EngineConfig

    for mode in modes:
        scorer.config = EngineConfig(progress=False, **MODES[mode])  # None budget: the one chosen at start
        for w, reqs in reqs_by_w.items():
            t = time.perf_counter()
            scorer.engine.run(reqs if w == "W1" else reqs[:16])  # warm-up: every kernel specialisation compiled
            log(f"{label} {w} {mode}: warm-up {time.perf_counter() - t:.1f} s")
            secs, lp = timed(scorer.engine, reqs)
            toks = sum(r.num_inputs for r in reqs)
            mfu = unique_flops(lc, reqs) / secs / (ceiling * 1e12 * gpus)
            key = (w, mode)
            row = dict(config=label, workload=w, mode=mode, s=round(secs, 3),
                       tok_s=round(toks / secs), mfu=round(mfu, 3), load_s=round(loads, 1))
            if key in ref:
                d = (lp - ref[key]).abs()
                row.update(max_d=float(d.max()), mean_d=float(d.mean()), bitwise=bool(torch.equal(lp, ref[key])))
            else:
                ref[key] = lp
            rows.append(row)
            log(json.dumps(row))


def old_vs_new(args, path: Path) -> None:
    """TP = 1 in a fresh process per source tree: today's src/ and ``--old-src``."""
    for src in ("src", args.old_src):
        cmd = [sys.executable, __file__, "--time-only", "--model-dir", str(path), "--workloads", args.workloads,
               *(["--profile"] if args.profile else [])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(Path(__file__).parent)]))
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        log(f"[{src}] " + (out.stdout.strip().splitlines() or ["(no output)"])[-1])
        if out.returncode:
            log(out.stderr[-3000:])


def time_only(args) -> None:
    from logprobe import Scorer
    from logprobe.config import EngineConfig

    s = Scorer(args.model_dir, device="cuda", config=EngineConfig(progress=False))
    res = {}
    if args.profile:  # where W1's time goes: forward vs head (synchronised), by monkeypatching
        from logprobe.engine.runner import Engine

        spent = {"forward": 0.0, "score": 0.0}
        model, real_fwd, real_score = s.engine.model, s.engine.model.forward, Engine.score

        def clock(key, fn):
            def wrapped(*a, **kw):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = fn(*a, **kw)
                torch.cuda.synchronize()
                spent[key] += time.perf_counter() - t0
                return out
            return wrapped

        model.forward = clock("forward", real_fwd)
        Engine.score = clock("score", real_score)
        import logprobe.kernels.logprob_head as kh
        import logprobe.layers.logprob_head as hd

        for mod, name in ((hd, "_target_logits"), (hd, "_kernel_partials"), (hd, "_torch_partials"),
                          (kh, "combine_head_partials"), (kh, "fused_target_logits"), (kh, "fused_head_partials")):
            if hasattr(mod, name):
                spent[name] = 0.0
                setattr(mod, name, clock(name, getattr(mod, name)))
        reqs = workload("W1", s.info.vocab_size)
        s.engine.run(reqs[:8])
        spent.update({k: 0.0 for k in spent})
        total = timed(s.engine, reqs)[0]
        print(json.dumps({"W1 total": round(total, 3), **{k: round(v, 3) for k, v in spent.items()}}))
        return
    modes = {"default": {}, "det": dict(deterministic=True)}
    modes["det, tp_invariant=False"] = dict(deterministic=Deterministic(tp_invariant=False))
    for mode, kw in modes.items():
        s.config = EngineConfig(progress=False, **kw)
        s.engine.config = s.config
        for w in args.workloads.split(","):
            reqs = workload(w, s.info.vocab_size)
            # warm-up: W1's batches take many shapes (each a kernel specialisation to compile
            # once); W3's windows are all alike
            s.engine.run(reqs if w == "W1" else reqs[:16])
            res[f"{w} {mode}"] = round(timed(s.engine, reqs)[0], 3)
    print(json.dumps(res))


def layers_section(T: int = 8192) -> None:
    """Deterministic products at llama-8b shapes (T rows): F.linear, the fixed-row-tile cuBLAS
    product (``tp_invariant=False``) and the Triton fixed-tile product every layer runs in the
    TP-invariant form (row-parallel layers too, over their gathered input), with its column check."""
    from logprobe.kernels.matmul import invariant_linear
    from logprobe.layers.linear import tiled_linear

    for name, (n_out, k_in) in {"qkv": (6144, 4096), "gate_up": (28672, 4096), "o": (4096, 4096),
                                "down": (4096, 14336)}.items():
        w = torch.randn(n_out, k_in, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(T, k_in, device="cuda", dtype=torch.bfloat16)
        plain = bench_ms(lambda: torch.nn.functional.linear(x, w), 20)  # noqa: B023
        tiled = bench_ms(lambda: tiled_linear(x, w, None, 2048), 20)  # noqa: B023
        tri = bench_ms(lambda: invariant_linear(x, w), 20)  # noqa: B023
        half = n_out // 2
        cols = torch.equal(invariant_linear(x, w)[:, half:], invariant_linear(x, w[half:].contiguous()))
        log(f"{name:8s} [{T}x{k_in}]x[{k_in}x{n_out}]: F.linear {plain:.2f} ms, fixed row tiles {tiled:.2f} ms, "
            f"Triton fixed tiles {tri:.2f} ms ({tri / plain:.2f}x F.linear; columns invariant: {cols})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--workloads", default="W1,W3")
    ap.add_argument("--modes", default="default,det", help=f"of {','.join(MODES)}; each against TP=1 in the same mode")
    ap.add_argument("--old-src", default=None, help="an older src/ tree: TP = 1 timed there and here")
    ap.add_argument("--skip-parallel", action="store_true")
    ap.add_argument("--layers", action="store_true", help="the deterministic products alone at llama-8b shapes")
    ap.add_argument("--time-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="with --old-src: W1's forward vs head time per tree")
    ap.add_argument("--fp8", action="store_true", help="the checkpoint's projections as FP8 blocks (128 x 128)")
    ap.add_argument("--configs", default="TP=1,TP=2,DP=2", help="which of TP=1, TP=2, DP=2 to run")
    ap.add_argument("--requests", type=int, default=0, help="the first N requests of each workload (0: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.time_only:
        return time_only(args)
    from logprobe import Scorer
    from logprobe.config import EngineConfig

    path = Path(args.model_dir or f"/tmp/logprobe-bench/{args.model}{'-fp8' if args.fp8 else ''}")
    t = time.perf_counter()
    write_checkpoint(args.model, path, fp8=args.fp8)
    log(f"checkpoint {path}: {time.perf_counter() - t:.1f} s; GPUs: {torch.cuda.device_count()} x "
        f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    ceiling = matmul_ceiling()
    log(f"bf16 8192^3 matmul ceiling: {ceiling:.0f} TFLOP/s per GPU")
    if args.layers:
        layers_section()
    if args.old_src:
        old_vs_new(args, path)
    if args.skip_parallel:
        return
    rows, ref = [], {}
    configs = args.configs.split(",")
    lc, _ = native_config(json.loads((path / "config.json").read_text()))
    n = args.requests or None
    reqs = {w: workload(w, lc.vocab_size)[:n] for w in args.workloads.split(",")}
    modes = args.modes.split(",")
    if "TP=1" in configs:
        t = time.perf_counter()
        one = Scorer(str(path), device="cuda", config=EngineConfig(progress=False))
        log(f"TP=1: loaded in {time.perf_counter() - t:.1f} s, budget {one.config.max_batch_tokens}")
        run_config("TP=1", one, time.perf_counter() - t, reqs, modes, ref, rows, 1, ceiling, lc)
        del one  # GPU 0 free again for the workers of the next configurations
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    for label, kw, gpus in (("TP=2", dict(tensor_parallel_size=2), 2), ("DP=2", dict(data_parallel_size=2), 2)):
        if label not in configs:
            continue
        if torch.cuda.device_count() < 2:
            log(f"{label}: skipped, one GPU")
            continue
        t = time.perf_counter()
        with Scorer(str(path), device="cuda", config=EngineConfig(progress=False), **kw) as s:
            log(f"{label}: workers ready in {time.perf_counter() - t:.1f} s, budget {s.config.max_batch_tokens}")
            run_config(label, s, time.perf_counter() - t, reqs, modes, ref, rows, gpus, ceiling, lc)
    log("\n| config | workload | mode | s | tok/s | MFU | max |Δ| vs TP=1 | mean |Δ| | bitwise |")
    log("|---|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        log(f"| {r['config']} | {r['workload']} | {r['mode']} | {r['s']} | {r['tok_s']:,} | {r['mfu']} | "
            f"{r.get('max_d', '-')} | {r.get('mean_d', '-')} | {r.get('bitwise', '-')} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
