"""DeepSeek-style mixtures of experts on one GPU: logprobe against transformers on the same weights.

Shapes (random init, bf16, transformers' own config classes; the weights are made on the GPU from
one seeded generator per tensor name, so logprobe's model and transformers' hold the same values):
  mla16b    ``deepseek_v3`` with Moonlight-16B-A3B's shape (DeepSeek-V2-Lite's, 64 routed experts
            top-6 + 2 shared, latent attention with kv_lora_rank 512 and no q low-rank path, one
            dense block, 27 blocks): about 16B parameters, 3B active a token
  glm-air   ``glm4_moe`` with GLM-4.5-Air's shape (128 experts top-8 + 1 shared, 96 query heads,
            8 kv heads, partial rotary, qkv bias) cut to the first ``--glm-layers`` blocks
            (default 6: one dense + five MoE, about 26 GiB) so both models fit one H100 in turn

Rows, all on the same token ids of the RL-group workload W1 (bench/common.py: 32 prompts x 8
completions; ``--requests N``: the first N):
  1  logprobe at the defaults (``Engine`` with ``EngineConfig(progress=False)``: default budget)
  2  the same in deterministic mode (``deterministic=True``); time ratio to row 1 (``--passes N``:
     rows 1 and 2 timed N times, alternating, each keeping its fastest pass)
  3  logprobe with FP8 block weights (the bf16 weights quantized to float8_e4m3fn with a float32
     scale per 128 x 128 block, as DeepSeek's checkpoints store them: ``FP8BlockLinear`` /
     ``FP8BlockExperts``, float activations); its |Δ| against row 1 is the quantization's effect,
     not an error. ``--fp8-models`` (default: mla16b only)
  4  transformers on the same weights (right-padded batches sorted by length, ``use_cache=False``,
     logits -> float32 log_softmax -> gather; bench/common.py ``run_transformers``) on the first
     ``--hf-requests`` requests (default 64), and row 1 again on exactly those: the speed-up is
     measured on that subset (the whole-workload transformers time is extrapolated by it, marked ~)

Per row: seconds, tokens/s of needed input tokens, speed-up against transformers, max / mean
|Δ log-prob| against row 1, peak GPU memory above the weights, and for the MLA shape the
active-parameter FLOP floor ratio: FLOPs of the active parameters (attention projections, the
router, shared and top-k routed experts, dense blocks, the head on scored tokens) plus causal
attention (q·k over nope + rope dims, p·v over v dims), on all needed tokens and on unique tokens
(shared prefixes once), over the bf16 8192^3 matmul rate measured in the same run. One model
copy on the GPU at a time: logprobe's bf16, its FP8, then transformers'.

Estimated on one H100 (not yet measured): about 4 minutes for mla16b (rows 1-4), 3 for glm-air
(rows 1, 2, 4), both in one command under 9 minutes:

    python bench/gpu_deepseek.py
    python bench/gpu_deepseek.py --models mla16b --hf-requests 32
    # CPU smoke test: tiny configs in float32, the first 2 W1 requests (about 30 s on 2 busy cores)
    python bench/gpu_deepseek.py --tiny
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GLM45_AIR, fp8_blocks, free, log, matmul_ceiling, run_transformers, sync_time, workload  # noqa: E402

from logprobe.config import EngineConfig  # noqa: E402
from logprobe.engine.runner import Engine  # noqa: E402
from logprobe.layers.fp8_block_linear import FP8BlockExperts, FP8BlockLinear, block_rows  # noqa: E402
from logprobe.loading.deepseek import build_deepseek, deepseek_config, deepseek_param_name  # noqa: E402
from logprobe.loading.hf import stack_experts  # noqa: E402
from logprobe.loading.sigmoid_moe import build_sigmoid_moe, sigmoid_moe_config, sigmoid_moe_param_name  # noqa: E402

GiB = 1024**3
MODELS = {
    "mla16b": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.446, norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True,
        max_position_embeddings=8192, tie_word_embeddings=False)),
    "glm-air": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(GLM45_AIR, max_position_embeddings=8192)),
}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            n_routed_experts=8, num_experts_per_tok=2)
TINY_HEADS = {"mla16b": dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=16),
              "glm-air": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)}
ROWS = {1: "logprobe, default", 2: "logprobe, deterministic", 3: "logprobe, FP8 block weights",
        4: "transformers (same weights)"}
FLOAT32_NAMES = (".mlp.gate.weight", "e_score_correction_bias")  # routers transformers keeps in float32


def hf_config(name: str, args):
    import transformers as tf

    cfg_cls, model_cls, kw = MODELS[name]
    kw = dict(kw, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if args.tiny:
        kw.update(TINY, **TINY_HEADS[name])
    elif name == "glm-air":
        kw["num_hidden_layers"] = args.glm_layers
    return getattr(tf, cfg_cls)(**kw), getattr(tf, model_cls)


def seeded(name: str, shape, dev) -> torch.Tensor:
    """Tensor ``name``'s values, float32 on ``dev``: norms 1, score-correction bias 0, else N(0, 0.02^2)
    from a generator seeded by the crc32 of the name."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=dev)
    if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
        return torch.zeros(shape, device=dev)
    g = torch.Generator(dev).manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g, device=dev) * 0.02


def hf_names(cfg, model_cls) -> dict[str, tuple[int, ...]]:
    """transformers' in-memory state_dict names and shapes (a meta model), rotary tables left out."""
    with torch.device("meta"):
        m = model_cls._from_config(cfg)
    return {k: tuple(v.shape) for k, v in m.state_dict().items() if "rotary" not in k and "inv_freq" not in k}


def to_fp8(name: str, w: torch.Tensor):
    """A projection (2-D ``*_proj.weight``) or a stacked expert matrix -> its FP8 block layer."""
    if w.dim() == 3:  # [E, out, in]
        parts = [fp8_blocks(w[e]) for e in range(w.shape[0])]
        rows = torch.stack([block_rows(s, 128, w.shape[1]) for _, s in parts])  # [E, out, G]
        return FP8BlockExperts(torch.stack([c for c, _ in parts]), rows, 128)
    if w.dim() == 2 and name.endswith("_proj.weight"):
        return FP8BlockLinear.from_blocks(*fp8_blocks(w), 128, 128)
    return w


def build_logprobe(name: str, cfg, model_cls, dev, dtype, fp8: bool):
    raw = cfg.to_dict()
    if name == "mla16b":
        ncfg, param_name, build = deepseek_config(raw), deepseek_param_name, build_deepseek
    else:
        ncfg, param_name, build = sigmoid_moe_config(raw), sigmoid_moe_param_name, build_sigmoid_moe

    def tensors():
        for key, shape in hf_names(cfg, model_cls).items():
            native = param_name(key, ncfg, "bench")
            if native is not None:
                yield native, seeded(key, shape, dev)

    stream = stack_experts(tensors(), ncfg)
    if fp8:
        stream = ((n, to_fp8(n, w)) for n, w in stream)
    return build(ncfg, stream, dev, dtype), ncfg


def build_transformers(cfg, model_cls, dev, dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            hf = model_cls._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        state = hf.state_dict()
        for key, shape in hf_names(cfg, model_cls).items():
            state[key].copy_(seeded(key, shape, dev))
    return hf.eval()


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def active_flops(ncfg, reqs, unique: bool) -> float:
    """Active-parameter matmul FLOPs + causal attention + the head (see the module docstring)."""
    H, L, moe = ncfg.hidden_size, ncfg.num_layers, ncfg.moe
    dense = 3 * H * ncfg.intermediate_size
    experts = 3 * H * moe.intermediate_size * moe.top_k + 3 * H * moe.shared_intermediate_size + H * moe.num_experts
    if hasattr(ncfg, "kv_lora_rank"):  # latent attention
        n, qk, dv = ncfg.num_heads, ncfg.qk_head_dim, ncfg.v_head_dim
        attn = (H * n * qk if ncfg.q_lora_rank is None else H * ncfg.q_lora_rank + ncfg.q_lora_rank * n * qk) \
            + H * (ncfg.kv_lora_rank + ncfg.qk_rope_head_dim) + ncfg.kv_lora_rank * n * (ncfg.qk_nope_head_dim + dv) \
            + n * dv * H
        score = n * (qk + dv)  # per (query, key) pair: q.k and p.v multiply-adds
    else:
        qd, kvd = ncfg.num_heads * ncfg.head_dim, ncfg.num_kv_heads * ncfg.head_dim
        attn, score = 2 * H * qd + 2 * H * kvd, 2 * qd
    dense_layers = len(moe.dense_layers)
    per_token = 2 * (L * attn + dense_layers * dense + (L - dense_layers) * experts)
    total, prev = 0.0, []
    for r in sorted(reqs, key=lambda r: r.inputs):
        x, n = r.inputs, r.num_inputs
        a = 0
        if unique:
            while a < min(len(prev), n) and prev[a] == x[a]:
                a += 1
            a = a if a >= 16 else 0
        total += per_token * (n - a) + L * score * (n * n - a * a) + 2 * H * ncfg.vocab_size * r.num_scored
        prev = x
    return total


def run_engine(model, reqs, dev, deterministic: bool = False):
    engine = Engine(model, EngineConfig(progress=False, deterministic=deterministic), dev)
    with torch.inference_mode():
        return [r.logprobs.float().cpu() for r in engine.run(reqs)]


def timed(dev, fn):
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out, sec = sync_time(fn)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    return out, sec, peak


def delta(a, b) -> tuple[float, float]:
    d = torch.cat([(x.double() - y.double()).abs() for x, y in zip(a, b)])
    return d.max().item(), d.mean().item()


def logprobe_rows(args, name, cfg, model_cls, reqs, dev, dtype, rows):
    model, ncfg = build_logprobe(name, cfg, model_cls, dev, dtype, fp8=False)
    wb = weight_bytes(model)
    log(f"logprobe {name}: {wb / GiB:.1f} GiB of weights")
    run_engine(model, reqs[:args.warmup], dev)
    if 2 in args.rows:
        run_engine(model, reqs[:args.warmup], dev, True)
    for p in range(args.passes):  # rows 1 and 2 alternate; each keeps its fastest pass
        for k, det in ((1, False), (2, True)):
            if k == 2 and 2 not in args.rows:
                continue
            r = dict(zip(("lp", "sec", "peak"), timed(dev, lambda det=det: run_engine(model, reqs, dev, det))), w=wb)
            log(f"  row {k} pass {p + 1}: {r['sec']:.2f} s")
            if k not in rows or r["sec"] < rows[k]["sec"]:
                rows[k] = r
    if 4 in args.rows:  # row 1 on transformers' subset, for a measured ratio
        sub = reqs[:args.hf_requests]
        rows["1sub"] = dict(zip(("lp", "sec", "peak"), timed(dev, lambda: run_engine(model, sub, dev))))
    del model
    free()
    if 3 in args.rows and name in args.fp8_models:
        model, _ = build_logprobe(name, cfg, model_cls, dev, dtype, fp8=True)
        wb = weight_bytes(model)
        log(f"logprobe {name} FP8 blocks: {wb / GiB:.1f} GiB of weights")
        run_engine(model, reqs[:args.warmup], dev)
        rows[3] = dict(zip(("lp", "sec", "peak"), timed(dev, lambda: run_engine(model, reqs, dev))), w=wb)
        log(f"  row 3: {rows[3]['sec']:.2f} s")
        del model
        free()
    return ncfg


def transformers_row(args, cfg, model_cls, reqs, dev, dtype, rows):
    hf = build_transformers(cfg, model_cls, dev, dtype)
    wb = weight_bytes(hf)
    sub = reqs[:args.hf_requests]
    with torch.inference_mode():
        run_transformers(hf, sub[:2], args.budget, str(dev), use_cache=False)
        lp, sec, peak = timed(dev, lambda: run_transformers(hf, sub, args.budget, str(dev), use_cache=False))
    rows[4] = dict(lp=lp, sec=sec, peak=peak, w=wb, n=len(sub))
    log(f"  row 4: {sec:.2f} s on {len(sub)} requests")
    hf = None  # noqa: F841 - freed before the next model is built
    free()


def report(args, name, ncfg, reqs, rows, tflops):
    needed = sum(r.num_inputs for r in reqs)
    log(f"\n## {name}: W1, {len(reqs)} requests, {needed:,} needed tokens, {args.dtype_name}, random init")
    sub = rows.get("1sub")
    ratio = rows[4]["sec"] / sub["sec"] if 4 in rows and sub else None
    floor = {u: active_flops(ncfg, reqs, u) for u in (False, True)} if tflops else {}
    log("| row | what | requests | s | tok/s | × transformers | max abs Δ vs (1) | mean abs Δ vs (1) | peak extra GiB "
        "| active-FLOP floor ratio (all / unique tokens) |")
    log("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for k in sorted(args.rows):
        r = rows.get(k)
        if r is None:
            log(f"| {k} | {ROWS[k]} | | not run | | | | | | |")
            continue
        n = r.get("n", len(reqs))
        ntok = sum(q.num_inputs for q in reqs[:n])
        vs = "1.00× (baseline)" if k == 4 else (f"~{rows[4]['sec'] / sub['sec'] * (rows[1]['sec'] / r['sec']):.2f}×"
                                                if ratio else "—")
        if k == 1 and ratio:
            vs = f"{ratio:.2f}× (measured on {rows[4]['n']})"
        base = rows["1sub"]["lp"] if k == 4 else rows[1]["lp"]
        mx, mean = delta(r["lp"], base[:n]) if k != 1 else (0.0, 0.0)
        peak = f"{(r['peak'] - r['w']) / GiB:.1f}" if r.get("peak") is not None else "—"
        fr = "—"
        if floor and k in (1, 2, 3):
            t = tflops * 1e12 * r["sec"]
            fr = f"{floor[False] / t:.2f} / {floor[True] / t:.2f}"
        log(f"| {k} | {ROWS[k]} | {n} | {r['sec']:.2f} | {ntok / r['sec']:,.0f} | {vs} | {mx:.2e} | {mean:.2e} | "
            f"{peak} | {fr} |")
    if 2 in rows:
        log(f"deterministic / default time: {rows[2]['sec'] / rows[1]['sec']:.3f}")
    if 3 in rows:
        log(f"FP8 block / bf16 time: {rows[3]['sec'] / rows[1]['sec']:.3f}; weights {rows[3]['w'] / GiB:.1f} vs "
            f"{rows[1]['w'] / GiB:.1f} GiB (row 3's Δ is the FP8 rounding of the weights)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mla16b,glm-air", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--rows", default="1,2,3,4", help="; ".join(f"{k}: {v}" for k, v in ROWS.items()))
    ap.add_argument("--fp8-models", default="mla16b", help="models that get row 3")
    ap.add_argument("--requests", type=int, default=0, help="the first N W1 requests (0: all; --tiny: 2)")
    ap.add_argument("--hf-requests", type=int, default=64, help="requests transformers runs (row 4)")
    ap.add_argument("--glm-layers", type=int, default=6, help="blocks of the GLM-4.5-Air shape (of 46)")
    ap.add_argument("--budget", type=int, default=8192, help="transformers' padded tokens per batch")
    ap.add_argument("--warmup", type=int, default=8, help="requests run before each timed logprobe row")
    ap.add_argument("--passes", type=int, default=1, help="timed passes of rows 1 and 2, alternating (best kept)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs, float32, on the CPU (a smoke test)")
    args = ap.parse_args()
    args.rows = sorted({int(r) for r in args.rows.split(",")})
    names, args.fp8_models = args.models.split(","), args.fp8_models.split(",")
    if not set(names) <= set(MODELS) or not set(args.rows) <= set(ROWS):
        sys.exit(f"--models: of {', '.join(MODELS)}; --rows: of {sorted(ROWS)}")
    dev = torch.device("cpu" if args.tiny else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for a CPU run)")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.dtype_name = str(dtype).removeprefix("torch.")
    args.requests = args.requests or (2 if args.tiny else 0)
    args.hf_requests = min(args.hf_requests, args.requests or 10**9)
    args.warmup = min(args.warmup, 2) if args.tiny else args.warmup
    tflops = 0.0
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        tflops = matmul_ceiling()
        log(f"device: {p.name}, {p.total_memory / GiB:.0f} GiB; torch {torch.__version__}; "
            f"bf16 8192^3 matmul: {tflops:.0f} TFLOP/s")
    t0 = time.perf_counter()
    for name in names:
        rows: dict = {}
        try:
            cfg, model_cls = hf_config(name, args)
            reqs = workload("W1", cfg.vocab_size)
            reqs = reqs[:args.requests] if args.requests else reqs
            log(f"\n# {name} ({cfg.num_hidden_layers} blocks{', tiny' if args.tiny else ''}); "
                f"{time.perf_counter() - t0:.0f} s into the run")
            ncfg = logprobe_rows(args, name, cfg, model_cls, reqs, dev, dtype, rows)
            if 4 in args.rows:
                transformers_row(args, cfg, model_cls, reqs, dev, dtype, rows)
            report(args, name, ncfg, reqs, rows, tflops if name == "mla16b" else 0.0)
        except Exception as e:  # noqa: BLE001 - one model failing leaves the other's table
            log(f"**{name} failed**: {type(e).__name__}: {e}")
            log("```\n" + "".join(traceback.format_exc().splitlines(keepends=True)[-8:]) + "```")
        finally:
            free()
    log(f"\ndone in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
