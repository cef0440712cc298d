"""Mixture-of-experts on the GPU (issue 17): random-init Qwen3-30B-A3B shape, logprobe vs transformers.

One process, markdown tables. Sections (``--sections``, comma-separated; a section that fails
prints its error and the rest go on):

  kernel     the MoE MLP alone at the 30B-A3B layer shape against a grouped-GEMM floor and the
             PyTorch paths (``--tune``: a tile sweep): bench/gpu_moe_kernel.py, run as a child process.
  workloads  logprobe (``Engine`` at default settings: ``EngineConfig(progress=False)``,
             max_batch_tokens 8192) on W1 (RL groups: 32 prompts x 8 completions) and W3 (perplexity:
             256k tokens, context 2048, stride 512) of bench/common.py: seconds, input tokens/s,
             peak extra memory, MFU on *active* parameters (FLOPs of attention, the router, the k = 8
             routed experts of each token and the head; all needed tokens, and unique tokens after
             shared prefixes run once) against the bf16 matmul ceiling measured in this run; then
             transformers on the same weights (right-padded batches sorted by length, ``use_cache=
             False``, logits -> float32 log_softmax -> gather; transformers' default experts
             implementation unless ``--hf-experts``). ``--baseline-limit N``: transformers (and
             logprobe again, for a measured ratio) on the first N requests only; the whole-workload
             time of transformers is then extrapolated by needed tokens and labelled so.
  det        W1 with ``EngineConfig(deterministic=True)``: time, cost against the default run,
             max |Δ| between the two, and the first 3 requests alone vs inside W1 (bitwise).
  profile    the CUDA kernels of logprobe's W1 (first ``--profile-requests`` requests) by total
             time, under torch.profiler: where the time goes.
  correct    per-token max / mean |Δ log-prob| of logprobe vs transformers (same dtype, bf16 on the
             GPU) on the first ``--check-requests`` W1 requests.

Weights: one seeded random tensor per parameter (``torch.Generator`` seeded by the crc32 of its
name, std 0.02, norms 1), made on the GPU twice: first for logprobe's native model, which is timed
and freed, then for transformers' model (the same values into its fused ``experts.gate_up_proj``).
Never two 61 GB copies at once, and no checkpoint on disk (57 GiB would not fit the 64 GiB disk
of the device machines); with ``--tiny`` the same builder is checked bitwise against the public
``Scorer(dir)`` loading of a ``save_pretrained`` directory. Memory: H200 (139 GB) holds the 48
layers (57 GiB of weights) with room; the H100 (80 GB) should too (about 20 GiB left for
activations at 8192-token passes); if it runs out, ``--layers 40`` (labelled in the output).

Each command on the device machine has 10 minutes, so the workloads are split across commands
(each builds its models again, about a minute per build; estimates, not measured):

    # H200 (or H100: the same commands; add --layers 40 if the 48 layers run out of memory)
    python bench/gpu_moe.py --sections kernel --tune
    python bench/gpu_moe.py --sections workloads,det,correct --workloads W1
    python bench/gpu_moe.py --sections workloads --workloads W3 --baseline-limit 128
    # H100 explicitly, fewer layers if needed (everything is labelled with the layer count)
    python bench/gpu_moe.py --sections workloads,det,correct --workloads W1 --layers 40

CPU smoke test of the whole script (tiny MoE config, float32, truncated workloads; the kernel
section runs under Triton's interpreter in a child process):

    python bench/gpu_moe.py --device cpu --tiny --baseline-limit 4 --tune     # about 70 s on 2 threads
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    QWEN3_30B_A3B,
    QWEN3_MOE_TINY,
    byte_tokenizer,
    free,
    kernel_profile,
    log,
    matmul_ceiling,
    run_transformers,
    sync_time,
    unique_flops,
    workload,
)

from logprobe.config import EngineConfig  # noqa: E402
from logprobe.engine.runner import Engine  # noqa: E402
from logprobe.loading.loader import build_native  # noqa: E402

GiB = 1024**3
TINY = QWEN3_MOE_TINY
STD = 0.02


def section(name, fn, *a):
    """Run one section; on failure print the error and go on."""
    t = time.perf_counter()
    try:
        fn(*a)
    except Exception as e:  # noqa: BLE001 - report, don't stop the benchmark
        log(f"\n**section {name} failed** after {time.perf_counter() - t:.1f} s: {type(e).__name__}: "
            f"{' '.join(str(e).split())[:600]}")
        log("```\n" + "".join(traceback.format_exc().splitlines(keepends=True)[-12:]) + "```")
    finally:
        free()


def peak_reset(dev):
    if dev.type == "cuda":
        free()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def peak_extra(dev, base) -> float | None:
    return (torch.cuda.max_memory_allocated() - base) / GiB if dev.type == "cuda" else None


# ------------------------------------------------------------------------------------- models


def hf_config(args):
    import transformers as tf

    kw = dict(TINY if args.tiny else QWEN3_30B_A3B)
    if args.layers:
        kw["num_hidden_layers"] = args.layers
    return tf.Qwen3MoeConfig(**kw)


def native_cfg(cfg):
    from logprobe.loading.hf import native_config

    lc, why = native_config(cfg.to_dict())
    if lc is None:
        raise RuntimeError(f"logprobe does not run this config natively: {why}")
    return lc


def native_shapes(lc) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of logprobe's native model = the checkpoint's tensors after the
    loader's renaming and expert stacking (``loading.hf``): the canonical list of weights here."""
    from logprobe.models.moe import native_model_class

    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in native_model_class(lc)(lc).state_dict().items()}


def seeded(name: str, shape, dev, dtype) -> torch.Tensor:
    """The weight called ``name``: the same values every time it is made on this device."""
    if len(shape) == 1:
        return torch.ones(shape, device=dev, dtype=dtype)  # RMSNorm weights
    g = torch.Generator(device=dev).manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g, device=dev) * STD).to(dtype)


def build_logprobe(lc, dev, dtype):
    """logprobe's native model from the seeded tensors, through the loader's own builder (the one
    ``Scorer(dir)`` / ``load_model`` use; tensors stream in, one copy on the device)."""
    shapes = native_shapes(lc)
    return build_native(lc, ((n, seeded(n, s, dev, dtype)) for n, s in shapes.items()), dev, dtype)


def build_transformers(cfg, lc, dev, dtype, experts: str | None):
    """transformers' Qwen3-MoE with the same seeded tensors (gate|up concatenated into its
    ``experts.gate_up_proj`` [E, 2I, H]), copied in one at a time."""
    from transformers import AutoModelForCausalLM

    shapes = native_shapes(lc)
    kw = {"experts_implementation": experts} if experts else {}
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype, **kw)
    finally:
        torch.set_default_dtype(old)
    used = set()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            n = name.removeprefix("model.")
            if n.endswith(".experts.gate_up_proj"):
                base = n.removesuffix("gate_up_proj")
                parts = [base + "gate_proj", base + "up_proj"]
                inter = shapes[parts[0]][1]
                for j, part in enumerate(parts):
                    p[:, j * inter:(j + 1) * inter].copy_(seeded(part, shapes[part], dev, dtype))
                used.update(parts)
            else:
                if n not in shapes or tuple(p.shape) != shapes[n]:
                    raise RuntimeError(f"transformers parameter {name} {tuple(p.shape)} has no native counterpart")
                p.copy_(seeded(n, shapes[n], dev, dtype))
                used.add(n)
    if used != set(shapes):
        raise RuntimeError(f"native weights not in transformers' model: {sorted(set(shapes) - used)[:5]}")
    return hf.eval()


def describe(lc) -> str:
    s = lc.moe
    active = active_params(lc)
    total = (lc.num_layers * (attn_params(lc) + s.num_experts * 3 * lc.hidden_size * s.intermediate_size
                              + lc.hidden_size * s.num_experts) + 2 * lc.vocab_size * lc.hidden_size)
    return (f"Qwen3-MoE shape: {lc.num_layers} layers, H {lc.hidden_size}, {s.num_experts} experts top-{s.top_k}, "
            f"I {s.intermediate_size}, {lc.num_heads} q / {lc.num_kv_heads} kv heads x {lc.head_dim}, "
            f"V {lc.vocab_size}; {total / 1e9:.3g} B parameters, {active / 1e9:.3g} B active per token "
            "(attention + router + k experts + head)")


# -------------------------------------------------------------------------------------- FLOPs


def attn_params(lc) -> int:
    H, qd, kvd = lc.hidden_size, lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
    return H * qd + 2 * H * kvd + qd * H


def layer_active_params(lc) -> int:
    """Per-token matmul parameters of the blocks: attention projections, router, k routed experts
    (+ shared expert, + dense MLP blocks)."""
    s, H, L = lc.moe, lc.hidden_size, lc.num_layers
    moe = H * s.num_experts + s.top_k * 3 * H * s.intermediate_size + 3 * H * s.shared_intermediate_size
    nd = len(s.dense_layers)
    return L * attn_params(lc) + (L - nd) * moe + nd * 3 * H * lc.intermediate_size


def active_params(lc) -> int:
    return layer_active_params(lc) + lc.vocab_size * lc.hidden_size


def active_flops(lc, reqs, min_shared: int | None = 16) -> float:
    """Forward FLOPs on active parameters (common.unique_flops with 2 x layer_active_params per
    computed token): ``min_shared`` None counts every needed token."""
    return unique_flops(lc, reqs, min_shared, per_token=2 * layer_active_params(lc))


# ------------------------------------------------------------------------------------ kernel


def kernel_section(args, dev, tflops):
    """bench/gpu_moe_kernel.py in a child process (its output goes straight to this one's)."""
    cmd = [sys.executable, str(Path(__file__).with_name("gpu_moe_kernel.py")), "--device", args.device, "--rep",
           str(args.rep), *(["--kernel-tokens", str(args.kernel_tokens)] if args.kernel_tokens else []),
           *(["--tiny"] if args.tiny else []), *(["--tune"] if args.tune else []),
           *(["--tiles", args.tiles] if args.tiles else []), *(["--tflops", str(tflops)] if tflops else [])]
    sys.stdout.flush()
    env = dict(os.environ, TRITON_INTERPRET="1") if dev.type == "cpu" else None  # the kernel on CPU: interpreted
    if subprocess.run(cmd, env=env).returncode:
        raise RuntimeError("bench/gpu_moe_kernel.py failed (its output is above)")


# ---------------------------------------------------------------------------------- workloads


def get_workloads(args, vocab) -> dict[str, list]:
    out = {}
    for w in args.workloads.split(","):
        if w not in ("W1", "W2", "W3", "W4"):
            log(f"(workload {w!r} skipped: bench/common.py defines W1-W4)")
            continue
        reqs = workload(w, vocab)
        out[w] = reqs[:args.tiny_requests] if args.tiny else reqs
    return out


def warm_count(args, w) -> int:
    return 2 if args.tiny else (32 if w == "W1" else 16)


def logprobe_phase(args, cfg, lc, dev, dtype, wls, tflops, state):
    """Build logprobe's model, time what the sections ask, keep the numbers (on the CPU), free it."""
    t = time.perf_counter()
    model = build_logprobe(lc, dev, dtype)
    weights = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    log(f"\nlogprobe model built in {time.perf_counter() - t:.1f} s"
        + (f", {weights / GiB:.1f} GiB allocated" if dev.type == "cuda" else ""))
    base = dict(progress=False) if args.batch_tokens is None else dict(progress=False, max_batch_tokens=args.batch_tokens)
    engine = Engine(model, EngineConfig(**base), dev)
    det_engine = Engine(model, EngineConfig(**base, deterministic=True), dev)
    sections = args.sections
    try:
        with torch.inference_mode():
            if "workloads" in sections:
                for w, reqs in wls.items():
                    try:
                        engine.run(reqs[:warm_count(args, w)])  # warm-up: Triton kernels compiled
                        b0 = peak_reset(dev)
                        secs = []
                        for _ in range(args.passes):  # the first pass also meets new shapes (compiles)
                            res, sec = sync_time(lambda reqs=reqs: engine.run(reqs))
                            secs.append(sec)
                        sec = min(secs)
                        row = dict(sec=sec, peak=peak_extra(dev, b0), lp=[r.logprobs.float().cpu() for r in res])
                        log(f"logprobe {w} passes: " + ", ".join(f"{t:.2f}" for t in secs) + " s")
                        del res
                        n = args.baseline_limit
                        if n and n < len(reqs):  # the same prefix as transformers, measured
                            row["prefix_sec"] = sync_time(lambda reqs=reqs, n=n: engine.run(reqs[:n]))[1]
                        state["ours"][w] = row
                        log(f"logprobe {w}: {sec:.2f} s, {sum(r.num_inputs for r in reqs) / sec:,.0f} tok/s")
                    except Exception as e:  # noqa: BLE001
                        state["ours"][w] = dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
                        log(f"logprobe {w} failed: {state['ours'][w]['error']}")
                        free()
            if "det" in sections:
                try:
                    reqs = workload("W1", lc.vocab_size)
                    reqs = reqs[:args.tiny_requests] if args.tiny else reqs
                    det_engine.run(reqs[:warm_count(args, "W1")])
                    engine.run(reqs[:warm_count(args, "W1")])
                    t_on = []
                    for _ in range(args.passes):
                        on, t = sync_time(lambda: det_engine.run(reqs))
                        t_on.append(t)
                    log("deterministic W1 passes: " + ", ".join(f"{t:.2f}" for t in t_on) + " s")
                    t_on = min(t_on)
                    if "W1" in state["ours"] and "sec" in state["ours"]["W1"]:
                        t_off, off = state["ours"]["W1"]["sec"], state["ours"]["W1"]["lp"]
                    else:
                        res, t_off = sync_time(lambda: engine.run(reqs))
                        off = [r.logprobs.float().cpu() for r in res]
                    on_lp = [r.logprobs.float().cpu() for r in on]
                    d = max(float((a - b).abs().max()) for a, b in zip(off, on_lp))
                    alone = [det_engine.run([r])[0].logprobs for r in reqs[:3]]
                    same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(alone, (r.logprobs for r in on[:3])))
                    state["det"] = dict(off=t_off, on=t_on, d=d, bitwise=same, n=len(reqs),
                                        tokens=sum(r.num_inputs for r in reqs))
                    log(f"deterministic W1: {t_on:.2f} s vs default {t_off:.2f} s")
                except Exception as e:  # noqa: BLE001
                    state["det"] = dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
                    log(f"det failed: {state['det']['error']}")
                    free()
            if "profile" in sections:
                profile_w1(args, engine, lc)
            if "correct" in sections:
                reqs = workload("W1", lc.vocab_size)[:args.check_requests]
                state["check_ours"] = [r.logprobs.float().cpu() for r in engine.run(reqs)]
            if args.tiny and "correct" in sections:
                state["public"] = public_path_check(cfg, model, reqs, dev, dtype)
    finally:
        engine = det_engine = model = None  # noqa: F841 - the weights go before transformers' are made
        free()


def profile_w1(args, engine, lc) -> None:
    """Where the time of logprobe's W1 goes (first ``--profile-requests`` requests)."""
    reqs = workload("W1", lc.vocab_size)[:args.profile_requests]
    kernel_profile(lambda: engine.run(reqs), f"Qwen3-30B-A3B shape W1, first {len(reqs)} requests")


def public_path_check(cfg, model, reqs, dev, dtype) -> str:
    """Tiny only: the in-memory builder against ``Scorer(dir)`` on a save_pretrained directory of
    the same weights (transformers model -> safetensors -> logprobe's loader)."""
    import tempfile

    from logprobe import Scorer

    lc = native_cfg(cfg)
    hf = build_transformers(cfg, lc, dev, dtype, None)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        byte_tokenizer().save_pretrained(d)
        s = Scorer(d, device=str(dev), dtype=str(dtype).removeprefix("torch."), progress=False)
        a = s.engine.run(reqs)
    b = Engine(model, EngineConfig(progress=False), dev).run(reqs)
    same = all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    return f"in-memory builder vs Scorer(save_pretrained dir) on {len(reqs)} W1 requests: bitwise {same}"


def transformers_phase(args, cfg, lc, dev, dtype, wls, state):
    if dev.type == "cuda":
        log(f"\nbefore transformers' model: {torch.cuda.memory_allocated() / GiB:.2f} GiB still allocated")
    t = time.perf_counter()
    impls = args.hf_experts.split(",") if args.hf_experts else [None]
    hf = build_transformers(cfg, lc, dev, dtype, impls[0])
    weights = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    log(f"\ntransformers model built in {time.perf_counter() - t:.1f} s (experts {hf.config._experts_implementation}, "
        f"attention {hf.config._attn_implementation})" + (f", {weights / GiB:.1f} GiB allocated" if weights else ""))
    try:
        with torch.inference_mode():
            if "correct" in args.sections:
                reqs = workload("W1", lc.vocab_size)[:args.check_requests]
                state["check_hf"] = run_transformers(hf, reqs, args.budgets[0], dev, use_cache=False)
            if "workloads" not in args.sections:
                return
            for impl in impls:
                if impl is not None and impl != hf.config._experts_implementation:
                    hf.set_experts_implementation(impl)
                label = hf.config._experts_implementation
                for w, reqs in wls.items():
                    n = args.baseline_limit
                    part = reqs[:n] if n and n < len(reqs) else reqs
                    run_transformers(hf, part[:warm_count(args, w) // 2 or 1], args.budgets[0], dev, use_cache=False)  # warm-up
                    best = None
                    for budget in args.budgets:
                        b0 = peak_reset(dev)
                        try:
                            secs = []
                            for _ in range(args.passes):
                                res, sec = sync_time(lambda b=budget, part=part: run_transformers(hf, part, b, dev,
                                                                                                  use_cache=False))
                                secs.append(sec)
                            log(f"transformers ({label}) {w} budget {budget} passes: " +
                                ", ".join(f"{t:.2f}" for t in secs) + " s")
                            sec = min(secs)
                        except torch.OutOfMemoryError:
                            log(f"transformers ({label}) {w} budget {budget}: OOM")
                            free()
                            continue
                        ours = state["ours"].get(w, {}).get("lp")
                        d = (max(float((a - b).abs().max()) for a, b in zip(res, ours)) if ours else None)
                        row = dict(sec=sec, budget=budget, peak=peak_extra(dev, b0), d=d, n=len(part), impl=label)
                        log(f"transformers ({label}) {w} budget {budget}: {sec:.2f} s on {len(part)} of {len(reqs)} "
                            "requests" + (f", max |Δ| vs logprobe {d:.2e}" if d is not None else ""))
                        if best is None or sec < best["sec"]:
                            best = row
                        del res
                    state["hf"].setdefault(w, []).append(best)
    finally:
        hf = None  # noqa: F841
        free()


def report_workloads(args, lc, wls, tflops, state):
    log(f"\n## workloads: {describe(lc)}; {args.dtype_name} random init (seeded, std {STD}); logprobe EngineConfig "
        f"defaults (max_batch_tokens {args.batch_tokens or EngineConfig().max_batch_tokens})"
        + (f"; matmul ceiling {tflops:.0f} TFLOP/s measured in this run" if tflops else ""))
    log("MFU on active parameters (attention + router + k routed experts + head): FLOPs of all needed tokens / "
        "time / ceiling; MFU (unique): after shared prefixes run once (what was computed)")
    if args.layers:
        log(f"**{args.layers} layers, not 48** (--layers): times and memory are of the shorter model")
    log("| workload | requests | needed tokens | scored tokens | logprobe s | tok/s | MFU | MFU (unique) | "
        "peak extra GiB | transformers s | transformers experts | speed-up | max abs Δ |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for w, reqs in wls.items():
        o = state["ours"].get(w)
        needed, scored = sum(r.num_inputs for r in reqs), sum(r.num_scored for r in reqs)
        head = f"| {w} | {len(reqs)} | {needed:,} | {scored:,} "
        if o is None or "sec" not in o:
            log(head + f"| {o['error'] if o else 'not run'} | | | | | | | | |")
            continue
        mfu = mfu_u = "—"
        if tflops:
            mfu = f"{active_flops(lc, reqs, None) / o['sec'] / (tflops * 1e12):.3f}"
            mfu_u = f"{active_flops(lc, reqs) / o['sec'] / (tflops * 1e12):.3f}"
        peak = f"{o['peak']:.1f}" if o["peak"] is not None else "—"
        ours = head + f"| {o['sec']:.2f} | {needed / o['sec']:,.0f} | {mfu} | {mfu_u} | {peak} "
        rows = [b for b in state["hf"].get(w, []) if b is not None] or [None]
        for b in rows:
            if b is None:
                log(ours + ("| OOM | | | |" if w in state["hf"] else "| not run | | | |"))
                continue
            d = f"{b['d']:.2e}" if b["d"] is not None else "—"
            if b["n"] == len(reqs):
                log(ours + f"| {b['sec']:.2f} (budget {b['budget']}) | {b['impl']} | {b['sec'] / o['sec']:.2f}x | {d} |")
                continue
            part = reqs[:b["n"]]
            frac = sum(r.num_inputs for r in part) / needed
            ext = b["sec"] / frac
            measured = f"; {b['sec'] / o['prefix_sec']:.2f}x measured on the prefix" if "prefix_sec" in o else ""
            log(ours + f"| **{ext:.1f} extrapolated** from {b['sec']:.2f} s on the first {b['n']} requests "
                f"({100 * frac:.1f}% of tokens; logprobe {o.get('prefix_sec', float('nan')):.2f} s on them) | "
                f"{b['impl']} | {ext / o['sec']:.2f}x (extrapolated{measured}) | {d} |")


def report_det(lc, state):
    d = state.get("det")
    if d is None:
        return
    log(f"\n## deterministic mode on W1 ({describe(lc)})")
    if "error" in d:
        log(f"failed: {d['error']}")
        return
    log("| workload | requests | input tokens | default s | deterministic s | cost | max abs Δ default vs det | "
        "first 3 alone = in W1 (bitwise) |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    log(f"| W1 | {d['n']} | {d['tokens']:,} | {d['off']:.2f} | {d['on']:.2f} | {100 * (d['on'] / d['off'] - 1):+.1f}% | "
        f"{d['d']:.2e} | {d['bitwise']} |")


def report_correct(args, lc, state):
    if "check_ours" not in state:
        return
    log(f"\n## logprobe vs transformers, first {args.check_requests} W1 requests (same weights, "
        f"{args.dtype_name} both)")
    if "public" in state:
        log(state["public"])
    if "check_hf" not in state:
        log("(no transformers numbers: its phase failed)")
        return
    log("| request | input tokens | scored tokens | max abs Δ | mean abs Δ |")
    log("| ---: | ---: | ---: | ---: | ---: |")
    reqs = workload("W1", lc.vocab_size)[:args.check_requests]
    allv = []
    for i, (r, a, b) in enumerate(zip(reqs, state["check_ours"], state["check_hf"])):
        dd = (a.double() - b.double()).abs()
        allv.append(dd)
        log(f"| {i} | {r.num_inputs:,} | {r.num_scored:,} | {float(dd.max()):.2e} | {float(dd.mean()):.2e} |")
    dd = torch.cat(allv)
    log(f"| all | | {dd.numel():,} | {float(dd.max()):.2e} | {float(dd.mean()):.2e} |")
    log("(random router: tokens whose k-th and (k+1)-th router probabilities are closer than the rounding "
        "differences of the two implementations can pick different experts; those give the largest Δ)")


# -------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="kernel,workloads,det,correct")
    ap.add_argument("--workloads", default="W1,W3")
    ap.add_argument("--layers", type=int, default=0, help="fewer decoder layers than 48 (labelled in the output)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu with --tiny for a smoke test")
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3-MoE config and truncated workloads")
    ap.add_argument("--tiny-requests", type=int, default=6, help="--tiny: requests per workload")
    ap.add_argument("--no-baseline", action="store_true", help="skip transformers")
    ap.add_argument("--baseline-limit", type=int, default=0,
                    help="transformers on the first N requests of each workload only, whole time extrapolated")
    ap.add_argument("--hf-experts", default=None, help="transformers experts implementation(s), comma-separated "
                    "(grouped_mm, batched_mm, eager); default: transformers' own default")
    ap.add_argument("--budgets", default="8192", help="transformers padded-token budgets to try (best is kept)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="logprobe max_batch_tokens (default: the library's)")
    ap.add_argument("--check-requests", type=int, default=8)
    ap.add_argument("--profile-requests", type=int, default=64, help="profile section: W1 requests profiled")
    ap.add_argument("--kernel-tokens", type=int, default=None, help="kernel section T (default 8192; --tiny 64)")
    ap.add_argument("--tune", action="store_true", help="kernel section: sweep MoeKernelConfig tiles")
    ap.add_argument("--tiles", default=None, help="BM,BN,BK,warps,stages: the fused kernel's default tiles "
                    "for this run (labelled; compares a config on whole workloads)")
    ap.add_argument("--rep", type=int, default=200, help="do_bench milliseconds per kernel row")
    ap.add_argument("--passes", type=int, default=2, help="timed passes over each whole workload (both engines); "
                    "the best is reported, every pass is logged (the first meets shapes not yet compiled)")
    args = ap.parse_args()
    if args.tiles:
        import logprobe.kernels.moe as kmoe

        kmoe.DEFAULT_CONFIG = kmoe.HALF_CONFIG = kmoe.MoeKernelConfig(*(int(v) for v in args.tiles.split(",")))
        log(f"**fused MoE tiles for this run, every dtype: {kmoe.DEFAULT_CONFIG}** (not the library default)")
    args.sections = args.sections.split(",")
    args.budgets = [int(b) for b in args.budgets.split(",")]
    if args.kernel_tokens is None:
        args.kernel_tokens = 64 if args.tiny else 8192
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --device cpu --tiny)")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    args.dtype_name = str(dtype).removeprefix("torch.")
    import transformers

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "none"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        where = f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / GiB:.0f} GiB"
    else:
        where = f"CPU, {torch.get_num_threads()} threads"
    log(f"device: {where}; torch {torch.__version__}, triton {tv}, transformers {transformers.__version__}; "
        f"sections {','.join(args.sections)}")
    tflops = None
    if dev.type == "cuda":
        tflops = matmul_ceiling()
        log(f"bf16 8192^3 matmul: {tflops:.0f} TFLOP/s")
    if "kernel" in args.sections:
        section("kernel", kernel_section, args, dev, tflops)
    if not any(s in args.sections for s in ("workloads", "det", "correct", "profile")):
        return
    cfg = hf_config(args)
    lc = native_cfg(cfg)
    log(f"\n{describe(lc)}" + (f" (**--layers {args.layers}**)" if args.layers else ""))
    wls = get_workloads(args, lc.vocab_size) if "workloads" in args.sections else {}
    state = {"ours": {}, "hf": {}}
    section("logprobe", logprobe_phase, args, cfg, lc, dev, dtype, wls, tflops, state)
    if not args.no_baseline and ("workloads" in args.sections or "correct" in args.sections):
        section("transformers", transformers_phase, args, cfg, lc, dev, dtype, wls, state)
    if "workloads" in args.sections:
        section("workloads report", report_workloads, args, lc, wls, tflops, state)
    if "det" in args.sections:
        section("det report", report_det, lc, state)
    if "correct" in args.sections:
        section("correct report", report_correct, args, lc, state)


if __name__ == "__main__":
    main()
