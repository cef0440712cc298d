"""8-bit activation-quantized models on the GPU (issue 22): the kernels of ``kernels/act_quant.py``
alone, then llama-8b quantized with each scheme against the same model in bf16, in one run.

1. GEMMs at llama-8b shapes (M = 8,192 rows) against bf16 and cuBLAS FP8: bench/gpu_act_quant_gemm.py,
   run as a child process.
2. Workload W1 of bench/common.py (RL groups, 450k tokens) through ``Engine`` at the default
   ``max_batch_tokens``: the bf16 model, then the same weights quantized (round to nearest, scales
   from each row's / block's absmax) as FP8_DYNAMIC (per-channel weights, per-token activations),
   FP8_BLOCK (128x128 weights, 1x128 activation groups) and INT8 W8A8, with ``ActQuantLinear.kernels``
   on; default and deterministic mode; weight memory; per-token max/mean |Δ| of the kernels against
   the float32 reference path of the same quantized model on a slice (first 8 requests).

3. ``--sections disk``: the user's path. The bf16 model is written as a Hugging Face directory, an
   FP8_DYNAMIC checkpoint is made from it by compressed-tensors' own API (``tests/quant_helpers``:
   ``apply_quantization_config``, min/max scales, ``ModelCompressor``), and both are read from disk
   by ``Scorer(path, device="cuda")`` and timed on W1 at the defaults (two passes, best kept).

    python bench/gpu_act_quant.py                         # sections gemm and model
    python bench/gpu_act_quant.py --sections gemm         # the kernels alone
    PYTHONPATH=src:tests python bench/gpu_act_quant.py --sections disk
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GiB, build_models, decoder_linears, log, workload, write_checkpoint  # noqa: E402

import logprobe.kernels.act_quant as kact  # noqa: E402
from logprobe.config import EngineConfig  # noqa: E402
from logprobe.engine.runner import Engine  # noqa: E402
from logprobe.kernels.act_quant import (  # noqa: E402
    quantize_rows_reference,
)
from logprobe.layers.act_quant_linear import ActQuantLinear  # noqa: E402

SCHEMES = {"FP8_DYNAMIC": ("float", None, None), "FP8_BLOCK": ("float", 128, 128), "W8A8": ("int", None, None),
           "NVFP4": ("fp4", None, None)}
NVFP4_SLICE = 32  # NVFP4 runs its float32 emulation: timed on the first W1 requests only (labelled)


def gemm_section() -> None:
    """bench/gpu_act_quant_gemm.py in a child process (its output goes straight to this one's)."""
    sys.stdout.flush()
    if subprocess.run([sys.executable, str(Path(__file__).with_name("gpu_act_quant_gemm.py"))]).returncode:
        raise SystemExit("bench/gpu_act_quant_gemm.py failed (its output is above)")


def quantize_model(model, scheme: str) -> int:
    """Replace every decoder projection by an ``ActQuantLinear`` of its weights (RTN); returns bytes."""
    kind, wblock, agroup = SCHEMES[scheme]
    total = 0
    for parent, name in decoder_linears(model):
        m = getattr(parent, name)
        w = m.weight.float()  # [N, K]
        N, K = w.shape
        if wblock:  # 128x128 blocks: absmax over each block, one row of scales per weight row
            blocks = w.view(N // wblock, wblock, K // wblock, wblock).abs().amax(dim=(1, 3))
            half = 448.0 if kind == "float" else 127.5
            scale = (blocks / half).repeat_interleave(wblock, 0)  # [N, K / 128]
            codes = (w.view(N, K // wblock, wblock) / scale[..., None]).clamp(-448, 448).view(N, K)
            codes = codes.to(torch.float8_e4m3fn)
        elif kind == "fp4":
            q = nvfp4_linear(w, m.bias)
            total += q.weight_packed.numel() + q.weight_scale.numel()
            setattr(parent, name, q)
            continue
        else:
            codes, scale = quantize_rows_reference(w, kind, None)
        q = ActQuantLinear(codes, scale, wblock or K, kind, act_group=agroup, bias=m.bias)
        total += codes.numel() + scale.numel() * 4
        setattr(parent, name, q)
        del w
    torch.cuda.empty_cache()
    return total


def nvfp4_linear(w: torch.Tensor, bias):
    """An ``FP4Linear`` (NVFP4: FP4 weights and activations) of w [N, K] by round to nearest, scales as
    compressed-tensors makes them: a global scale 448 * 6 / absmax, FP8 group scales of 16 columns;
    the input's global scale from the same rule with absmax 8 (random-init activations stay below)."""
    from logprobe.layers.fp4_linear import E2M1, FP4Linear, round_to_fp4

    N, K = w.shape
    gs = (448.0 * 6.0) / w.abs().amax()
    groups = w.view(N, K // 16, 16)  # [N, G, 16]
    scale = torch.clamp(gs * groups.abs().amax(-1) / 6.0, max=448.0).to(torch.float8_e4m3fn)  # [N, G]
    v = round_to_fp4(torch.clamp(groups / (scale.float() / gs)[..., None], -6.0, 6.0)).view(N, K)
    mag = torch.bucketize(v.abs(), torch.tensor(E2M1, device=w.device))  # exact table values -> index
    nib = (mag | ((v < 0).to(torch.int64) << 3)).to(torch.uint8).view(N, K // 2, 2)
    packed = nib[..., 0] | (nib[..., 1] << 4)  # low nibble = even column
    return FP4Linear(packed, scale, gs.reshape(1), torch.tensor([448.0 * 6.0 / 8.0], device=w.device), bias)


def run(model, reqs, det: bool, warm: int = 32):
    engine = Engine(model, EngineConfig(deterministic=det, progress=False), torch.device("cuda"))
    with torch.inference_mode():
        engine.run(reqs[:warm])  # warm-up: kernels compiled for this mode
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.run(reqs)
        torch.cuda.synchronize()
    return time.perf_counter() - t, torch.cat([r.logprobs for r in out])


def nvfp4_row(model, reqs, nbytes: int) -> None:
    """NVFP4's emulation (float32 product of the dequantized weight and fake-quantized input) is slow:
    it and bf16 on the first ``NVFP4_SLICE`` W1 requests, and its batch invariance in deterministic mode."""
    sl = reqs[:NVFP4_SLICE]
    t = {det: run(model, sl, det, warm=2)[0] for det in (False, True)}
    log(f"| NVFP4 (emulated; first {NVFP4_SLICE} requests, {sum(len(r.tokens) for r in sl):,} tokens) | "
        f"{nbytes / GiB:.1f} (linears) | {t[False]:.2f} | {t[True]:.2f} | see below | {t[True] / t[False]:.2f} | — | — |")


def fast_accum_row(model, reqs, bf16_s: float, promoted) -> None:
    """FP8_DYNAMIC in default mode with ``ActQuantConfig(fast_accum=True)`` (not the library's
    default; labelled): time, and per-token |Δ| against the promoted sums on the first 8 requests."""
    saved = kact.DEFAULT_CONFIG
    kact.DEFAULT_CONFIG = dataclasses.replace(saved, fast_accum=True)
    try:
        t = run(model, reqs, False)[0]
        d = (run(model, reqs[:8], False)[1] - promoted).abs()
    finally:
        kact.DEFAULT_CONFIG = saved
    log(f"| FP8_DYNAMIC, **fast_accum=True (not the default)** | | {t:.2f} | | {bf16_s / t:.2f}x | | "
        f"vs promoted sums: {float(d.max()):.3f} / {float(d.mean()):.4f} | |")


def model_section(args) -> None:
    log(f"\n## {args.model} W1, default max_batch_tokens (s; tok/s; x bf16)")
    log("| scheme | weights GiB | default s | det s | bf16 s / scheme s | det / default | "
        "kernels vs reference path on 8 requests: max / mean |Δ| | those 8: reference path s / kernels s |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    _, model, lc = build_models(args.model, False)
    reqs = workload("W1", lc.vocab_size)
    weights = torch.cuda.memory_allocated()
    base = {det: run(model, reqs, det)[0] for det in (False, True)}
    if "NVFP4" in args.schemes:
        log(f"(bf16 on the first {NVFP4_SLICE} requests: {run(model, reqs[:NVFP4_SLICE], False)[0]:.2f} s, for the NVFP4 row)")
    log(f"| bf16 | {weights / GiB:.1f} | {base[False]:.2f} | {base[True]:.2f} | 1 | {base[True] / base[False]:.2f} | — | — |")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    for scheme in args.schemes.split(","):
        _, model, _ = build_models(args.model, False)
        nbytes = quantize_model(model, scheme)
        gc.collect()
        torch.cuda.empty_cache()
        if scheme == "NVFP4":
            nvfp4_row(model, reqs, nbytes)
            del model
            gc.collect()
            torch.cuda.empty_cache()
            continue
        ActQuantLinear.kernels = False
        t_ref, ref = run(model, reqs[:8], False, warm=2)
        ActQuantLinear.kernels = True
        t = {det: run(model, reqs, det)[0] for det in (False, True)}
        t_got, got = run(model, reqs[:8], False)
        d = (got - ref).abs()
        log(f"| {scheme} | {nbytes / GiB:.1f} (linears) | {t[False]:.2f} | {t[True]:.2f} | "
            f"{base[False] / t[False]:.2f}x | {t[True] / t[False]:.2f} | {float(d.max()):.3f} / {float(d.mean()):.4f} | "
            f"{t_ref:.2f} / {t_got:.2f} |")
        if args.fast_accum and scheme == "FP8_DYNAMIC":
            fast_accum_row(model, reqs, base[False], got)
        del model
        gc.collect()
        torch.cuda.empty_cache()


def disk_section(args) -> None:
    """bf16 and FP8_DYNAMIC checkpoints read from disk by ``Scorer``: W1 at the defaults."""
    import shutil

    from logprobe import Scorer

    root = Path("/tmp/logprobe-bench")
    bf16_dir, fp8_dir = root / args.model, root / f"{args.model}-fp8-dynamic"
    write_checkpoint(args.model, bf16_dir)
    if not (fp8_dir / "config.json").exists():
        import transformers as tf
        from quant_helpers import quantize_and_save  # tests/ on PYTHONPATH: compressed-tensors' own API

        t = time.perf_counter()
        model = tf.AutoModelForCausalLM.from_pretrained(str(bf16_dir), dtype=torch.bfloat16).cuda()
        quantize_and_save(model, fp8_dir, "FP8_DYNAMIC")
        for f in bf16_dir.glob("*token*"):
            shutil.copy(f, fp8_dir / f.name)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        log(f"FP8_DYNAMIC checkpoint written in {time.perf_counter() - t:.0f} s")
    log(f"\n## {args.model} W1 read from disk by Scorer(path, device='cuda'), default budget (best of 2 passes)")
    log("| checkpoint | GiB on disk | passes s | bf16 s / this s |")
    log("| --- | ---: | --- | ---: |")
    base = None
    for label, d in (("bf16", bf16_dir), ("FP8_DYNAMIC (compressed-tensors)", fp8_dir)):
        scorer = Scorer(str(d), device="cuda", progress=False)
        reqs = workload("W1", scorer.loaded.model.config.vocab_size)
        passes = []
        with torch.inference_mode():
            for _ in range(2):
                torch.cuda.synchronize()
                t = time.perf_counter()
                scorer.engine.run(reqs)
                torch.cuda.synchronize()
                passes.append(time.perf_counter() - t)
        best = min(passes)
        base = base or best
        size = sum(f.stat().st_size for f in d.glob("*.safetensors")) / GiB
        log(f"| {label} | {size:.1f} | {', '.join(f'{x:.2f}' for x in passes)} | {base / best:.2f}x |")
        del scorer
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="gemm,model")
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--schemes", default="FP8_DYNAMIC,FP8_BLOCK,W8A8,NVFP4")
    ap.add_argument("--fast-accum", action="store_true", help="also FP8_DYNAMIC with ActQuantConfig(fast_accum=True)")
    args = ap.parse_args()
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if "disk" in args.sections:
        disk_section(args)
    if "gemm" in args.sections:
        gemm_section()
    if "model" in args.sections:
        model_section(args)


if __name__ == "__main__":
    main()
