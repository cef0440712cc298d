"""What the benchmark scripts share: the workloads W1-W4, timing, the matmul ceiling, FLOP counts,
the random-init model shapes, a byte tokenizer, a random checkpoint on disk, the transformers
baseline. Not a script: ``sys.path.insert(0, <bench/>)`` then ``from common import ...``.

Imports without a GPU (triton and transformers are imported where they are used).

Workloads (seeded, the same ids in every run and every script):
  W1  RL groups: 32 prompts of 256-2048 ids x 8 completions of 16-4096 ids (log-uniform); the
      completions are scored
  W2  multiple choice: 512 contexts of 200-1000 ids x 4 continuations of 1-30
  W3  perplexity: 262,144 ids in windows of 2048, stride 512
  W4  long context: one 32,768-id and one 131,072-id sequence, every token scored
"""

from __future__ import annotations

import gc
import json
import math
import platform
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from logprobe import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.engine.runner import Engine
from logprobe.executor.profile import COLLECTIVES, busy_union  # noqa: F401 - the benches' too
from logprobe.executor.profile import kernel_family as profile_family
from logprobe.models.llama import LlamaModel
from logprobe.scoring.windows import sliding_windows

GiB = 1024**3
_LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # Llama 3.1's
MODELS = {
    # Llama-3.1-8B, Llama-3.2-1B and SmolLM2-135M shapes (random weights)
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                     max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_parameters=dict(_LLAMA31_ROPE)),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                     max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    # Llama-3.1-70B's shape (80 layers, 64 query / 8 key-value heads): 141 GB in bf16, 71 GB as FP8 blocks
    "llama-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
                      max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_parameters=dict(_LLAMA31_ROPE)),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
}
# Qwen3-30B-A3B's config.json (the fields that shape the compute)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                     tie_word_embeddings=False, use_sliding_window=False, bos_token_id=151643,
                     eos_token_id=151645)
QWEN3_MOE_TINY = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
# GLM-4.5-Air's shape (``glm4_moe``: 128 experts top-8 + 1 shared, 96 query heads, half-rotary, q/k/v
# bias; 106B parameters in all), the transformers ``Glm4MoeConfig`` arguments
GLM45_AIR = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                 num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_shared_experts=1,
                 n_routed_experts=128, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                 routed_scaling_factor=1.0, norm_topk_prob=True, partial_rotary_factor=0.5, attention_bias=True,
                 use_qk_norm=False, tie_word_embeddings=False)
# Qwen3.5 hybrids (Gated DeltaNet linear attention, 3 linear : 1 full layers): the text configs of
# Qwen3.5-9B and Qwen3.5-35B-A3B (transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig, whose
# defaults are these two models), and tiny ones for CPU runs; bench/gpu_hybrid.py writes them
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": True}
_QWEN35_COMMON = dict(vocab_size=248320, num_attention_heads=16, head_dim=256, linear_conv_kernel_dim=4,
                      linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                      linear_num_value_heads=32, max_position_embeddings=262144, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, rope_parameters=_QWEN35_ROPE, bos_token_id=1, eos_token_id=2)
_QWEN35_TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, max_position_embeddings=32768)
HYBRID_MODELS = {  # name: (transformers config class, kwargs)
    "qwen35-9b": ("Qwen3_5TextConfig", dict(_QWEN35_COMMON, hidden_size=4096, intermediate_size=12288,
                                             num_hidden_layers=32, num_key_value_heads=4)),
    "qwen35-4b": ("Qwen3_5TextConfig", dict(_QWEN35_COMMON, hidden_size=2560, intermediate_size=9216,
                                             num_hidden_layers=32, num_key_value_heads=4)),
    "qwen35-35b-a3b": ("Qwen3_5MoeTextConfig", dict(_QWEN35_COMMON, hidden_size=2048, num_hidden_layers=40,
                                                   num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
                                                   moe_intermediate_size=512, shared_expert_intermediate_size=512)),
}
HYBRID_TINY = {
    "qwen35-9b": dict(_QWEN35_TINY, intermediate_size=128),
    "qwen35-4b": dict(_QWEN35_TINY, intermediate_size=128),
    "qwen35-35b-a3b": dict(_QWEN35_TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32),
}
# the shapes save_model writes (transformers' default rope and untied head, 8192 positions)
SAVED_SHAPES = {
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "tiny": dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def log(*a):
    print(*a, flush=True)


REPO = Path(__file__).resolve().parent.parent
WIKITEXT = REPO / ".." / "shared" / "data" / "wikitext-2-raw-v1" / "wiki.test.raw"  # the CPU benches' text


# ---------------------------------------------------------------------------------------- host


def read_wikitext(path: Path) -> str:
    """The test split as the Hugging Face rows, joined with blank lines (the HF perplexity guide)."""
    txt = open(path, encoding="utf-8", newline="").read()
    rows = [ln + "\n" for ln in txt.split("\n")[:-1]]
    rows = [r if r.strip() else "" for r in rows]
    return "\n\n".join(rows)


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_gib() -> float | None:
    try:
        for line in open("/proc/meminfo", encoding="utf-8"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + (" (+ uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# -------------------------------------------------------------------------------------- timing


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_time(fn):
    """``(fn(), seconds)``, the GPU synchronised before and after."""
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
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


def bench_ms(fn, rep=200, warmup=50):
    """Median milliseconds of ``triton.testing.do_bench`` (CUDA)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def extra_memory(fn):
    """``(fn(), peak bytes allocated by fn() above what was allocated before it)``."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def matmul_ceiling() -> float:
    """bf16 8192^3 TFLOP/s on random data (median of do_bench)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def gpu_banner() -> float:
    """Exits with a one-line message without a CUDA GPU; else logs the device and versions and
    measures the matmul ceiling (TFLOP/s, returned)."""
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import transformers
    import triton

    p = torch.cuda.get_device_properties(0)
    log(f"device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / GiB:.0f} GiB; torch {torch.__version__}, "
        f"triton {triton.__version__}, transformers {transformers.__version__}")
    tflops = matmul_ceiling()
    log(f"bf16 8192^3 matmul: {tflops:.0f} TFLOP/s")
    return tflops


# the family-grouped table's rows, in this order: family -> what it holds
FAMILIES = {
    "matmul": "matmul / GEMM (cuBLAS, CUTLASS, Triton matmuls, weight expansion)",
    "attention": "attention (flash, cuDNN SDPA)",
    "gated-delta": "gated delta rule (fla chunk kernels)",
    "conv": "short / causal conv",
    "moe": "MoE fused expert kernels",
    "routing": "routing (softmax, top-k, sort)",
    "head": "log-prob head kernel",
    "elementwise": "elementwise / norm / rotary / reductions",
    "copy": "copies / memcpy / cat / index",
    "nccl": "NCCL",
    "other": "other",
}
def kernel_family(name: str) -> str:
    """The family (a key of ``FAMILIES``) of a CUDA kernel's profiler name: ``executor.profile``'s,
    its collectives as one ``nccl`` and its ``gemm`` named ``matmul``.

    >>> [kernel_family(n) for n in ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
    ...     "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN", "flash_fwd_kernel", "chunk_gated_delta_rule_fwd_kernel_h",
    ...     "_head_partials", "ncclDevKernel_AllGather_RING_LL", "void at::native::elementwise_kernel<128, 2, ...>")]
    ['matmul', 'matmul', 'attention', 'gated-delta', 'head', 'nccl', 'elementwise']
    >>> [kernel_family(n) for n in ("_gate_up_kernel", "void at::native::sbtopk::gatherTopK<float, unsigned, 2>",
    ...     "causal_conv1d_fwd_kernel", "Memcpy HtoD (Pinned -> Device)", "_rmsnorm", "some_new_kernel")]
    ['moe', 'routing', 'conv', 'copy', 'elementwise', 'other']
    """
    family = profile_family(name)  # the library's rules (executor.profile): one classifier
    return "nccl" if family in COLLECTIVES else "matmul" if family == "gemm" else family


def family_times(kernels) -> dict[str, float]:
    """(kernel name, time) pairs summed by ``kernel_family``, in ``FAMILIES`` order, families with none left out.

    >>> family_times([("flash_fwd_kernel", 3.0), ("nvjet_tst_x", 5.0), ("ampere_bf16_s16816gemm", 1.0)])
    {'matmul': 6.0, 'attention': 3.0}
    """
    out = dict.fromkeys(FAMILIES, 0.0)
    for name, t in kernels:
        out[kernel_family(name)] += t
    return {f: t for f, t in out.items() if t}


_PROFILER_OWN = ("torch/profiler", "torch/autograd/profiler", "ProfilerStep", "profiler.py")


def cpu_table(prof, top: int, calls: int = 1) -> None:
    """The ``top`` CPU ops (and Python functions, when traced with ``with_stack``) by self CPU time,
    per call; the profiler's own frames left out."""
    events = [e for e in prof.key_averages() if e.device_type.name == "CPU"
              and not any(p in e.key for p in _PROFILER_OWN)]
    total = sum(e.self_cpu_time_total for e in events) or 1
    log(f"CPU self time, all ops and functions: {total / 1e3 / calls:.2f} ms per call"
        + (f" ({calls} calls)" if calls > 1 else ""))
    log("| CPU op / function | count per call | self ms per call | share |\n| --- | ---: | ---: | ---: |")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        key = " ".join(e.key.split())[:90].replace("|", "/")
        log(f"| {key} | {e.count / calls:.1f} | {e.self_cpu_time_total / 1e3 / calls:.3f} | "
            f"{e.self_cpu_time_total / total:.1%} |")
    threads: dict[int, float] = {}
    for e in prof.events():
        if e.device_type.name == "CPU" and not any(p in e.key for p in _PROFILER_OWN):
            threads[e.thread] = threads.get(e.thread, 0.0) + e.self_cpu_time_total
    log("self time by thread (a wait counts as time): " + ", ".join(
        f"{t / 1e3 / calls:.2f} ms per call" for t in sorted(threads.values(), reverse=True)))
    waits = sum(e.self_cpu_time_total for e in events if "Synchronize" in e.key or e.key == "cudaMemcpy")
    if waits:
        log(f"host waiting on the GPU (cuda*Synchronize, blocking cudaMemcpy): {waits / 1e3 / calls:.2f} ms per call")


def kernel_tables(prof, wall: float, top: int, grouped: bool, calls: int = 1) -> dict:
    """The top ``top`` CUDA kernels by total time; ``grouped``: the family table and the GPU busy
    fraction against ``wall`` seconds of the same pass. Returns {'kernel_ms', 'busy_ms', 'wall_ms', 'families'}."""
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) or 1
    per = f" per call ({calls} calls)" if calls > 1 else ""
    log(f"{total / 1e3 / calls:.2f} ms of kernels{per}, wall {wall * 1e3 / calls:.2f} ms{per}")
    log(f"| kernel | launches{per} | ms{per} | share | family |\n| --- | ---: | ---: | ---: | --- |")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        log(f"| {' '.join(e.key.split())[:90].replace('|', '/')} | {e.count / calls:g} | "
            f"{e.self_device_time_total / 1e3 / calls:.2f} | {e.self_device_time_total / total:.1%} | "
            f"{kernel_family(e.key)} |")
    fams = family_times((e.key, e.self_device_time_total) for e in events)
    busy = busy_union((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    out = dict(kernel_ms=total / 1e3, busy_ms=busy / 1e3, wall_ms=wall * 1e3,
               families={f: t / 1e3 for f, t in fams.items()})
    if grouped:
        log(f"\n| family | ms{per} | share of kernel time |\n| --- | ---: | ---: |")
        for f, t in fams.items():
            log(f"| {FAMILIES[f]} | {t / 1e3 / calls:.2f} | {t / total:.1%} |")
        log(f"| **all kernels** | {total / 1e3 / calls:.2f} | 100% |")
        log(f"GPU busy: kernel time {total / 1e3 / calls:.2f} ms / wall {wall * 1e3 / calls:.2f} ms = "
            f"{total / 1e3 / (wall * 1e3):.1%} (an upper bound: kernels may overlap); union of kernel intervals "
            f"{busy / 1e3 / calls:.2f} ms = {busy / 1e3 / (wall * 1e3):.1%}; GPU idle "
            f"{max(0.0, wall * 1e3 - busy / 1e3) / calls:.2f} ms{per}")
    return out


def profiled(run, cuda: bool, cpu: bool, stack: bool = False):
    """``run()`` once under torch.profiler (CUDA kernels when ``cuda``, CPU ops when ``cpu``,
    Python functions too when ``stack``): (profiler, wall seconds of the run, synchronised)."""
    from torch.profiler import ProfilerActivity, profile

    acts = ([ProfilerActivity.CUDA] if cuda else []) + ([ProfilerActivity.CPU] if cpu or not cuda else [])
    with profile(activities=acts, with_stack=stack) as prof:
        _, wall = sync_time(run)
    return prof, wall


def kernel_profile(run, label: str, *, grouped: bool = False, cuda: bool | None = None, top: int = 25,
                   cpu_top: int = 0, calls: int = 1, warm: bool = True) -> dict | None:
    """The CUDA kernels of one ``run()`` under torch.profiler, by total time (top ``top``; the share
    a kernel family would free); ``grouped``: also summed by family (``kernel_family``) with the GPU
    busy fraction (kernel time / wall of the same pass). ``run`` is called once before (``warm``),
    so shapes are compiled. Without CUDA (``cuda`` False; default: whether CUDA is available) or
    with ``cpu_top``: the top CPU ops (with ``cpu_top``, Python functions too) of a pass of their
    own (CPU tracing slows the host, so the kernel pass does not trace it). ``calls``: the engine
    calls one ``run()`` makes (tables per call).
    Returns the kernel pass's numbers (``kernel_tables``), None without CUDA."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if warm:
        run()
    log(f"\n## Profile: {label}")
    out = None
    if cuda:
        prof, wall = profiled(run, cuda=True, cpu=False)
        out = kernel_tables(prof, wall, top, grouped, calls)
    if cpu_top or not cuda:
        prof, wall = profiled(run, cuda=cuda, cpu=True, stack=cpu_top > 0)
        log(f"\nCPU pass{' (Python functions traced)' if cpu_top else ''}: wall {wall * 1e3 / calls:.2f} ms"
            + (" per call" if calls > 1 else ""))
        cpu_table(prof, cpu_top or 25, calls)
    return out


# ------------------------------------------------------------------------------------ workloads


def workload(name: str, vocab: int) -> list[ScoreRequest]:
    """W1-W4 (see the module docstring) over ids 3 .. vocab - 1."""
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
    """``Engine(model).run(reqs)`` on CUDA. ``options``: EngineConfig fields (``share_prefixes``,
    ``deterministic``, ...); ``batch_tokens`` None: the library's default budget (chosen from free
    memory when the engine starts)."""
    engine = Engine(model, EngineConfig(max_batch_tokens=batch_tokens, progress=False, **options),
                    torch.device("cuda"))
    return engine.run(reqs)


def _per_token(lc) -> float:
    H, F, L = lc.hidden_size, lc.intermediate_size, lc.num_layers
    qd, kvd = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
    return 2 * L * (H * qd + 2 * H * kvd + qd * H + 3 * H * F)


def flops(lc, seqs: list[tuple[int, int]]) -> float:
    """Forward FLOPs of the needed tokens: seqs = (input length, scored tokens)."""
    qd, L, per_token = lc.num_heads * lc.head_dim, lc.num_layers, _per_token(lc)
    total = 0.0
    for n, scored in seqs:  # causal attention: L^2 D per QK, PV
        total += per_token * n + 2 * L * qd * n * n + 2 * lc.hidden_size * lc.vocab_size * scored
    return total


def unique_flops(lc, reqs: list[ScoreRequest], min_shared: int | None = 16, per_token: float | None = None) -> float:
    """FLOPs left when shared prefixes run once (``share_prefixes``): in sorted order, a request's
    tokens past its longest common prefix with the previous one (if >= ``min_shared``) are new;
    None: every needed token counts. Attention of a new token still spans its whole context.
    ``per_token``: matmul FLOPs per computed token of the blocks (default: the dense Llama's)."""
    qd, L = lc.num_heads * lc.head_dim, lc.num_layers
    per_token = _per_token(lc) if per_token is None else per_token
    total, prev = 0.0, []
    for r in sorted(reqs, key=lambda r: r.inputs):
        x, n = r.inputs, r.num_inputs
        a = 0
        if min_shared is not None:
            while a < min(len(prev), n) and prev[a] == x[a]:
                a += 1
            a = a if a >= min_shared else 0
        total += per_token * (n - a) + 2 * L * qd * (n * n - a * a) + 2 * lc.hidden_size * lc.vocab_size * r.num_scored
        prev = x
    return total


def time_workload(model, lc, mname: str, wname: str, reqs, batch_tokens, passes: int, tflops: float,
                  weights: int) -> tuple[dict, torch.Tensor]:
    """logprobe on one workload, best of ``passes``: the table row (seconds, tok/s of needed tokens,
    peak extra GiB above ``weights``, MFU on all needed / unique tokens) and the logprobs."""
    needed = sum(r.num_inputs for r in reqs)
    fl = flops(lc, [(r.num_inputs, r.num_scored) for r in reqs])
    free()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        res, sec = best_of(passes, lambda: run_logprobe(model, reqs, batch_tokens), f"logprobe {mname} {wname}")
    peak = torch.cuda.max_memory_allocated()
    row = dict(model=mname, wl=wname, seqs=len(reqs), needed=needed, scored=sum(r.num_scored for r in reqs),
               sec=sec, tps=needed / sec, peak=(peak - weights) / GiB, mfu=fl / sec / (tflops * 1e12),
               mfu_unique=unique_flops(lc, reqs) / sec / (tflops * 1e12))
    return row, torch.cat([r.logprobs for r in res])



def rl_groups(groups: int, samples: int, prompt: int, response: int, vocab: int, seed: int = 0) -> list[ScoreRequest]:
    """RL groups for the prefix cache: ``groups`` prompts of [prompt/2, prompt] ids, each followed by
    ``samples`` responses of [response/4, response] ids (scored), group by group."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    reqs = []
    for _ in range(groups):
        p = tok(rng.randint(prompt // 2, prompt))
        for _ in range(samples):
            reqs.append(ScoreRequest(p + tok(rng.randint(max(1, response // 4), response)), len(p)))
    return reqs


def pass_flops(lc, rows: int, past: int, scored: int) -> float:
    """Forward FLOPs of one sequence's pass over ``rows`` new tokens after ``past`` cached ones
    (Llama shapes: matmuls, causal attention over past + new keys, the head on ``scored`` rows).

    >>> from types import SimpleNamespace as N
    >>> lc = N(hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2, vocab_size=10)
    >>> pass_flops(lc, 3, 0, 3) == flops(lc, [(3, 3)])
    True
    """
    qd, L = lc.num_heads * lc.head_dim, lc.num_layers
    n = past + rows
    return _per_token(lc) * rows + 2 * L * qd * (n * n - past * past) + 2 * lc.hidden_size * lc.vocab_size * scored

# --------------------------------------------------------------------------------------- models


def llama_config(name: str):
    """transformers' ``LlamaConfig`` of ``MODELS[name]``."""
    import transformers as tf

    return tf.LlamaConfig(**MODELS[name], bos_token_id=1, eos_token_id=2, initializer_range=0.02)


def native_from_hf(hf, dtype: torch.dtype, device="cuda"):
    """logprobe's native model (``loading.build_native``, the loader's own builder) of a transformers
    Llama's weights, cast to ``dtype``; returns (model, native config)."""
    # imported here: gpu_tp.py --old-src imports this file over older src trees, which lack it
    from logprobe.loading.hf import native_config
    from logprobe.loading.loader import build_native

    lc, why = native_config(hf.config.to_dict())
    if lc is None:
        raise SystemExit(why)
    with torch.device("meta"):
        names = set(LlamaModel(lc).state_dict().keys())
    tensors = [(k.removeprefix("model."), v.to(dtype)) for k, v in hf.state_dict().items()
               if k.removeprefix("model.") in names]
    return build_native(lc, tensors, torch.device(device), dtype), lc


def build_models(name: str, baseline: bool):
    """Random-init (seed 0) bf16 transformers Llama of ``MODELS[name]`` on CUDA and logprobe's
    native model sharing its weights: (transformers model or None, native model, native config)."""
    import transformers as tf

    cfg = llama_config(name)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = tf.LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    hf.eval()
    ours, lc = native_from_hf(hf, torch.bfloat16)
    return (hf if baseline else None), ours, lc


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


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 codes, float32 scale_inv [ceil(out/b), ceil(in/b)]): absmax / 448 per block."""
    out, k = w.shape
    R, C = -(-out // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, C * block - k, 0, R * block - out))  # [R*b, C*b]
    scale = (padded.view(R, block, C, block).abs().amax(dim=(1, 3)) / 448).clamp_min(1e-12)  # [R, C]
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return (padded / full).to(torch.float8_e4m3fn)[:out, :k].contiguous(), scale


def write_checkpoint(name: str, path: Path, fp8: bool = False) -> None:
    """``MODELS[name]`` as a Hugging Face directory: random bf16 weights (seeded per tensor, made
    on CUDA), config.json and a byte-level tokenizer; ``fp8``: every projection as DeepSeek-style
    FP8 blocks (``fp8_blocks``: codes + ``weight_scale_inv``, ``FP8_CONFIG``), embeddings, head and
    norms in bf16. Nothing is done if ``path`` has a config."""
    from safetensors.torch import save_file

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
    index = {}
    for j, p in enumerate(files):
        fname = f"model-{j:05d}.safetensors"
        save_file(p, str(path / fname))
        index.update({k: fname for k in p})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    if fp8:
        cfg.quantization_config = FP8_CONFIG
    cfg.save_pretrained(str(path))
    byte_tokenizer().save_pretrained(str(path))


def save_model(shape: str, path: str, device: str):
    """The random bf16 Llama of ``SAVED_SHAPES[shape]`` (transformers' init, seed 0) saved to
    ``path`` (``save_pretrained``) with a 258-id byte tokenizer; the transformers model is returned."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = tf.LlamaConfig(**SAVED_SHAPES[shape], bos_token_id=1, eos_token_id=2, initializer_range=0.02,
                         torch_dtype="bfloat16", max_position_embeddings=8192)  # W1 rows reach 6,144 ids
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.BPE(vocab={chr(i): i for i in range(256)} | {"<s>": 256, "</s>": 257}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return model.eval()


# ------------------------------------------------------------------------------------- baseline


def run_transformers(hf, reqs, budget, dev="cuda", use_cache: bool = True):
    """The transformers baseline: right-padded batches (sorted by length) of at most ``budget``
    padded tokens; logits -> float32 log_softmax -> gather. Returns per-request logprobs (float32,
    on the CPU). ``use_cache=False``: no KV cache is built (bench/gpu_moe.py's baseline)."""
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


# --- the hybrid Qwen benchmarks' shared parts (gpu_hybrid.py, gpu_hybrid_fp8.py) ---

WEIGHT_LIMIT = 30 * GiB  # bf16 weights per model: logprobe's and transformers' runs each fit one H100 with room
T0 = time.perf_counter()


def progress(msg: str) -> None:
    log(f"[{time.perf_counter() - T0:6.1f} s] {msg}")


def one_line(e: BaseException, n: int = 400) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:n]}"


def hf_config(name: str, tiny: bool, layers: int | None):
    import transformers as tf

    cls, kw = HYBRID_MODELS[name]
    kw = dict(kw, **(HYBRID_TINY[name] if tiny else {}))
    if layers:
        kw["num_hidden_layers"] = layers
    return cls, getattr(tf, cls)(**kw)


def param_bytes(name: str, tiny: bool, layers: int, element: int) -> int:
    from transformers import AutoModelForCausalLM

    _, cfg = hf_config(name, tiny, layers)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in m.parameters()) * element


def pick_layers(args, name: str, element: int) -> tuple[int, str]:
    """(layers, label): ``--layers``, else all of them if the weights fit ``WEIGHT_LIMIT``, else
    the largest multiple of 4 that does."""
    _, cfg = hf_config(name, args.tiny, None)
    full = cfg.num_hidden_layers
    if args.layers:
        return args.layers, f"{args.layers} of {full} layers (--layers)"
    if args.tiny:
        return full, f"all {full} layers"
    total = param_bytes(name, False, full, element)
    if total <= WEIGHT_LIMIT:
        return full, f"all {full} layers ({total / GiB:.1f} GiB of weights)"
    four, eight = param_bytes(name, False, 4, element), param_bytes(name, False, 8, element)
    block, base = eight - four, 2 * four - eight  # per 4 layers; embeddings, head, final norm
    n = max(1, (WEIGHT_LIMIT - base) // block)
    return int(4 * n), (f"**{4 * n} of {full} layers**: the nearest that fits one GPU twice over time "
                        f"({(base + n * block) / GiB:.1f} GiB of weights; all {full}: {total / GiB:.1f} GiB)")


def write_hybrid_checkpoint(cfg, path: Path, dev, dtype) -> str:
    """transformers' model of ``cfg`` (its own init, seed 0, made on ``dev``) saved with
    ``save_pretrained`` plus a byte tokenizer; kept when ``path`` already holds the same config."""
    from transformers import AutoModelForCausalLM

    stamp = json.dumps(cfg.to_dict(), sort_keys=True, default=str) + str(dtype)
    marker = path / "WRITTEN_BY_GPU_HYBRID"
    if marker.exists() and marker.read_text() == stamp:
        return "reused"
    if path.exists():
        shutil.rmtree(path)
    t = time.perf_counter()
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    finally:
        torch.set_default_dtype(old)
    made = time.perf_counter() - t
    hf.save_pretrained(str(path))
    byte_tokenizer().save_pretrained(str(path))
    del hf
    free()
    marker.write_text(stamp)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return f"written: {size / GiB:.1f} GiB ({made:.1f} s to make, {time.perf_counter() - t - made:.1f} s to save)"


def make_room(root: Path, keep: Path, need: int) -> None:
    """Remove this script's other checkpoints under ``root`` while the disk has less than ``need`` free."""
    root.mkdir(parents=True, exist_ok=True)
    for d in sorted(root.iterdir()):
        if shutil.disk_usage(root).free >= need:
            return
        if d != keep and (d / "WRITTEN_BY_GPU_HYBRID").exists():
            progress(f"removing {d} (disk: {shutil.disk_usage(root).free / GiB:.1f} GiB free, {need / GiB:.1f} needed)")
            shutil.rmtree(d)


def mem_base(dev) -> int:
    if dev.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def mem_peak(dev, weights: int) -> float | None:
    return (torch.cuda.max_memory_allocated() - weights) / GiB if dev.type == "cuda" else None


def timed(args, dev, weights: int, fn, passes: int, label: str):
    """``fn()`` timed ``passes`` times (synchronised; each pass logged; a pass after the first is
    skipped once the run is past ``--time-limit``): (last result, best seconds, peak GiB above
    ``weights`` over the passes, every pass's seconds)."""
    mem_base(dev)
    secs = []
    for i in range(max(1, passes)):
        if i and time.perf_counter() - T0 > args.time_limit:
            progress(f"{label}: pass {i + 1} of {passes} skipped (past --time-limit {args.time_limit:.0f} s)")
            break
        out, sec = sync_time(fn)
        secs.append(sec)
        if passes > 1:
            progress(f"{label} pass {i + 1}: {sec:.2f} s")
    return out, min(secs), mem_peak(dev, weights), secs


def as_sequences(reqs) -> list[dict]:
    return [{"prompt_token_ids": r.tokens[:r.score_begin], "completion_token_ids": r.tokens[r.score_begin:]}
            for r in reqs]


def delta(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    d = torch.cat([(x.double() - y.double()).abs() for x, y in zip(a, b)])
    return float(d.max()), float(d.mean())


def step(rows: dict, key, label: str, fn) -> None:
    """Run one row; a failure is recorded in the row and printed, the rest goes on."""
    t = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report, don't stop the benchmark
        rows.setdefault(key, {})["error"] = one_line(e)
        progress(f"{label} failed after {time.perf_counter() - t:.1f} s: {one_line(e, 1200)}")
        log("```\n" + "".join(traceback.format_exc().splitlines(keepends=True)[-8:]) + "```")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
