"""How fast does logprobe score the RL-group workload (W1) on a Gemma-3-4B shape, a gpt-oss-20b
shape (MXFP4 experts, and their bf16 twin), a GLM-4-9B shape, a Phi-4-mini shape and a Gemma 4 E4B
shape, against transformers on the same weights, in the same run?

Shapes (random init, bf16; written once under ``--dir`` and reused while the config is the same):
  gemma3-4b     Gemma-3-4B's text config (``Gemma3ForCausalLM``, ``gemma3_text``): 34 layers, 5 sliding
                (window 1024) : 1 full, head_dim 256, vocabulary 262,208; transformers' own init,
                ``save_pretrained``
  gpt-oss-20b   gpt-oss-20b's config (``gpt_oss``): 24 layers alternating sliding (window 128) / full,
                sinks, YaRN, 32 experts top-4 with MXFP4 weights written as the hub lays them out
                (random blocks, scales 119-121: weights of about transformers' init size; the rest
                bf16 normal(0, 0.02), sinks normal(0, 1)), about 13 GiB on disk. Its bf16 twin is
                the same checkpoint loaded with ``weights="dense"`` (every MXFP4 value is exact in
                bf16): the same numbers, expanded once at load.
  glm4-9b       GLM-4-9B-0414's config (``glm4``, ``Glm4ForCausalLM``; ``Glm4Config``'s defaults):
                40 layers, 32 heads / 2 kv heads of 128, q/k/v biases, partial rotary 0.5,
                intermediate 13,696, vocabulary 151,552, untied head. Default cut: 8 of 40 layers
  phi4-mini     Phi-4-mini-instruct's shape (``phi3``, ``Phi3ForCausalLM``): 32 layers, 24 heads /
                8 kv heads of 128, partial rotary 0.75, intermediate 8,192, vocabulary 200,064, tied
                embeddings; plain rope (no LongRoPE, which refuses positions past 4,096). Default cut:
                16 of 32 layers
  gemma4-e4b    a Gemma 4 E4B-like text shape (``gemma4_text``, ``Gemma4ForCausalLM``): 42 layers, 5
                sliding (window 512) : 1 full (``Gemma4TextConfig``'s pattern), 8 heads / 2 kv heads,
                head_dim 256 (512 on full layers), per-layer embeddings of 256, the last 18 layers
                KV-shared, softcap 30, intermediate 10,240, vocabulary 262,144 (E4B's published sizes as
                recalled, not read from the hub; the rest ``Gemma4TextConfig``'s defaults). Dense: MoE
                blocks are not in the native model. Default cut: 12 of 42 layers, 5 of them KV-shared

A cut keeps the first N layers (``--layers N`` or ``all``; Gemma 4 keeps its share of KV-shared
layers) and is named in each table's title ("8 of 40 layers").

Rows per model, on the same W1 token ids (32 prompts x 8 completions, bench/common.py):
  logprobe, default          ``Scorer(dir, device="cuda")`` (gpt-oss: MXFP4 kept packed; the twin: dense bf16)
  logprobe, deterministic    the same scorer with ``EngineConfig(deterministic=True)``
  transformers               padded batches sorted by length (``common.run_transformers``, ``--budget``
                             padded tokens), its default attention / experts implementations; gpt-oss:
                             ``GptOssForCausalLM`` in bf16 with the experts set to transformers' own
                             dequantization of the checkpoint's blocks (``convert_moe_packed_tensors``),
                             i.e. the numbers of the twin. ``--hf-requests N``: the first N requests
                             only, the whole time extrapolated by needed tokens (marked ~); the
                             default is 64 (all 256 for gemma3-4b)

Printed per row: seconds (best of ``--passes`` after a warm-up), tokens/s (needed input tokens),
speed-up against transformers, peak GPU memory above the weights, max / mean |Δ log-prob| against
transformers on the requests both ran; then deterministic / default and MXFP4 / bf16 time ratios.
One model's weights are on the GPU at a time (freed in between).

    # one H100: both models (estimate: 9-12 minutes; split them over two commands for the 10-minute limit)
    python bench/gpu_families.py --models gemma3-4b
    python bench/gpu_families.py --models gpt-oss-20b --hf-requests 64
    # one H100: the three cut shapes (estimate: 40-50 s each, about 2.5 minutes with the checkpoints)
    python bench/gpu_families.py --models glm4-9b,phi4-mini,gemma4-e4b
    # one H100: the Gemma 4 shape in float32 on both sides (|delta| of a correct path ~1e-5; ~2 minutes)
    python bench/gpu_families.py --models gemma4-e4b --dtype float32 --hf-requests 16
    # CPU smoke test (tiny configs in float32, the first 2 W1 requests; seconds)
    python bench/gpu_families.py --tiny --requests 2
    python bench/gpu_families.py --tiny --requests 2 --models glm4-9b,phi4-mini,gemma4-e4b
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    FAMILY_LAYERS,
    FAMILY_SHAPES,
    family_config,
    free,
    mem_base,
    run_transformers,
    sync_time,
    workload,
    write_gpt_oss,
    write_hf,
)

from logprobe import Scorer  # noqa: E402
from logprobe.loading import load_model  # noqa: E402

GiB = 1024**3
# transformers on the first N requests by default (``--hf-requests`` overrides), the whole extrapolated.
DEFAULT_HF_REQUESTS = {"gpt-oss-20b": 64, "glm4-9b": 64, "phi4-mini": 64, "gemma4-e4b": 64}
T0 = time.perf_counter()


def log(*a):
    print(*a, flush=True)


def progress(msg: str) -> None:
    log(f"[{time.perf_counter() - T0:6.1f} s] {msg}")


def one_line(e: BaseException, n: int = 400) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:n]}"


def gpt_oss_transformers(cfg, path: Path, dev, dtype):
    """transformers' ``GptOssForCausalLM`` (bf16) holding the checkpoint, experts dequantized by
    transformers' own ``convert_moe_packed_tensors``."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    with torch.device(dev):  # initialised, then overwritten: every buffer (rotary tables) made for real
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    params = dict(hf.named_parameters())
    blocks = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device=str(dev)) as st:
            for k in st.keys():
                if k.endswith(("_blocks", "_scales")):
                    blocks[k] = st.get_tensor(k)
                else:
                    params[k].data.copy_(st.get_tensor(k))
    for k in [k for k in blocks if k.endswith("_blocks")]:
        name = k.removesuffix("_blocks")
        params[name].data.copy_(convert_moe_packed_tensors(blocks.pop(k), blocks.pop(name + "_scales"), dtype=dtype))
    return hf


# ------------------------------------------------------------------------------------ timing


def peak_since(dev, base: int) -> float | None:
    return (torch.cuda.max_memory_allocated() - base) / GiB if dev.type == "cuda" else None


def as_sequences(reqs) -> list[dict]:
    return [{"prompt_token_ids": r.tokens[:r.score_begin], "completion_token_ids": r.tokens[r.score_begin:]}
            for r in reqs]


def best(args, fn, label: str):
    """(last result, best seconds) of ``--passes`` timed calls."""
    secs, out = [], None
    for _ in range(max(1, args.passes)):
        out, sec = sync_time(fn)
        secs.append(sec)
    progress(f"{label}: " + ", ".join(f"{s:.2f}" for s in secs) + " s")
    return out, min(secs)


def logprobe_rows(args, label: str, loaded, reqs, dev, rows: dict) -> None:
    seqs = as_sequences(reqs)
    scorer = Scorer(loaded, progress=False)
    weights = mem_base(dev)  # what the model holds
    for mode in ("default", "deterministic"):
        key = f"{label}, {mode}"
        try:
            scorer.config = replace(scorer.config, deterministic=mode == "deterministic")
            sync_time(lambda: scorer.logprobs(seqs[:args.warmup]))
            mem_base(dev)
            res, sec = best(args, lambda: scorer.logprobs(seqs), key)
            rows[key] = dict(sec=sec, n=len(seqs), lp=[r.logprobs.float().cpu() for r in res],
                             peak=peak_since(dev, weights))
        except Exception as e:  # noqa: BLE001 - report, go on
            rows[key] = dict(error=one_line(e))
            progress(f"{key} failed: {one_line(e, 1200)}")
            log("```\n" + "".join(traceback.format_exc().splitlines(keepends=True)[-8:]) + "```")


def transformers_row(args, hf, reqs, dev, rows: dict, hf_requests: int) -> None:
    n = hf_requests if 0 < hf_requests < len(reqs) else len(reqs)
    try:
        with torch.inference_mode():
            sync_time(lambda: run_transformers(hf, reqs[:2], args.budget, str(dev), use_cache=False))
            base = mem_base(dev)
            res, sec = best(args, lambda: run_transformers(hf, reqs[:n], args.budget, str(dev), use_cache=False),
                            "transformers")
        frac = sum(q.num_inputs for q in reqs[:n]) / sum(q.num_inputs for q in reqs)
        rows["transformers"] = dict(sec=sec, n=n, lp=res, peak=peak_since(dev, base), whole=sec / frac,
                                    est=n < len(reqs))
    except Exception as e:  # noqa: BLE001
        rows["transformers"] = dict(error=one_line(e))
        progress(f"transformers failed: {one_line(e, 1200)}")


def report(name: str, reqs, rows: dict) -> None:
    needed = sum(r.num_inputs for r in reqs)
    log(f"\n## {name}, W1: {len(reqs)} requests, {needed:,} needed tokens")
    hf = rows.get("transformers", {})
    base = hf.get("whole")
    log("| row | s | tok/s | × vs transformers | peak extra GiB | max abs Δ vs transformers | mean abs Δ |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key, r in rows.items():
        if "sec" not in r:
            log(f"| {key} | {r.get('error', 'not run')} | | | | | |")
            continue
        whole = r.get("whole", r["sec"])
        est = "~" if r.get("est") else ""
        s = f"{r['sec']:.2f}" + (f" ({r['n']} requests; whole ~{whole:.1f})" if r.get("est") else "")
        vs = f"{est}{base / whole:.2f}×" if base else "—"
        peak = f"{r['peak']:.1f}" if r.get("peak") is not None else "—"
        d = "| — | —"
        if key != "transformers" and "lp" in hf:
            diff = torch.cat([(a.double() - b.double()).abs() for a, b in zip(r["lp"][:hf["n"]], hf["lp"])])
            d = f"| {diff.max():.2e} | {diff.mean():.2e}"
        log(f"| {key} | {s} | {needed / whole:,.0f} | {vs} | {peak} {d} |")
    for a, b, what in [(f"{v}, deterministic", f"{v}, default", f"{v}: deterministic / default")
                       for v in ("logprobe", "logprobe MXFP4", "logprobe bf16 twin")] + \
                      [("logprobe MXFP4, default", "logprobe bf16 twin, default", "MXFP4 / bf16 twin, default")]:
        if "sec" in rows.get(a, {}) and "sec" in rows.get(b, {}):
            log(f"{what} time: {rows[a]['sec'] / rows[b]['sec']:.3f}")


# -------------------------------------------------------------------------------------- main


def run_model(args, name: str, dev, dtype) -> None:
    cfg, cut = family_config(name, args.tiny, args.layers)
    path = Path(args.dir) / f"{name}{'-tiny' if args.tiny else ''}-{str(dtype).removeprefix('torch.')}"
    writer = write_gpt_oss if name == "gpt-oss-20b" else write_hf
    progress(f"{name}: checkpoint {path}: {writer(cfg, path, dev, dtype)}")
    reqs = workload("W1", cfg.vocab_size)[:args.requests or None]
    rows: dict = {}
    kinds = [("logprobe", "packed")] if name != "gpt-oss-20b" else [("logprobe MXFP4", "packed"),
                                                                  ("logprobe bf16 twin", "dense")]
    for label, weights in kinds:
        t = time.perf_counter()
        loaded = load_model(str(path), str(dev), dtype, weights=weights)
        progress(f"{label}: loaded in {time.perf_counter() - t:.1f} s ({type(loaded.model).__name__}, backend "
                 f"{loaded.info.backend})")
        logprobe_rows(args, label, loaded, reqs, dev, rows)
        loaded = None
        free()
    t = time.perf_counter()
    if name != "gpt-oss-20b":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(dev).eval()
    else:
        hf = gpt_oss_transformers(cfg, path, dev, dtype)
    progress(f"transformers {type(hf).__name__} ready in {time.perf_counter() - t:.1f} s (attention "
             f"{hf.config._attn_implementation}, experts {getattr(hf.config, '_experts_implementation', '-')})")
    hf_requests = DEFAULT_HF_REQUESTS.get(name, 0) if args.hf_requests is None else args.hf_requests
    transformers_row(args, hf, reqs, dev, rows, hf_requests)
    hf = None
    free()
    report(f"{name} ({cut})", reqs, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gemma3-4b,gpt-oss-20b", help=f"of {', '.join(FAMILY_SHAPES)}")
    ap.add_argument("--requests", type=int, default=0, help="the first N W1 requests only (0: all 256)")
    ap.add_argument("--hf-requests", type=int, default=None, help="transformers on the first N requests only, its "
                    "whole time extrapolated by needed tokens (0: all; default 64, all for gemma3-4b)")
    ap.add_argument("--layers", default="", help="the first N layers of every model, or 'all' (default: "
                    + ", ".join(f"{k} {v}" for k, v in FAMILY_LAYERS.items()) + ", the others all)")
    ap.add_argument("--passes", type=int, default=1, help="timed passes per row after the warm-up (best kept)")
    ap.add_argument("--warmup", type=int, default=8, help="requests of each logprobe row's warm-up")
    ap.add_argument("--budget", type=int, default=8192, help="transformers' padded tokens per batch")
    ap.add_argument("--dir", default="/tmp/logprobe-bench-families", help="where checkpoints are written (reused)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs in float32 on the CPU (a smoke test)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="weights and compute of both "
                    "logprobe and transformers (default bfloat16 on the GPU, float32 with --tiny); float32 reads "
                    "the |delta| where rounding noise is ~1e-5")
    args = ap.parse_args()
    names = args.models.split(",")
    if not set(names) <= set(FAMILY_SHAPES):
        sys.exit(f"--models: of {', '.join(FAMILY_SHAPES)}")
    dev = torch.device("cpu" if args.tiny else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for a CPU run)")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if args.tiny else torch.bfloat16
    import transformers

    where = torch.cuda.get_device_name(0) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    log(f"device: {where}; torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{str(dtype).removeprefix('torch.')}, random init")
    for name in names:
        try:
            run_model(args, name, dev, dtype)
        except Exception as e:  # noqa: BLE001
            progress(f"**{name} failed**: {one_line(e, 1200)}")
            log("```\n" + "".join(traceback.format_exc().splitlines(keepends=True)[-10:]) + "```")
        finally:
            free()
    progress("done")


if __name__ == "__main__":
    main()
