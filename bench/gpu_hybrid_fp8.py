"""FP8 block checkpoints of the Qwen3.5 hybrids on one GPU: speed and memory of the FP8 model
(weights kept FP8, float activations) against the bf16 checkpoint it was made from, on a workload.

The bf16 checkpoint is ``bench/gpu_hybrid.py``'s (same shapes, same writer, shared ``--dir``). The
FP8 one is written from it the way Qwen's FP8 releases are laid out: every matrix of attention
(q/k/v/o), of the Gated DeltaNet (``in_proj_qkv``, ``in_proj_z``, ``out_proj``), the MLP, the
experts and the shared expert as float8_e4m3fn codes with ``weight_scale_inv`` per 128 x 128
block (scale = block absmax / 448); ``in_proj_b`` / ``in_proj_a``, routers, the shared-expert gate,
``lm_head``, embeddings, norms, conv1d, A_log and dt_bias float (``modules_to_not_convert`` as Qwen
writes it).

Rows, all on the same token ids (``--workload``, W1 by default):
  1  logprobe on the bf16 checkpoint (the speed reference: other weights, so no Δ)
  2  logprobe on the FP8 checkpoint, default (FP8 in memory, expanded per layer inside each matmul)
  3  the same in deterministic mode
  4  the FP8 checkpoint with ``weights="dense"`` (expanded to bf16 once at load): the same weights
     as row 2, so max |Δ| against row 2 is the expansion's (same bf16 bits; products grouped alike
     or not)
Per row: seconds, tokens/s, GiB the loaded weights take, peak GiB above them, max / mean |Δ| to row 2.

    # one H100 (~6-8 minutes: writing the 9B bf16 and FP8 checkpoints is most of it the first time)
    python bench/gpu_hybrid_fp8.py --models qwen35-9b
    python bench/gpu_hybrid_fp8.py --models qwen35-35b-a3b --layers 8 --requests 64
    # CPU smoke test (tiny configs in float32, 4 requests, blocks of 32)
    python bench/gpu_hybrid_fp8.py --tiny --requests 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402  (the hybrid benchmarks' shared parts)
    HYBRID_MODELS,
    GiB,
    as_sequences,
    byte_tokenizer,
    delta,
    free,
    hf_config,
    log,
    mem_base,
    one_line,
    pick_layers,
    progress,
    step,
    timed,
    workload,
    write_hybrid_checkpoint,
)

from logprobe import Scorer  # noqa: E402
from logprobe.loading import load_model  # noqa: E402
from logprobe.loading.fp8_block import kept_float  # noqa: E402

NOT_CONVERT = ["lm_head", "mlp.gate", "shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b"]
FLOAT = ("embed_tokens", "norm", "conv1d", "A_log", "dt_bias")
ROWS = {1: "logprobe, bf16 checkpoint", 2: "logprobe, FP8 checkpoint", 3: "FP8, deterministic",
        4: "FP8, weights=dense"}


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 codes [out, in], float32 scale_inv [ceil(out/b), ceil(in/b)])."""
    out, k = w.shape
    R, C = -(-out // block), -(-k // block)
    padded = F.pad(w.float(), (0, C * block - k, 0, R * block - out))  # [R b, C b]
    scale = (padded.view(R, block, C, block).abs().amax(dim=(1, 3)) / 448).clamp_min(1e-12)  # [R, C]
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return (padded / full).to(torch.float8_e4m3fn)[:out, :k].contiguous(), scale


def write_fp8(src: Path, dst: Path, block: int, dev) -> str:
    """``src``'s safetensors rewritten as an FP8 block checkpoint (kept while ``src`` is unchanged)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    stamp = (src / "WRITTEN_BY_GPU_HYBRID").read_text() + f"fp8 {block}"
    marker = dst / "WRITTEN_BY_GPU_HYBRID_FP8"
    if marker.exists() and marker.read_text() == stamp:
        return "reused"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    weight_map, n = {}, 0
    for f in sorted(src.glob("*.safetensors")):
        out = {}
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                w, module = st.get_tensor(key), key.removesuffix(".weight")
                if (key.endswith(".weight") and w.dim() == 2 and not any(x in key for x in FLOAT)
                        and not kept_float(module, tuple(NOT_CONVERT))):
                    codes, scale = quantize_blocks(w.to(dev), block)
                    out[key], out[module + ".weight_scale_inv"] = codes.cpu(), scale.cpu()
                    n += 1
                else:
                    out[key] = w
        save_file(out, str(dst / f.name))
        weight_map.update({k: f.name for k in out})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block], "modules_to_not_convert": NOT_CONVERT}
    (dst / "config.json").write_text(json.dumps(cfg))
    byte_tokenizer().save_pretrained(str(dst))
    marker.write_text(stamp)
    size = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    return f"written: {n} FP8 matrices, {size / GiB:.1f} GiB"


def run_row(args, rows, key, dev, dtype: str, seqs, path: Path, weights: str, deterministic: bool):
    """Load ``path``, warm up, time ``--passes``; record seconds, weights and peak GiB, log-probs."""
    def go():
        base = mem_base(dev)
        loaded = load_model(str(path), str(dev), dtype, weights=weights)
        scorer = Scorer(loaded, progress=False, deterministic=deterministic)
        held = (torch.cuda.memory_allocated() - base) if dev.type == "cuda" else 0
        scorer.logprobs(seqs[:args.warmup])
        res, sec, peak, _ = timed(args, dev, torch.cuda.memory_allocated() if dev.type == "cuda" else 0,
                                  lambda: scorer.logprobs(seqs), args.passes, ROWS[key])
        rows[key] = dict(sec=sec, weights=held / GiB, peak=peak, lp=[r.logprobs.float().cpu() for r in res])
        progress(f"row {key} {ROWS[key]}: {sec:.2f} s")
    try:
        step(rows, key, ROWS[key], go)
    finally:
        free()


def report(name: str, reqs, rows: dict) -> None:
    tokens = sum(len(r.tokens) for r in reqs)
    log(f"\n| {name} | s | tokens/s | weights GiB | peak above GiB | max / mean abs Δ vs row 2 |")
    log("| --- | --- | --- | --- | --- | --- |")
    for key, label in ROWS.items():
        r = rows.get(key)
        if r is None:
            continue
        if "error" in r:
            log(f"| {key} {label} | failed: {r['error']} | | | | |")
            continue
        d = "" if key == 1 or "lp" not in rows.get(2, {}) else "{:.2e} / {:.2e}".format(*delta(r["lp"], rows[2]["lp"]))
        peak = "" if r["peak"] is None else f"{r['peak']:.2f}"
        log(f"| {key} {label} | {r['sec']:.2f} | {tokens / r['sec']:.0f} | {r['weights']:.2f} | {peak} | {d} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen35-9b", help=f"of {', '.join(HYBRID_MODELS)}")
    ap.add_argument("--rows", default="1,2,3,4", help="; ".join(f"{k}: {v}" for k, v in ROWS.items()))
    ap.add_argument("--workload", default="W1", choices=("W1", "W2", "W3"))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: as bench/gpu_hybrid.py)")
    ap.add_argument("--requests", type=int, default=0, help="the first N requests only (0: all)")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=480)
    ap.add_argument("--block", type=int, default=0, help="FP8 block (default 128; 32 with --tiny)")
    ap.add_argument("--dir", default="/tmp/logprobe-bench-hybrid")
    ap.add_argument("--tiny", action="store_true", help="tiny configs in float32 on the CPU (a smoke test)")
    args = ap.parse_args()
    args.rows = sorted({int(r) for r in args.rows.split(",")})
    dev = torch.device("cpu" if args.tiny else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for a CPU run)")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    block = args.block or (32 if args.tiny else 128)
    root = Path(args.dir)
    for name in args.models.split(","):
        rows: dict = {}
        try:
            layers, label = pick_layers(args, name, dtype.itemsize)
            _, cfg = hf_config(name, args.tiny, layers)
            log(f"\n# {name}: {label}{' (tiny)' if args.tiny else ''}, FP8 blocks {block} x {block}")
            dname = str(dtype).removeprefix("torch.")
            path = root / f"{name}{'-tiny' if args.tiny else ''}-{layers}L-{dname}"
            progress(f"bf16 checkpoint {path}: {write_hybrid_checkpoint(cfg, path, dev, dtype)}")
            fp8 = path.with_name(path.name + f"-fp8-{block}")
            progress(f"FP8 checkpoint {fp8}: {write_fp8(path, fp8, block, dev)}")
            reqs = workload(args.workload, cfg.vocab_size)[:args.requests or None]
            seqs = as_sequences(reqs)
            how = {1: (path, "packed", False), 2: (fp8, "packed", False), 3: (fp8, "packed", True),
                   4: (fp8, "dense", False)}
            for key in args.rows:
                run_row(args, rows, key, dev, dname, seqs, *how[key])
            report(name, reqs, rows)
        except Exception as e:  # noqa: BLE001 - report, go on with the next model
            progress(f"**{name} failed**: {one_line(e, 1200)}")
        finally:
            free()
    progress("done")


if __name__ == "__main__":
    main()
