"""GPU scoring benchmark: the head kernel alone, then scoring workloads against transformers.

Runs on one CUDA GPU and prints tables (docs/perf.md keeps the results). Sections:

  head       bf16 8192^3 matmul ceiling (measured here), then the log-prob head at
             M=16,384 tokens, V=128,256, H=4,096: LM-head matmul alone (the floor), the plain
             float32 log_softmax head, logprobe's fused kernel (+entropy, +top-20), logprobe's
             PyTorch chunked head, Liger-Kernel and Cut Cross-Entropy (reduction="none"), each with
             time, ratio to the matmul, extra memory and max |Δ logprob| against the float32 head
             (float32 products of the same bf16 values).
  options    W1 plain against W1 with temperature 0.7 + top-5 + entropy on every request (no baseline).
  profile    the CUDA kernels of logprobe's W1 (first ``--profile-requests`` requests) by total time.
  exact      per-token |Δ| of logprobe (bf16 and float32) against a float64 reference of the same
             random-init SmolLM2-135M-shaped weights (the GGUF cannot travel to the GPU machine).
  workloads  random-init bf16 Llama shapes, fixed seeds:
             W1 RL groups (32 prompts x 8 completions; prompts 256-2048, completions log-uniform
             16-4096; completion tokens scored), W2 multiple choice (512 contexts of 200-1000
             tokens x 4 continuations of 1-30), W3 perplexity (256k tokens, context 2048, stride
             512), W4 long context (one 32k and one 128k sequence, all tokens scored).
             logprobe tokens/s, peak memory, MFU against the measured matmul rate (FLOPs of the
             needed tokens only: no padding), and the transformers baseline in the same run
             (right-padded batches sorted by length, `model(...).logits` -> float32 log_softmax ->
             gather) at the best of a few batch budgets; OOM is reported as OOM.

    python bench/gpu_scoring.py --sections head,exact
    python bench/gpu_scoring.py --sections quant --det-windows 16    # W4A16 llama-8b vs bf16 (issue 6)
    python bench/gpu_scoring.py --sections gguf --gguf-types Q4_K,Q8_0  # GGUF llama-8b, Triton vs PyTorch expansion
    python bench/gpu_scoring.py --sections workloads --models llama-8b --workloads W1,W3
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import time
from functools import partial

import torch

from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.engine.runner import Engine, pack
from logprobe.engine.scheduler import plan_work
from logprobe.kernels.logprob_head import DEFAULT_CONFIG, KernelConfig, fused_logprob_head
from logprobe.layers.logprob_head import HeadParams, logprob_head
from logprobe.scoring.windows import sliding_windows

GiB = 1024**3
MODELS = {
    # Llama-3.1-8B, Llama-3.2-1B and SmolLM2-135M shapes (random weights)
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                     max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                     max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
}


def log(*a):
    print(*a, flush=True)


def sync_time(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def best_of(passes: int, fn, label: str):
    """``fn()`` timed ``passes`` times (each pass logged: a first one may compile or warm caches);
    the last result and the best time."""
    secs = []
    for _ in range(max(1, passes)):
        out, sec = sync_time(fn)
        secs.append(sec)
    log(f"  {label} passes: " + ", ".join(f"{t:.2f}" for t in secs) + " s")
    return out, min(secs)


def bench_ms(fn, rep=200):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


def extra_memory(fn):
    """Peak bytes allocated by fn() above what was allocated before it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def matmul_ceiling() -> float:
    """bf16 8192^3 TFLOP/s on random data (median of do_bench)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------- head


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

    rows = []

    def add(name, fn, lp_of=None):
        torch.cuda.empty_cache()
        try:
            out, mem = extra_memory(fn)
            ms = bench_ms(fn, rep=args.rep)
        except torch.OutOfMemoryError:
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


# ------------------------------------------------------------------------------------- models


def build_models(name: str, baseline: bool):
    """Random-init bf16 transformers model and logprobe's native model sharing its weights."""
    import transformers as tf

    from logprobe.loading.hf import native_config
    from logprobe.loading.loader import _build_native

    cfg = tf.LlamaConfig(**MODELS[name], bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = tf.LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    hf.eval()
    lc, why = native_config(cfg.to_dict())
    if lc is None:
        raise SystemExit(why)
    from logprobe.models.llama import LlamaModel

    with torch.device("meta"):
        names = set(LlamaModel(lc).state_dict().keys())
    tensors = [(k.removeprefix("model."), v) for k, v in hf.state_dict().items()
               if k.removeprefix("model.") in names]
    ours = _build_native(lc, tensors, torch.device("cuda"), torch.bfloat16)
    return (hf if baseline else None), ours, lc


def flops(lc, seqs: list[tuple[int, int]]) -> float:
    """Forward FLOPs of the needed tokens: seqs = (input length, scored tokens)."""
    H, F, L = lc.hidden_size, lc.intermediate_size, lc.num_layers
    qd, kvd = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
    per_token = 2 * L * (H * qd + 2 * H * kvd + qd * H + 3 * H * F)
    total = 0.0
    for n, scored in seqs:
        total += per_token * n + 2 * L * qd * n * n + 2 * H * lc.vocab_size * scored  # causal attention: L^2 D per QK, PV
    return total


def unique_flops(lc, reqs: list[ScoreRequest], min_shared: int = 16) -> float:
    """FLOPs left when shared prefixes run once (``share_prefixes``): in sorted order, a request's
    tokens past its longest common prefix with the previous one (if >= ``min_shared``) are new.
    Attention of a new token still spans its whole context."""
    H, F, L = lc.hidden_size, lc.intermediate_size, lc.num_layers
    qd, kvd = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
    per_token = 2 * L * (H * qd + 2 * H * kvd + qd * H + 3 * H * F)
    total, prev = 0.0, []
    for r in sorted(reqs, key=lambda r: r.inputs):
        x, n = r.inputs, r.num_inputs
        a = 0
        while a < min(len(prev), n) and prev[a] == x[a]:
            a += 1
        a = a if a >= min_shared else 0
        total += per_token * (n - a) + 2 * L * qd * (n * n - a * a) + 2 * H * lc.vocab_size * r.num_scored
        prev = x
    return total


def workload(name: str, vocab: int) -> list[ScoreRequest]:
    rng = random.Random({"W1": 1, "W2": 2, "W3": 3, "W4": 4}[name])
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    reqs = []
    if name == "W1":  # RL groups: 32 prompts x 8 completions
        for _ in range(32):
            prompt = tok(rng.randint(256, 2048))
            for _ in range(8):
                n = int(round(math.exp(rng.uniform(math.log(16), math.log(4096)))))
                reqs.append(ScoreRequest(prompt + tok(n), len(prompt)))
    elif name == "W2":  # multiple choice: 512 contexts x 4 continuations
        for _ in range(512):
            ctx = tok(rng.randint(200, 1000))
            for _ in range(4):
                reqs.append(ScoreRequest(ctx + tok(rng.randint(1, 30)), len(ctx)))
    elif name == "W3":  # perplexity: 256k tokens, context 2048, stride 512
        ids = tok(262144)
        for w in sliding_windows(len(ids), 2048, 512):
            reqs.append(ScoreRequest(ids[w.begin:w.end], w.score_begin - w.begin))
    elif name == "W4":  # long context: one 32k and one 128k sequence, all scored
        for n in (32768, 131072):
            reqs.append(ScoreRequest(tok(n + 1), 1))
    return reqs


def run_logprobe(model, reqs, batch_tokens, **options):
    """``options``: EngineConfig fields (``share_prefixes``, ``deterministic``); ``batch_tokens``
    None: the library's default budget (chosen from free memory when the engine starts)."""
    engine = Engine(model, EngineConfig(max_batch_tokens=batch_tokens, progress=False, **options),
                    torch.device("cuda"))
    return engine.run(reqs)


def kernel_profile(run, label: str) -> None:
    """The CUDA kernels of one ``run()`` under torch.profiler, by total time (top 25; the share a
    kernel family would free). ``run`` is called once before, so shapes are compiled."""
    from torch.profiler import ProfilerActivity, profile

    run()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) or 1
    log(f"\n## Profile: {label}, {total / 1e3:.1f} ms of kernels")
    log("| kernel | calls | ms | share |\n| --- | ---: | ---: | ---: |")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        log(f"| {e.key[:90]} | {e.count} | {e.self_device_time_total / 1e3:.1f} | {e.self_device_time_total / total:.1%} |")


def options_section(args) -> None:
    """Issue 19's per-request options on whole W1: every request plain, then with temperature 0.7,
    top-5 and entropy, at the default budget, best of ``--passes`` each (no baseline)."""
    from dataclasses import replace

    log("\n## W1 with per-request options (temperature 0.7 + top-5 + entropy) against plain")
    log("| model | plain s | options s | cost |\n| --- | ---: | ---: | ---: |")
    for name in args.models.split(","):
        _, ours, lc = build_models(name, baseline=False)
        plain = workload("W1", lc.vocab_size)
        rich = [replace(r, temperature=0.7, top_k=5, entropy=True) for r in plain]
        engine = Engine(ours, EngineConfig(progress=False), torch.device("cuda"))
        with torch.inference_mode():
            engine.run(rich[:32])  # compiles the top-k / entropy variants
            t = {k: best_of(args.passes, partial(engine.run, reqs), f"{name} W1 {k}")[1]
                 for k, reqs in (("plain", plain), ("options", rich))}
        log(f"| {name} | {t['plain']:.2f} | {t['options']:.2f} | {t['options'] / t['plain'] - 1:+.1%} |")
        del ours, engine
        torch.cuda.empty_cache()


def profile_section(args) -> None:
    """Where logprobe's time goes on W1 (first ``--profile-requests`` requests, default budget), per model."""
    for name in args.models.split(","):
        _, ours, lc = build_models(name, baseline=False)
        reqs = workload("W1", lc.vocab_size)[:args.profile_requests]
        run = partial(Engine(ours, EngineConfig(progress=False), torch.device("cuda")).run, reqs)
        with torch.inference_mode():
            kernel_profile(run, f"{name} W1, first {len(reqs)} requests")
        del ours, run
        torch.cuda.empty_cache()


def engine_modes_section(args) -> None:
    """Issue 4 on the GPU: W2 and W1 with and without shared-prefix packing, and the cost of
    deterministic mode on a W3 slice (the first ``--det-windows`` windows) and a W1 slice."""
    table = []
    for mname in args.models.split(","):
        _, ours, lc = build_models(mname, False)
        run_logprobe(ours, workload("W2", lc.vocab_size)[:64], args.batch_tokens)  # warm-up
        cases = [(w, workload(w, lc.vocab_size), "share_prefixes") for w in ("W2", "W1")]
        cases += [("W3 slice", workload("W3", lc.vocab_size)[:args.det_windows], "deterministic"),
                  ("W1 slice", workload("W1", lc.vocab_size)[:args.det_windows], "deterministic")]
        if args.det_only:
            cases = cases[2:]
        if args.det_triton:
            cases += [(w, reqs, "deterministic, Triton matmul") for w, reqs, o in cases if o == "deterministic"]
        if args.overlap:  # issue 19: results read after the next batch launched (default) vs before
            cases = [(w, workload(w, lc.vocab_size), "overlap_host") for w in ("W1", "W2")] + cases
        for wname, reqs, option in cases:
            base_opt = {"share_prefixes": False} if option == "share_prefixes" else {}
            on_opt = {} if option == "share_prefixes" else {"deterministic": True}
            if option == "overlap_host":  # "off" is the engine before the overlap; "on" the default
                base_opt, on_opt = {"overlap_host": False}, {}
            # deterministic Linears: cuBLAS on fixed 2048-row tiles (default) or the Triton matmul
            if "Triton" in option:
                on_opt["invariant_matmul"] = "triton"
            with torch.inference_mode():
                run_logprobe(ours, reqs[:8], args.batch_tokens, **on_opt)  # warm-up of this mode
                base, t_base = sync_time(lambda r=reqs, o=base_opt, m=ours: run_logprobe(m, r, args.batch_tokens, **o))
                on, t_on = sync_time(lambda r=reqs, o=on_opt, m=ours: run_logprobe(m, r, args.batch_tokens, **o))
                if option not in ("share_prefixes", "overlap_host"):  # short runs: best of two, so a one-off first-call cost does not count
                    t_base = min(t_base, sync_time(lambda r=reqs, o=base_opt, m=ours: run_logprobe(
                        m, r, args.batch_tokens, **o))[1])
                    t_on = min(t_on, sync_time(lambda r=reqs, o=on_opt, m=ours: run_logprobe(
                        m, r, args.batch_tokens, **o))[1])
                if option not in ("share_prefixes", "overlap_host"):  # bitwise: the first 3 requests alone vs in the whole slice
                    alone = run_logprobe(ours, reqs[:3], args.batch_tokens, **on_opt)
                    same = all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(alone, on[:3]))
                    log(f"{mname} {wname} {option}: first 3 requests alone vs in the slice bitwise: {same}")
            d = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(base, on))
            table.append((mname, wname, option, sum(r.num_inputs for r in reqs), t_base, t_on, d))
            log(f"{mname} {wname} {option}: off {t_base:.2f} s, on {t_on:.2f} s, max |Δ| {d:.2e}")
        ours = None
        gc.collect()
        torch.cuda.empty_cache()
    log("\n| model | workload | option | input tokens | off s | on s | on / off | max abs Δ |")
    log("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for m, w, o, n, a, b, d in table:
        log(f"| {m} | {w} | {o} | {n:,} | {a:.2f} | {b:.2f} | {b / a:.2f} | {d:.2e} |")


def matmul_section(args) -> None:
    """Deterministic mode's fixed-tile Triton matmul (kernels/matmul.py) against cuBLAS
    (``F.linear``) on llama-8b's projection shapes at M = 32,768 rows, for a few tile configs;
    then M = 100 + the same rows in a larger batch, to show the rows' bits do not move."""
    import torch.nn.functional as F

    from logprobe.kernels.matmul import DEFAULT_CONFIG as MM_DEFAULT
    from logprobe.kernels.matmul import MatmulConfig, invariant_linear

    M = 32768
    shapes = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate+up", 4096, 28672), ("down", 14336, 4096)]
    configs = [MM_DEFAULT, MatmulConfig(128, 256, 64, 8, 8, 3), MatmulConfig(128, 256, 64, 8, 8, 4),
               MatmulConfig(256, 128, 64, 8, 8, 3), MatmulConfig(128, 128, 128, 8, 8, 3),
               MatmulConfig(64, 256, 64, 8, 4, 4)]
    rows = []
    for name, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        flop = 2 * M * N * K
        t_ref = bench_ms(lambda x=x, w=w: F.linear(x, w), args.rep)
        cells = []
        for c in configs:
            try:
                t = bench_ms(lambda x=x, w=w, c=c: invariant_linear(x, w, config=c), args.rep)
                cells.append(f"{flop / t / 1e9:.0f} ({t_ref / t:.2f})")
            except Exception as e:  # a config the compiler or shared memory refuses
                cells.append(f"fail: {type(e).__name__}")
        small = invariant_linear(x[:100].clone(), w)
        same = bool(torch.equal(small, invariant_linear(x, w)[:100]))
        # the alternative: cuBLAS on fixed-shape row tiles (same shape -> same kernel); is a row's
        # result independent of its position in the tile and of the other rows?
        for tile in (2048, 4096):
            t = bench_ms(lambda x=x, w=w, tile=tile: [F.linear(x[i:i + tile], w) for i in range(0, M, tile)], args.rep)
            a = F.linear(x[:tile], w)[:100]
            shifted = torch.cat([x[tile:tile + 37], x[:100], x[2 * tile:3 * tile - 137]])  # [tile, K]
            b = F.linear(shifted, w)[37:137]
            cells.append(f"{flop / t / 1e9:.0f} ({t_ref / t:.2f}) {'bitwise' if torch.equal(a, b) else 'DIFFERS'}")
        rows.append((name, K, N, flop / t_ref / 1e9, cells, same))
        del x, w
        torch.cuda.empty_cache()
    names = ["x".join(str(v) for v in (c.block_m, c.block_n, c.block_k)) + f"/w{c.num_warps}s{c.num_stages}"
             for c in configs] + ["cuBLAS 2048-row tiles", "cuBLAS 4096-row tiles"]
    log("\n| shape | K | N | cuBLAS TFLOP/s | " + " | ".join(names) + " | rows bitwise |")
    log("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " | --- |")
    for name, K, N, ref, cells, same in rows:
        log(f"| {name} | {K} | {N} | {ref:.0f} | " + " | ".join(cells) + f" | {same} |")
    log("(Triton cells: TFLOP/s (speed relative to cuBLAS))")


def byte_tokenizer():
    """A byte-level tokenizer (every byte a token, ids 3.. ): the random-weight benches score token
    ids, a model directory still needs one."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def run_transformers(hf, reqs, budget, dev="cuda", use_cache: bool = True):
    """Right-padded batches (sorted by length) of at most ``budget`` padded tokens; logits ->
    float32 log_softmax -> gather. Returns per-request logprobs (float32, on the CPU).
    ``use_cache=False``: no KV cache is built (bench/gpu_moe.py's baseline)."""
    order = sorted(range(len(reqs)), key=lambda i: -reqs[i].num_inputs)
    out = [None] * len(reqs)
    i = 0
    while i < len(order):
        L = reqs[order[i]].num_inputs
        B = max(1, budget // L)
        idx = order[i:i + B]
        i += B
        ids = torch.zeros(len(idx), L, dtype=torch.long)
        mask = torch.zeros(len(idx), L, dtype=torch.long)
        for j, r in enumerate(idx):
            t = reqs[r].tokens[:-1]
            ids[j, :len(t)] = torch.tensor(t)
            mask[j, :len(t)] = 1
        logits = hf(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=use_cache).logits  # [B, L, V]
        lp = logits.float().log_softmax(-1)
        del logits
        for j, r in enumerate(idx):
            q = reqs[r]
            rows = torch.arange(q.score_begin - 1, q.num_inputs, device=dev)
            tgt = torch.tensor(q.tokens[q.score_begin:], device=dev)
            out[r] = lp[j, rows].gather(1, tgt[:, None])[:, 0].cpu()
        del lp
    return out


def workloads_section(args, tflops: float) -> None:
    table = []
    for mname in args.models.split(","):
        hf, ours, lc = build_models(mname, not args.no_baseline)
        weights = torch.cuda.memory_allocated()
        log(f"\n## {mname}: {sum(p.numel() for p in ours.parameters()) / 1e9:.2f} B params (ours), "
            f"{weights / GiB:.1f} GiB allocated with both models")
        # warm-up: compiles the Triton kernels and sets up cuBLAS / SDPA
        run_logprobe(ours, workload("W2", lc.vocab_size)[:64], args.batch_tokens)
        budget = Engine(ours, EngineConfig(max_batch_tokens=args.batch_tokens), torch.device("cuda")).config
        log(f"logprobe max_batch_tokens {budget.max_batch_tokens}"
            + (" (the library's default for this model and free memory)" if args.batch_tokens is None else ""))
        for wname in args.workloads.split(","):
            if wname == "W4" and mname != "llama-8b" and not args.w4_all:
                continue
            reqs = workload(wname, lc.vocab_size)
            needed = sum(r.num_inputs for r in reqs)
            scored = sum(r.num_scored for r in reqs)
            fl = flops(lc, [(r.num_inputs, r.num_scored) for r in reqs])
            fl_unique = unique_flops(lc, reqs)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            with torch.inference_mode():
                res, sec = best_of(args.passes, lambda reqs=reqs, m=ours: run_logprobe(m, reqs, args.batch_tokens),
                                   f"logprobe {mname} {wname}")
            peak = torch.cuda.max_memory_allocated()
            ours_lp = torch.cat([r.logprobs for r in res])
            row = dict(model=mname, wl=wname, seqs=len(reqs), needed=needed, scored=scored, sec=sec,
                       tps=needed / sec, peak=(peak - weights) / GiB, mfu=fl / sec / (tflops * 1e12),
                       mfu_unique=fl_unique / sec / (tflops * 1e12))
            if wname == "W4":
                row["head_extra"] = w4_head_memory(ours, reqs[-1])
                if hf is not None:
                    w4_against_trunk(ours, hf, reqs[-1], args.batch_tokens)
            del res
            if args.elementwise_ab:  # the same run with RMSNorm / rotary / SiLU-multiply as PyTorch ops
                ours.use_triton_elementwise(False)
                with torch.inference_mode():
                    res, sec_t = sync_time(lambda reqs=reqs, m=ours: run_logprobe(m, reqs, args.batch_tokens))
                ours.use_triton_elementwise(True)
                d = float((torch.cat([r.logprobs for r in res]) - ours_lp).abs().max())
                row["torch_elementwise"] = sec_t
                log(f"  logprobe {mname} {wname} with PyTorch elementwise ops: {sec_t:.2f} s, MFU (unique) "
                    f"{fl_unique / sec_t / (tflops * 1e12):.3f}; Triton ones {sec:.2f} s ({sec_t / sec:.3f}x faster), "
                    f"max |Δ| between them {d:.3f}")
                del res
            if hf is not None and wname != "W4":  # W4: 128k-token logits do not fit; the trunk instead
                best = None
                for budget in args.budgets:
                    gc.collect()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    try:
                        with torch.inference_mode():
                            bres, bsec = best_of(args.passes, lambda b=budget, reqs=reqs, m=hf: run_transformers(m, reqs, b),
                                                 f"transformers {mname} {wname} budget {budget}")
                    except torch.OutOfMemoryError:
                        log(f"  transformers {mname} {wname} budget {budget}: OOM")
                        continue
                    bpeak = torch.cuda.max_memory_allocated()
                    d = float((torch.cat(bres) - ours_lp).abs().max())
                    log(f"  transformers {mname} {wname} budget {budget}: {bsec:.2f} s, "
                        f"{(bpeak - weights) / GiB:.1f} GiB, max |Δ| vs logprobe {d:.3f}")
                    if best is None or bsec < best[0]:
                        best = (bsec, budget, (bpeak - weights) / GiB, d)
                    del bres
                row["base"] = best
            table.append(row)
            log(f"  logprobe {mname} {wname}: {sec:.2f} s, {needed / sec:,.0f} tok/s, MFU {row['mfu']:.3f}, "
                f"peak {row['peak']:.1f} GiB" + (f", head extra {row['head_extra']:.2f} GiB" if "head_extra" in row
                                                 else ""))
        hf = ours = None
        gc.collect()
        torch.cuda.empty_cache()
    log(f"\n## workloads (bf16, random init; matmul ceiling {tflops:.0f} TFLOP/s measured in this run; "
        f"logprobe max_batch_tokens {args.batch_tokens or 'default, per model above'})")
    log("MFU: FLOPs of all needed tokens (the work as posed) / time / ceiling; MFU (unique): FLOPs left "
        "after shared prefixes run once (what the GPU actually computed) / time / ceiling")
    log("| model | workload | sequences | needed tokens | scored tokens | logprobe s | tok/s (needed) | MFU | "
        "MFU (unique) | peak extra GiB | transformers s (budget) | transformers extra GiB | speed-up | max abs Δ |")
    log("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in table:
        b = r.get("base")
        if "base" not in r:
            bs = "| — | — | — | —"
        elif b is None:
            bs = "| OOM | OOM | — | —"
        else:
            bs = f"| {b[0]:.2f} ({b[1]}) | {b[2]:.1f} | {b[0] / r['sec']:.2f}x | {b[3]:.3f}"
        peak = f"{r['peak']:.1f}" + (f" (head {r['head_extra']:.2f})" if "head_extra" in r else "")
        log(f"| {r['model']} | {r['wl']} | {r['seqs']} | {r['needed']:,} | {r['scored']:,} | {r['sec']:.2f} | "
            f"{r['tps']:,.0f} | {r['mfu']:.3f} | {r['mfu_unique']:.3f} | {peak} {bs} |")


def w4_against_trunk(ours, hf, req, batch_tokens) -> None:
    """Issue 19's long-context target: logprobe scoring every token of the 128k request (defaults:
    chunked under the budget, head included) against transformers' trunk alone (``hf.model``: the
    decoder layers and final norm, no LM head, no log-softmax) on the same weights, one forward."""
    ids = torch.tensor(req.tokens[:-1], device="cuda").view(1, -1)
    with torch.inference_mode():
        run_logprobe(ours, [req], batch_tokens)  # warm: this length's chunk shapes
        _, ours_s = sync_time(lambda: run_logprobe(ours, [req], batch_tokens))
        try:
            hf.model(input_ids=ids[:, :4096], use_cache=False)  # warm
            _, trunk_s = sync_time(lambda: hf.model(input_ids=ids, use_cache=False).last_hidden_state)
        except torch.OutOfMemoryError:
            log(f"  W4 {ids.shape[1]:,} tokens: transformers' trunk OOM; logprobe {ours_s:.2f} s")
            return
    log(f"  W4 {ids.shape[1]:,} tokens in one sequence: logprobe (all tokens scored, defaults) {ours_s:.2f} s, "
        f"transformers trunk alone {trunk_s:.2f} s: **{ours_s / trunk_s:.3f}x the trunk** (target <= 1.15)")


def w4_head_memory(model, req) -> float:
    """Extra GiB the head takes on one long request (hidden states already computed)."""
    (batch,) = plan_work([req.tokens[:-1]], len(req.tokens), share=False, chunk=False)
    packed = pack(batch, [req], torch.device("cuda"))
    with torch.inference_mode():
        hidden = model(packed.input_ids, packed.positions, packed.meta)
        rows = hidden[packed.score_rows]
        del hidden
        _, mem = extra_memory(lambda: logprob_head(rows, model.head_params(), packed.targets, packed.temperature,
                                                   top_k=5, entropy=True))
    return mem / GiB


# ---------------------------------------------------------------------------------- attention


def attention_section(args) -> None:
    """Block-diagonal causal attention over one packed W1-like batch, llama-8b heads (32 q, 8 kv, D 128):
    the portable per-sequence SDPA loop, varlen FlashAttention-2 (one call), FlexAttention with a
    document block mask (compiled)."""
    from logprobe.layers import attention
    from logprobe.layers.attention_gpu import flash_varlen_attention

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


# -------------------------------------------------------------------------------------- exact


def exact_section(args) -> None:
    """bf16 and float32 logprobe vs float64 logits of the same (bf16-valued) random SmolLM2 weights."""
    import transformers as tf

    hf, ours_bf16, lc = build_models("smollm2-135m", True)
    ref = tf.LlamaForCausalLM(hf.config).to("cuda", torch.float64)
    ref.load_state_dict({k: v.double() for k, v in hf.state_dict().items()})
    ref.eval()
    from logprobe.loading.loader import _build_native
    from logprobe.models.llama import LlamaModel

    with torch.device("meta"):
        names = set(LlamaModel(lc).state_dict().keys())
    ours_f32 = _build_native(lc, [(k.removeprefix("model."), v.float()) for k, v in hf.state_dict().items()
                                  if k.removeprefix("model.") in names], torch.device("cuda"), torch.float32)
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


def decoder_linears(model):
    """(parent module, attribute name) of every decoder projection, for replacing it: a fused
    q/k/v or gate/up matrix once, its parts (views of it) dropped so the bf16 copy is freed."""
    for layer in model.layers:
        for parent, fused, parts, rest in ((layer.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), "o_proj"),
                                           (layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"), "down_proj")):
            if getattr(parent, fused, None) is not None:
                for p in parts:
                    setattr(parent, p, None)
                names = (fused, rest)
            else:
                names = (*parts, rest)
            for name in names:
                yield parent, name


def quantize_w4a16(model, group: int = 128) -> int:
    """Replace every decoder Linear by a ``CTLinear`` holding its round-to-nearest int4 symmetric
    group-``group`` quantization (bf16 scales, as llm-compressor writes for a bf16 model). Returns
    the packed bytes; the bf16 weights are freed."""
    from logprobe.layers.quant_linear import CTLinear

    total = 0
    # a fused matrix is quantized as one (groups lie within rows, so this equals quantizing the parts)
    for parent, name in decoder_linears(model):
        m = getattr(parent, name)
        w = m.weight.float()  # [N, K]
        N, K = w.shape
        wg = w.view(N, K // group, group)
        scale = (wg.abs().amax(-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)  # [N, G], as calculate_qparams
        codes = torch.round(wg / scale.float()[..., None]).clamp(-8, 7).view(N, K).to(torch.int64)
        u = (codes + 8).view(N, K // 8, 8)
        words = sum(u[..., i] << (4 * i) for i in range(8))  # [N, K/8] in [0, 2^32)
        qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        q = CTLinear(qweight, scale, None, 4, group, K, bias=m.bias)
        total += q.packed_bytes()
        setattr(parent, name, q)
        del w, wg, codes, u, words
    torch.cuda.empty_cache()
    return total


def packed_head(V: int, H: int, qtype: str = "Q6_K") -> HeadParams:
    """A [V, H] LM head of random GGUF ``qtype`` blocks (small valid scales) as the head sees a
    packed one: ``HeadParams`` over ``PackedEmbedding(...).weight`` (a ``PackedRows``)."""
    import numpy as np

    from logprobe.layers.quant_linear import GGUFLinear, PackedEmbedding
    from logprobe.kernels.gguf_quants import GGML_TYPES, block_values, split_blocks

    type_id = next(t for t, (name, _) in GGML_TYPES.items() if name == qtype)
    raw = np.random.default_rng(1).integers(0, 256, V * (H // block_values(qtype)) * GGML_TYPES[type_id][1],
                                            dtype=np.uint8)
    b = split_blocks(raw, type_id, (V, H))
    b["d"] = (torch.rand(b["d"].shape) * 1e-3 + 1e-4).half()
    layer = GGUFLinear(qtype, *(b[k].cuda() if k in b else None for k in ("d", "qs", "m")))
    return HeadParams(PackedEmbedding(layer, torch.bfloat16).weight)


def random_gguf(model, qtype: str) -> int:
    """Replace every decoder Linear by a ``GGUFLinear`` of random ``qtype`` blocks of its shape
    (random codes, small random scales: a speed stand-in, not a quantization of the weights).
    Returns the packed bytes."""
    import numpy as np

    from logprobe.layers.quant_linear import GGUFLinear
    from logprobe.kernels.gguf_quants import GGML_TYPES, block_values, split_blocks

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
    from logprobe.layers.quant_linear import GGUFLinear

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
    gc.collect()
    torch.cuda.empty_cache()
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
        gc.collect()
        torch.cuda.empty_cache()


def quant_section(args, tflops: float) -> None:
    """Issue 6 on the GPU: the W4A16 dequant-GEMM alone at llama-8b shapes against the bf16
    matmul, then llama-8b W4A16 (random init, RTN group 128) against the same model in bf16 on W3:
    time, weight memory, and quantization quality (KL on a W3 slice, ``scoring.compare``)."""
    from logprobe.kernels.w4a16 import W4A16Config, w4_expand, w4a16_linear, w4a16_matmul, w4a16_reference
    from logprobe.scoring.compare import compare_requests, compare_stats

    log("\n## W4A16 vs bf16 matmul (llama-8b shapes, group 128)")
    log("| M | N | K | bf16 F.linear ms | dequant-GEMM ms (best config) | expand ms | expand + cuBLAS ms | "
        "w4a16_linear ms | max rel Δ vs reference |")
    log("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    g = torch.Generator(device="cuda").manual_seed(0)
    configs = [W4A16Config(), W4A16Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
               W4A16Config(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
               W4A16Config(block_m=128, block_n=64, block_k=128, num_warps=4, num_stages=3),
               W4A16Config(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)]
    for M, N, K in [(16, 14336, 4096), (128, 14336, 4096), (512, 14336, 4096), (8192, 14336, 4096),
                    (8192, 4096, 14336), (8192, 4096, 4096)]:
        x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
        qw = torch.randint(-2**31, 2**31 - 1, (N, K // 8), device="cuda", generator=g, dtype=torch.int32)
        sc = (torch.rand(N, K // 128, device="cuda", generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
        wd = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16)
        t_dense = bench_ms(lambda x=x, wd=wd: torch.nn.functional.linear(x, wd), rep=100)
        ref = w4a16_reference(x, qw, sc, None, 128).float()
        best = None
        for cfg in configs:
            try:
                t = bench_ms(lambda x=x, qw=qw, sc=sc, cfg=cfg: w4a16_matmul(x, qw, sc, None, 128, cfg), rep=100)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped, and said
                log(f"(config {cfg} failed: {type(e).__name__})")
                continue
            err = float((w4a16_matmul(x, qw, sc, None, 128, cfg).float() - ref).abs().max() / ref.abs().max())
            if best is None or t < best[0]:
                best = (t, cfg, err)
        t_exp = bench_ms(lambda qw=qw, sc=sc, K=K: w4_expand(qw, sc, None, 128, K, torch.bfloat16), rep=100)
        t_ec = bench_ms(lambda x=x, qw=qw, sc=sc, K=K: torch.nn.functional.linear(
            x, w4_expand(qw, sc, None, 128, K, torch.bfloat16)), rep=100)
        t_lin = bench_ms(lambda x=x, qw=qw, sc=sc: w4a16_linear(x, qw, sc, None, 128), rep=100)
        c = best[1]
        log(f"| {M} | {N} | {K} | {t_dense:.3f} | {best[0]:.3f} (m{c.block_m} n{c.block_n} k{c.block_k} "
            f"w{c.num_warps} s{c.num_stages}) | {t_exp:.3f} | {t_ec:.3f} | {t_lin:.3f} | {best[2]:.1e} |")
        del x, qw, sc, wd, ref

    _, dense, lc = build_models("llama-8b", False)
    reqs = workload("W3", lc.vocab_size)
    needed = sum(r.num_inputs for r in reqs)
    linear_bf16 = sum(m.weight.numel() * 2 for layer in dense.layers
                      for m in (layer.self_attn.qkv_proj or layer.self_attn.q_proj, layer.self_attn.o_proj,
                                layer.mlp.gate_up_proj or layer.mlp.gate_proj, layer.mlp.down_proj))
    if dense.layers[0].self_attn.qkv_proj is None:
        log("(note: projections not fused; the bf16 linear bytes count only q and gate)")
    with torch.inference_mode():
        run_logprobe(dense, reqs[:4], args.batch_tokens)  # warm-up
        res_d, t_d = sync_time(lambda: run_logprobe(dense, reqs, args.batch_tokens))
    mem_d = torch.cuda.memory_allocated()
    log(f"\nllama-8b bf16 W3: {t_d:.2f} s, {needed / t_d:,.0f} tok/s, weights {mem_d / GiB:.1f} GiB allocated")
    # quantize a second copy: build again from the same seed, then replace its Linears
    _, quant, _ = build_models("llama-8b", False)
    packed = quantize_w4a16(quant)
    torch.cuda.empty_cache()
    mem_both = torch.cuda.memory_allocated()
    with torch.inference_mode():
        run_logprobe(quant, reqs[:4], args.batch_tokens)  # warm-up: compiles the kernel
        res_q, t_q = sync_time(lambda: run_logprobe(quant, reqs, args.batch_tokens))
    d = torch.cat([a.logprobs for a in res_q]) - torch.cat([b.logprobs for b in res_d])
    log(f"llama-8b W4A16 W3: {t_q:.2f} s, {needed / t_q:,.0f} tok/s; linear weights {packed / GiB:.2f} GiB packed vs "
        f"{linear_bf16 / GiB:.2f} GiB bf16 ({packed / linear_bf16:.3f}x); whole W4A16 model "
        f"{(mem_both - mem_d) / GiB:.1f} GiB allocated; per-token |Δ logprob| vs bf16 mean {float(d.abs().mean()):.4f} "
        f"max {float(d.abs().max()):.3f}")
    cfg = EngineConfig(max_batch_tokens=args.batch_tokens, progress=False)
    eq, er = Engine(quant, cfg, torch.device("cuda")), Engine(dense, cfg, torch.device("cuda"))
    sl = reqs[:args.det_windows]
    rows, t_c = sync_time(lambda: compare_requests(eq, er, sl, token_budget=eq.config.max_batch_tokens))
    st = compare_stats(rows, len(sl), "sliding", 2048, 512)
    log(f"compare W4A16 vs bf16 on the first {len(sl)} W3 windows ({st.num_tokens} tokens, {t_c:.2f} s): "
        f"PPL ratio {st.ppl_ratio:.4f} ± {st.ppl_ratio_stderr:.4f}, KL mean {st.kl_mean:.5f} ± {st.kl_stderr:.5f}, "
        f"KL 99% {st.kl_percentiles['99.0']:.4f}, same top {100 * st.same_top:.2f}%, RMS Δp {100 * st.dp_rms:.3f}%")
    log("(random-init weights: RTN noise through 32 random layers decorrelates the hidden states, so KL is large "
        "and top-token agreement near chance; this says nothing about trained models, see the SmolLM2 compare runs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="head,attention,exact,workloads")
    ap.add_argument("--models", default="smollm2-135m,llama-1b,llama-8b")
    ap.add_argument("--workloads", default="W1,W2,W3,W4")
    ap.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--budgets", default="8192,32768", help="transformers padded-token budgets to try")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="logprobe max_batch_tokens (default: the library's, chosen from free memory; runs "
                         "before session 7 passed 32768)")
    ap.add_argument("--head-tokens", type=int, default=16384)
    ap.add_argument("--rep", type=int, default=300, help="do_bench milliseconds per head row")
    ap.add_argument("--tune", action="store_true", help="sweep kernel tile configs first")
    ap.add_argument("--elementwise-ab", action="store_true",
                    help="workloads: also time logprobe with RMSNorm/rotary/SiLU-multiply as PyTorch ops")
    ap.add_argument("--tune-topk", action="store_true", help="sweep the top-k settings (splits, flattening)")
    ap.add_argument("--triton-matmul", action="store_true", help="also time a plain Triton matmul")
    ap.add_argument("--det-only", action="store_true", help="engine section: only the deterministic-mode rows")
    ap.add_argument("--overlap", action="store_true",
                    help="engine section: also W1 and W2 with the host overlap off (before) and on (default)")
    ap.add_argument("--det-triton", action="store_true", help="engine section: also deterministic mode with "
                    "the Triton fixed-tile matmul instead of cuBLAS row tiles")
    ap.add_argument("--det-windows", type=int, default=32, help="engine section: requests in the slices")
    ap.add_argument("--w4-all", action="store_true", help="W4 on every model, not only llama-8b")
    ap.add_argument("--gguf-types", default="Q4_K,Q8_0", help="gguf section: block types to time")
    ap.add_argument("--profile-requests", type=int, default=64, help="profile section: W1 requests profiled")
    ap.add_argument("--passes", type=int, default=2, help="workloads section: timed passes of each engine over a "
                    "workload; the best is reported, each is logged")
    args = ap.parse_args()
    args.budgets = [int(b) for b in args.budgets.split(",")]
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    p = torch.cuda.get_device_properties(0)
    import transformers
    import triton

    log(f"device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / GiB:.0f} GiB; torch {torch.__version__}, "
        f"triton {triton.__version__}, transformers {transformers.__version__}")
    tflops = matmul_ceiling()
    log(f"bf16 8192^3 matmul: {tflops:.0f} TFLOP/s")
    sections = args.sections.split(",")
    if "head" in sections:
        head_section(args, tflops)
    if "attention" in sections:
        attention_section(args)
    if "exact" in sections:
        exact_section(args)
    if "workloads" in sections:
        workloads_section(args, tflops)
    if "engine" in sections:
        engine_modes_section(args)
    if "matmul" in sections:
        matmul_section(args)
    if "gguf" in sections:
        gguf_section(args)
    if "quant" in sections:
        quant_section(args, tflops)
    if "profile" in sections:
        profile_section(args)
    if "options" in sections:
        options_section(args)


if __name__ == "__main__":
    main()
