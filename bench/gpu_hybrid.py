"""How fast does logprobe score a whole workload on the Qwen3.5 hybrids (Gated DeltaNet linear
attention, 3 linear : 1 full layers), against transformers on the same checkpoint?

Shapes (bench/common.py HYBRID_MODELS, random init, bf16, transformers' own classes, written once
with ``save_pretrained`` plus a byte tokenizer under ``--dir``):
  qwen35-9b        Qwen3.5-9B's text config (``Qwen3_5ForCausalLM``), all 32 layers
  qwen35-35b-a3b   Qwen3.5-35B-A3B's text config (``Qwen3_5MoeForCausalLM``), 256 experts top-8;
                   the 40 layers are 65 GiB of bf16, so by default the nearest layer count (a
                   multiple of 4, keeping the 3:1 pattern) whose weights take <= 30 GiB: 16 of 40
                   (printed; ``--layers N`` for another count)

Rows, all on the same token ids of the workload (``--workload``, W1 by default: 32 prompts x 8
completions, bench/common.py):
  1  logprobe at the defaults a user gets: ``Scorer(dir, device="cuda")``, default budget,
     ``scorer.logprobs(...)``; whichever backend ``Scorer`` picks is printed (``scorer.info.backend``:
     "native" once logprobe has its own hybrid model, "transformers" before)
  2  the same scorer in deterministic mode (``EngineConfig(deterministic=True)``); a backend without
     deterministic kernels refuses it (printed)
  3  transformers with its fast kernels: flash-linear-attention (``fla``) for the gated delta
     rule when importable (which implementation transformers resolved is printed); padded
     batches sorted by length, ``model(input_ids, attention_mask).logits`` -> float32
     log_softmax -> gather (bench/common.py ``run_transformers``), ``--budget`` padded tokens
  4  the same transformers model on its PyTorch reference path (the module's kernel functions
     swapped for the torch functions they wrap: what a user without fla gets; the swap is proved
     by counting the torch chunk rule's calls). ``--nofla-requests N``: on the first N requests
     only, row 3 timed on them too, the whole time extrapolated as (3)'s whole x (4)/(3) (marked ~)
  5  logprobe's transformers backend (``models.hf_backend.TransformersModel`` over the same
     in-memory transformers model, fla included, as ``load_model`` builds it for a model it has
     no native class for; ``load_model`` has no option to force it), default budget

Per row: seconds, tokens/s (needed input tokens), speed-up against rows 3 and 4, peak GPU memory
above the weights (``torch.cuda.max_memory_allocated()`` minus what the loaded model holds), max
and mean |Δ log-prob| against row 1 on the same requests, the backend; then the deterministic /
default time ratio. logprobe's model is freed (del, gc, empty_cache) before transformers' is
loaded: one copy of the weights at a time. Warm-up: logprobe rows run the first ``--warmup``
requests first (compiles the Triton kernels), then ``--passes`` timed passes (default 1), rows 1
and 2 alternating (1, 2, 1, 2, ...), each keeping its fastest and every pass logged: a process's
first pass over the workload still meets shapes the warm-up did not (Triton compiles), which once
made the deterministic row, timed second, look faster than the default one. Row 4 takes
``--passes`` passes of its own. Rows 3
and 5 run ``--hf-passes`` (default 2, the best kept, each logged): transformers' padded batches
reach fla kernels autotuned per batch shape (batch size, token count), so the first pass over the
workload mostly tunes (on an H100 the first qwen35-9b pass took 53 s). Passes after the first are
skipped, and said so, once the run is ``--time-limit`` seconds old (default 480; by then the MoE
model runs on the tunings the 9B one left, same linear-attention shapes). Progress lines carry the
elapsed seconds. A row that fails prints its error and the rest go on.

First run on one H100 (single passes, 2026-11-25, docs/runs/hybrid-w1-single-pass-h100-2026-11-25.log):
474 s for both models, 82 s of it writing the checkpoints (``save_pretrained`` itself: /dev/shm
wrote no faster than the disk, 50 s for the MoE's 27 GiB; kept under ``--dir`` and reused by a
later run on the same machine). fla's autotuning is what the second passes of rows 3 and 5 are
for: on a fresh process, qwen35-35b-a3b's first 64 W1 requests took 66 s (4-request warm-up),
35.3 s (pass 1) and 2.8 s (pass 2) in row 3. In a two-model run the second model meets the
tunings the first left (same linear-attention shapes); the default order runs the 9B first.

    # one H100, both models in one command (estimated 8.5-9 minutes, the checkpoints written included)
    pip install --no-index --find-links .whl fla-core einops
    python bench/gpu_hybrid.py --models qwen35-9b,qwen35-35b-a3b
    # both models, two alternating logprobe passes (and two of row 4), the transformers baselines
    # with and without fla; row 5 left out (about 100 s of the run above): estimated ~7 minutes
    python bench/gpu_hybrid.py --models qwen35-9b,qwen35-35b-a3b --passes 2 --rows 1,2,3,4
    # one model, some rows
    python bench/gpu_hybrid.py --models qwen35-9b --rows 1,2,3
    # float32 on the GPU (Δ at rounding level; 8 MoE layers fit the 30 GiB)
    python bench/gpu_hybrid.py --dtype float32 --requests 32
    # CPU smoke test (tiny configs in float32, the first 4 W1 requests; row 3 needs CUDA)
    python bench/gpu_hybrid.py --tiny --requests 4
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import shutil
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HYBRID_MODELS,
    GiB,
    free,
    hf_config,
    log,
    matmul_ceiling,
    mem_base,
    run_transformers,
    sync_time,
    workload,
    write_hybrid_checkpoint,
)

from logprobe import Scorer  # noqa: E402
from logprobe.errors import LogprobeError  # noqa: E402
from logprobe.loading import LoadedModel, ModelInfo  # noqa: E402
from logprobe.loading.hf import hf_tokenizer  # noqa: E402
from logprobe.models.hf_backend import TransformersModel  # noqa: E402

WEIGHT_LIMIT = 30 * GiB  # bf16 weights per model: logprobe's and transformers' runs each fit one H100 with room

T0 = time.perf_counter()

def progress(msg: str) -> None:
    log(f"[{time.perf_counter() - T0:6.1f} s] {msg}")

def one_line(e: BaseException, n: int = 400) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:n]}"

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

def make_room(root: Path, keep: Path, need: int) -> None:
    """Remove this script's other checkpoints under ``root`` while the disk has less than ``need`` free."""
    root.mkdir(parents=True, exist_ok=True)
    for d in sorted(root.iterdir()):
        if shutil.disk_usage(root).free >= need:
            return
        if d != keep and (d / "WRITTEN_BY_GPU_HYBRID").exists():
            progress(f"removing {d} (disk: {shutil.disk_usage(root).free / GiB:.1f} GiB free, {need / GiB:.1f} needed)")
            shutil.rmtree(d)

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


ROWS = {1: "logprobe, default", 2: "logprobe, deterministic", 3: "transformers + fla kernels",
        4: "transformers, PyTorch path (no fla)", 5: "logprobe's transformers backend"}
# the module-level kernel functions of transformers' Gated DeltaNet (modeling_qwen3_5*): each
# resolves at import to fla's / causal-conv1d's kernel when importable, else to the torch function
KERNEL_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                "causal_conv1d_update")
MODELING = {"Qwen3_5TextConfig": "transformers.models.qwen3_5.modeling_qwen3_5",
            "Qwen3_5MoeTextConfig": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"}


# ------------------------------------------------------------------------- transformers kernels


def modeling_modules() -> dict[str, object]:
    """transformers' Qwen3.5 modeling modules (config class name -> module); a transformers
    without them exits with one line."""
    out = {}
    for cls, mod in MODELING.items():
        try:
            out[cls] = importlib.import_module(mod)
        except ImportError as e:
            import transformers

            sys.exit(f"transformers {transformers.__version__} has no {mod} ({e}): no Qwen3.5 classes in it")
    return out


def resolved(fn) -> str:
    """Which implementation transformers' kernel wrapper ``fn`` calls (its closure's
    ``implementation``): 'module.name', or 'torch (module)' for the reference function."""
    impl = None
    f = fn
    while f is not None and impl is None:
        try:
            impl = inspect.getclosurevars(f).nonlocals.get("implementation")
        except (TypeError, ValueError):
            pass
        f = getattr(f, "__wrapped__", None)
    impl = impl or fn
    name = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"
    return f"torch reference ({name})" if impl is inspect.unwrap(fn) else name


def kernel_report(mod) -> str:
    return "; ".join(f"{n} -> {resolved(getattr(mod, n))}" for n in KERNEL_FUNCS if hasattr(mod, n))


class TorchPath:
    """Inside: the modules' kernel functions are the torch functions they wrap (``inspect.unwrap``
    of transformers' ``use_kernel_func_from_hub_with_fallback`` wrapper), so the Gated DeltaNet
    runs transformers' PyTorch reference path, as without fla; restored on exit. The forward looks
    these names up in its module at call time, so a model already built follows the swap. Calls
    of the torch chunk rule are counted (``calls``): proof that the swap took."""

    def __init__(self, mods):
        self.mods, self.saved, self.calls = list(mods), [], 0

    def __enter__(self):
        for mod in self.mods:
            for n in KERNEL_FUNCS:
                if hasattr(mod, n):
                    fn = getattr(mod, n)
                    self.saved.append((mod, n, fn))
                    ref = inspect.unwrap(fn)
                    if n == "torch_chunk_gated_delta_rule":
                        ref = self._counted(ref)
                    setattr(mod, n, ref)
        return self

    def _counted(self, ref):
        def counted(*a, **k):
            self.calls += 1
            return ref(*a, **k)
        return counted

    def __exit__(self, *exc):
        for mod, n, fn in reversed(self.saved):
            setattr(mod, n, fn)
        self.saved = []


# ----------------------------------------------------------------------------------- models


def describe(cfg) -> str:
    d = cfg.to_dict()
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "shared_expert_intermediate_size", "rope_parameters", "max_position_embeddings",
            "rms_norm_eps", "tie_word_embeddings")
    kinds = cfg.layer_types
    return (json.dumps({k: d[k] for k in keys if k in d}) +
            f"; layer_types: {kinds.count('linear_attention')} linear_attention + {kinds.count('full_attention')} "
            f"full_attention ({', '.join(k[0].upper() for k in kinds)})")


# ----------------------------------------------------------------------------------- timing


# ----------------------------------------------------------------------------------- phases


def logprobe_phase(args, name, path, reqs, dev, dtype, rows):
    """Rows 1 and 2: ``Scorer(path)`` as a user makes it, default then deterministic mode; each
    warmed up, then ``--passes`` passes alternating 1, 2, 1, 2, ... (each row keeps its fastest), so
    neither row alone pays what a process's first pass over the workload pays (Triton compiles of
    shapes the warm-up did not meet: single passes once made deterministic look faster)."""
    seqs = as_sequences(reqs)
    mem_base(dev)
    t = time.perf_counter()
    kw = {} if dtype == torch.bfloat16 else {"dtype": str(dtype).removeprefix("torch.")}  # bf16: the CUDA default
    scorer = Scorer(str(path), device=str(dev), progress=False, **kw)
    weights = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    backend = scorer.info.backend
    progress(f"{name}: Scorer loaded in {time.perf_counter() - t:.1f} s: backend **{backend}** "
             f"({type(scorer.loaded.model).__name__}), max_batch_tokens {scorer.config.max_batch_tokens} (default)"
             + (f", {weights / GiB:.1f} GiB allocated" if weights else ""))
    default = scorer.config
    modes = {k: replace(default, deterministic=k == 2) for k in (1, 2) if k in args.rows}

    def score(k, part):
        try:
            scorer.config = modes[k]
            return scorer.logprobs(part)
        finally:
            scorer.config = default

    try:
        ready = []
        for k in modes:
            def warm(k=k):
                try:
                    _, sec = sync_time(lambda: score(k, seqs[:args.warmup]))
                except LogprobeError as e:  # a backend without deterministic kernels
                    rows[k] = dict(error=f"refused by the {backend} backend: {one_line(e, 200)}")
                    progress(f"{name} row {k}: {rows[k]['error']}")
                    return
                progress(f"{name} row {k} warm-up ({min(args.warmup, len(seqs))} requests): {sec:.1f} s")
                ready.append(k)
            step(rows, k, f"{name} row {k} warm-up", warm)
        got: dict = {}
        for p in range(max(1, args.passes)):
            if p and time.perf_counter() - T0 > args.time_limit:
                progress(f"{name} rows {', '.join(map(str, ready))}: passes {p + 1}-{args.passes} skipped "
                         f"(past --time-limit {args.time_limit:.0f} s)")
                break
            for k in list(ready):
                def one(k=k, p=p):
                    res, sec, peak, _ = timed(args, dev, weights, lambda: score(k, seqs), 1, f"{name} row {k}")
                    progress(f"{name} row {k} pass {p + 1}: {sec:.2f} s")
                    r = got.setdefault(k, dict(n=len(seqs), backend=backend, secs=[], peak=peak))
                    r["secs"].append(sec)
                    if peak is not None:
                        r["peak"] = max(r["peak"], peak)
                    if sec <= min(r["secs"]):
                        r.update(sec=sec, lp=[x.logprobs.float().cpu() for x in res])
                step(rows, k, f"{name} row {k} pass {p + 1}", one)
                if "error" in rows.get(k, {}):
                    ready.remove(k)
        for k, r in got.items():
            if k in ready:
                rows[k] = r
                progress(f"{name} row {k} {ROWS[k]}: {r['sec']:.2f} s")
    finally:
        scorer = None  # noqa: F841 - the weights go before transformers' are loaded
        free()
        if dev.type == "cuda":
            progress(f"{name}: logprobe freed, {torch.cuda.memory_allocated() / GiB:.2f} GiB still allocated")


def transformers_phase(args, name, path, mods, reqs, dev, dtype, rows):
    """Rows 3, 4 and 5 on one transformers model (``from_pretrained`` of the same directory)."""
    from transformers import AutoModelForCausalLM

    if not any(r in args.rows for r in (3, 4, 5)):
        return
    mem_base(dev)
    t = time.perf_counter()
    try:  # straight onto the device (accelerate); else through the host, as loading.hf does
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, device_map=str(dev)).eval()
    except (ImportError, ValueError) as e:
        progress(f"{name}: from_pretrained(device_map=...) refused ({one_line(e, 120)}); loading through the host")
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(dev).eval()
    weights = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    mod = sys.modules[type(hf).__module__]
    progress(f"{name}: transformers {type(hf).__name__} loaded in {time.perf_counter() - t:.1f} s "
             f"(attention {hf.config._attn_implementation}"
             + (f", experts {hf.config._experts_implementation}" if hasattr(hf.config, "_experts_implementation")
                else "") + ")" + (f", {weights / GiB:.1f} GiB allocated" if weights else ""))
    log(f"transformers' kernels: {kernel_report(mod)}")
    fla_in_use = "fla." in kernel_report(mod)
    n4 = args.nofla_requests if 0 < args.nofla_requests < len(reqs) else len(reqs)
    part = reqs[:n4]
    budget = args.budget

    def baseline(rs):
        with torch.inference_mode():
            return run_transformers(hf, rs, budget, str(dev), use_cache=False)

    try:
        if 3 in args.rows:
            def row3():
                if dev.type != "cuda":
                    rows[3] = dict(error="skipped: fla's kernels run on CUDA only (this run: CPU)")
                    return
                _, sec = sync_time(lambda: baseline(reqs[:4]))
                progress(f"{name} row 3 warm-up (4 requests): {sec:.1f} s")
                res, sec, peak, secs = timed(args, dev, weights, lambda: baseline(reqs), args.hf_passes,
                                             f"{name} row 3")
                rows[3] = dict(sec=sec, n=len(reqs), peak=peak, lp=res, secs=secs, backend="transformers " +
                               ("(fla)" if fla_in_use else "(**no fla: torch path**)"))
                progress(f"{name} row 3 {ROWS[3]}: {sec:.2f} s")
                if n4 < len(reqs) and 4 in args.rows:  # its batches are new shapes: one pass to tune, one timed
                    _, sub, _, _ = timed(args, dev, weights, lambda: baseline(part), 2, f"{name} row 3, first {n4}")
                    rows[3]["sub_sec"] = sub
                    progress(f"{name} row 3 on the first {n4} requests (for row 4's extrapolation): {sub:.2f} s")
            step(rows, 3, f"{name} row 3", row3)
        if 4 in args.rows:
            def row4():
                with TorchPath([mod]) as tp:
                    _, sec = sync_time(lambda: baseline(reqs[:1]))
                    progress(f"{name} row 4 warm-up (1 request): {sec:.1f} s; the torch chunk rule ran "
                             f"{tp.calls} times (the swap took)")
                    res, sec, peak, secs = timed(args, dev, weights, lambda: baseline(part), args.passes,
                                                 f"{name} row 4")
                r = dict(sec=sec, n=n4, peak=peak, lp=res, backend="transformers (torch path)", secs=secs)
                if n4 < len(reqs):
                    r3 = rows.get(3, {})
                    if "sub_sec" in r3:
                        r["whole"] = r3["sec"] * sec / r3["sub_sec"]
                        r["how"] = f"(3) whole x (4)/(3) on the first {n4}: {sec:.2f} / {r3['sub_sec']:.2f} s"
                    else:
                        frac = sum(q.num_inputs for q in part) / sum(q.num_inputs for q in reqs)
                        r["whole"] = sec / frac
                        r["how"] = f"by needed tokens: {sec:.2f} s on {100 * frac:.1f}% of them"
                rows[4] = r
                progress(f"{name} row 4 {ROWS[4]}: {sec:.2f} s on {n4} of {len(reqs)} requests"
                         + (f"; whole workload ~{r['whole']:.1f} s ({r['how']})" if "whole" in r else ""))
            step(rows, 4, f"{name} row 4", row4)
        if 5 in args.rows:
            def row5():
                t5 = time.perf_counter()
                model = TransformersModel(hf)  # what loading.load_model builds for a non-native model
                model.check_head()
                info = ModelInfo(str(path), str(path), "transformers", str(hf.config.model_type), str(dev),
                                 str(dtype).removeprefix("torch."), model.vocab_size,
                                 int(hf.config.max_position_embeddings))
                scorer = Scorer(LoadedModel(model, hf_tokenizer(path), info), progress=False)
                seqs = as_sequences(reqs)
                progress(f"{name} row 5: transformers backend built in {time.perf_counter() - t5:.1f} s, "
                         f"max_batch_tokens {scorer.config.max_batch_tokens} (default)")
                _, sec = sync_time(lambda: scorer.logprobs(seqs[:args.warmup]))
                progress(f"{name} row 5 warm-up: {sec:.1f} s")
                res, sec, peak, secs = timed(args, dev, weights, lambda: scorer.logprobs(seqs), args.hf_passes,
                                             f"{name} row 5")
                rows[5] = dict(sec=sec, n=len(seqs), peak=peak, lp=[r.logprobs.float().cpu() for r in res],
                               secs=secs, backend=scorer.info.backend + (" (fla)" if fla_in_use else " (torch path)"))
                progress(f"{name} row 5 {ROWS[5]}: {sec:.2f} s")
            step(rows, 5, f"{name} row 5", row5)
    finally:
        hf = None  # noqa: F841
        free()


# ----------------------------------------------------------------------------------- report


def report(args, name, label, reqs, rows):
    needed = sum(r.num_inputs for r in reqs)
    scored = sum(r.num_scored for r in reqs)
    log(f"\n## {name} ({label}), {args.workload}: {len(reqs)} requests, {needed:,} needed tokens, {scored:,} scored; "
        f"{args.dtype_name}, random init")

    def whole(k):
        r = rows.get(k, {})
        return r.get("whole", r.get("sec") if r.get("n") == len(reqs) else None)

    base3, base4 = whole(3), whole(4)
    log("| row | what | backend | requests timed | s | tok/s | × vs (3) | × vs (4) | peak extra GiB | "
        "max abs Δ vs (1) | mean abs Δ vs (1) |")
    log("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k in sorted(args.rows):
        r = rows.get(k)
        if r is None or "sec" not in r:
            why = (r or {}).get("error", "not run")
            log(f"| {k} | {ROWS[k]} | | | {why} | | | | | | |")
            continue
        sec = r.get("whole", r["sec"])
        est = "~" if "whole" in r else ""
        s = f"{r['sec']:.2f}" + (f" (best of {', '.join(f'{x:.2f}' for x in r['secs'])})"
                                 if len(r.get("secs", ())) > 1 else "")
        s += f" (whole: ~{r['whole']:.1f}, {r['how']})" if "whole" in r else ""
        ntok = sum(q.num_inputs for q in reqs[:r["n"]])
        vs3 = f"{est}{base3 / sec:.2f}×" if base3 else "—"
        vs4 = f"{est}{base4 / sec:.2f}×" if base4 else "—"
        peak = f"{r['peak']:.1f}" if r.get("peak") is not None else "—"
        d = "| — | —"
        if k != 1 and "lp" in rows.get(1, {}):
            mx, mean = delta(r["lp"], rows[1]["lp"][:r["n"]])
            d = f"| {mx:.2e} | {mean:.2e}"
        elif k == 1:
            d = "| 0 | 0"
        log(f"| {k} | {ROWS[k]} | {r['backend']} | {r['n']} | {s} | {ntok / r['sec']:,.0f} | {vs3} | {vs4} | {peak} "
            f"{d} |")
    r1, r2 = rows.get(1, {}), rows.get(2, {})
    if "sec" in r1 and "sec" in r2:
        log(f"deterministic / default time: {r2['sec'] / r1['sec']:.3f} ({r2['sec']:.2f} s / {r1['sec']:.2f} s)")
    elif 2 in args.rows:
        log(f"deterministic / default time: — ({r2.get('error', 'not run')})")


# ------------------------------------------------------------------------------------- main


def fla_status() -> str:
    try:
        import fla

        return f"fla importable (fla-core {getattr(fla, '__version__', '?')})"
    except Exception as e:  # noqa: BLE001 - absent or broken: both mean transformers' torch path
        return f"**fla NOT importable** ({one_line(e, 120)}): transformers runs its PyTorch path in rows 3 and 5"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen35-9b,qwen35-35b-a3b", help=f"of {', '.join(HYBRID_MODELS)}")
    ap.add_argument("--rows", default="1,2,3,4,5", help="; ".join(f"{k}: {v}" for k, v in ROWS.items()))
    ap.add_argument("--workload", default="W1", choices=("W1", "W2", "W3"))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers of every model (default: all, or the "
                    "nearest multiple of 4 whose bf16 weights take <= 30 GiB)")
    ap.add_argument("--requests", type=int, default=0, help="the first N requests of the workload only (0: all)")
    ap.add_argument("--nofla-requests", type=int, default=0, help="row 4 (transformers' PyTorch path) on the first "
                    "N requests only, its whole time extrapolated (0: all)")
    ap.add_argument("--passes", type=int, default=1, help="timed passes of rows 1, 2, 4 (after their warm-up; "
                    "rows 1 and 2 alternate): the best is kept, each is logged")
    ap.add_argument("--hf-passes", type=int, default=2, help="timed passes of rows 3 and 5: transformers' padded "
                    "batches meet fla kernels autotuned per batch shape, so the first pass over the workload tunes "
                    "and the second is the warm figure")
    ap.add_argument("--time-limit", type=float, default=480, help="seconds into the run after which passes "
                    "beyond the first are skipped (said so), so both models fit one 10-minute device command")
    ap.add_argument("--budget", type=int, default=8192, help="transformers' padded tokens per batch (rows 3, 4)")
    ap.add_argument("--warmup", type=int, default=16, help="requests of the warm-up before each logprobe row")
    ap.add_argument("--dir", default="/tmp/logprobe-bench-hybrid", help="where the checkpoints are written (kept "
                    "and reused while their config is the same)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="CUDA weights and compute of every row (float32: Δ at rounding level; fewer MoE layers fit)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs in float32 (with --device cpu: a smoke test)")
    ap.add_argument("--device", default=None, help="cuda (default), or cpu (implies --tiny)")
    args = ap.parse_args()
    args.rows = sorted({int(r) for r in args.rows.split(",")})
    if not set(args.rows) <= set(ROWS):
        sys.exit(f"--rows: of {sorted(ROWS)}")
    names = args.models.split(",")
    if not set(names) <= set(HYBRID_MODELS):
        sys.exit(f"--models: of {', '.join(HYBRID_MODELS)}")
    dev = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for a CPU run)")
    args.tiny = args.tiny or dev.type == "cpu"
    dtype = getattr(torch, args.dtype) if dev.type == "cuda" and not args.tiny else torch.float32
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
    log(f"device: {where}; torch {torch.__version__}, triton {tv}, transformers {transformers.__version__}")
    log(fla_status())
    mods = modeling_modules()
    for mod in mods.values():
        log(f"transformers {mod.__name__.rsplit('.', 1)[-1]}: {kernel_report(mod)}")
    if dev.type == "cuda":
        log(f"bf16 8192^3 matmul: {matmul_ceiling():.0f} TFLOP/s")
    else:  # fla's Triton kernels need CUDA: every transformers forward of this run takes the torch path
        TorchPath(mods.values()).__enter__()
        log("CPU run: transformers' torch path in every row (fla's kernels are CUDA-only)")
    progress(f"rows {','.join(map(str, args.rows))} on {args.workload}; models {', '.join(names)}")
    root = Path(args.dir)
    progress(f"checkpoints under {root}")
    tables = []
    for name in names:
        rows: dict = {}
        try:
            layers, label = pick_layers(args, name, dtype.itemsize)
            cls, cfg = hf_config(name, args.tiny, layers)
            log(f"\n# {name}: {label}{' (tiny)' if args.tiny else ''}")
            log(f"config ({cls}): {describe(cfg)}")
            path = root / f"{name}{'-tiny' if args.tiny else ''}-{layers}L-{args.dtype_name}"
            make_room(root, path, param_bytes(name, args.tiny, layers, dtype.itemsize) + 4 * GiB)
            progress(f"{name}: checkpoint {path}: {write_hybrid_checkpoint(cfg, path, dev, dtype)}")
            reqs = workload(args.workload, cfg.vocab_size)
            if args.requests:
                reqs = reqs[:args.requests]
            logprobe_phase(args, name, path, reqs, dev, dtype, rows)
            transformers_phase(args, name, path, mods[cls], reqs, dev, dtype, rows)
            report(args, name, label, reqs, rows)
            tables.append((name, label, reqs, rows))
        except Exception as e:  # noqa: BLE001
            progress(f"**{name} failed**: {one_line(e, 1200)}")
            log("```\n" + "".join(traceback.format_exc().splitlines(keepends=True)[-10:]) + "```")
        finally:
            free()
    if len(tables) > 1:
        log("\n# all models")
        for t in tables:
            report(args, *t)
    progress("done")


if __name__ == "__main__":
    main()
