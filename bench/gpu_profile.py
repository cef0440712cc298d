"""Where does logprobe's GPU time go: which CUDA kernels, which kernel families, how busy is the GPU?

Three scenarios (``--scenario``, several comma-separated run one after the other), random-init
weights, bf16 on one CUDA GPU, the default ``EngineConfig``:

  llama    Llama shapes (bench/common.py MODELS, ``--models``, default llama-1b,llama-8b): the first
           ``--profile-requests`` W1 requests in one engine call; the top kernels
  hybrid   Qwen3.5 hybrid shapes (common.HYBRID_MODELS, ``--models``, default qwen35-35b-a3b; the
           checkpoint written under ``--dir`` as bench/gpu_hybrid.py writes it, and reused from
           there; ``--layers N``, else gpu_hybrid's choice: all layers or the multiple of 4 whose
           weights fit 30 GiB, 16 of 40 for the MoE), loaded by ``Scorer(dir)``: the first
           ``--profile-requests`` W1 requests, default and deterministic mode (``--modes``)
  prefix   the prefix cache with one request per call (bench/cpu_prefix_cache.py's RL groups and
           checkpoint: ``--gpu-shape`` written once to ``--checkpoint``, ``Scorer(prefix_cache=True)``,
           ``scorer.engine.run([request])`` per call): the first ``--calls`` requests of
           ``--groups`` x ``--samples`` (the first of each group computes its prompt, the others
           resume from it). The calls run once to warm, then with the cache cleared before each pass:
           timed per call without the profiler (wall ms, computed tokens, FLOPs against the bf16
           matmul ceiling), under the CUDA profiler (kernels per call, GPU busy fraction), and under
           the CPU profiler with Python functions traced (the top ``--cpu-top`` ops and functions by
           self CPU time per call, the host's waits on the GPU)

Each profile runs its engine call once first (compiles, autotunes), then once under torch.profiler
(CUDA activity only: the wall of that pass is the busy fraction's denominator), and prints the top
``--top`` kernels (launches, ms, share, family) and the kernels summed by family (bench/common.py
``kernel_family``: matmul, attention, gated delta, conv, MoE experts, routing, head, elementwise,
copies, NCCL, other) with kernel time / wall (an upper bound of the GPU's busy fraction: kernels
may overlap) and the union of the kernel intervals (the time at least one ran; wall minus it: the
GPU idle). Then (``--by-module``, on by default) one more pass of the llama and hybrid scenarios
with CUDA events recorded in forward hooks: the stream time spent inside each child of the decoder
layers (``--module-depth`` levels: the mixer and its projections, the MoE block and its experts,
the norms), summed over the layers, and what is left outside them (the head, the engine's host
work). Families go by kernel name: logprobe's own short convolution of the hybrids runs as
PyTorch elementwise and index ops (batch-invariant), so its time shows under elementwise and
copies, not conv (which holds conv kernels proper: fla's, cuDNN's, the Triton short conv).

The prefix question: a call computing ~415 new tokens of an 8B model takes ~27 ms on an H200
where its FLOPs take ~10 ms; GPU idle (host-bound) or slow kernels (which)?

    # one H100 or H200 (rough minutes, checkpoints written included)
    python bench/gpu_profile.py --models llama-8b --profile-requests 64                             # ~2
    pip install --no-index --find-links .whl fla-core einops
    python bench/gpu_profile.py --scenario hybrid --models qwen35-35b-a3b --layers 16 --profile-requests 64  # ~4
    python bench/gpu_profile.py --scenario prefix --gpu-shape llama-8b --checkpoint /tmp/llama8b --calls 32  # ~3
    # CPU smoke run: tiny configs in float32, CPU ops only
    python bench/gpu_profile.py --scenario llama,hybrid,prefix --tiny --profile-requests 2 --calls 4
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HYBRID_MODELS,
    MODELS,
    GiB,
    build_models,
    cpu_table,
    free,
    gpu_banner,
    hf_config,
    kernel_profile,
    kernel_tables,
    log,
    make_room,
    one_line,
    param_bytes,
    pass_flops,
    pick_layers,
    profiled,
    progress,
    rl_groups,
    save_model,
    sync,
    sync_time,
    workload,
    write_checkpoint,
    write_hybrid_checkpoint,
)

from logprobe import EngineConfig, Scorer  # noqa: E402
from logprobe.engine.runner import Engine  # noqa: E402
from logprobe.errors import LogprobeError  # noqa: E402
from logprobe.loading import load_model  # noqa: E402

SCENARIOS = {"llama": ("llama-1b,llama-8b", "default"), "hybrid": ("qwen35-35b-a3b", "default,deterministic"),
             "prefix": ("", "default")}  # scenario: (default --models, default --modes)


def names_for(args, scenario: str) -> list[str]:
    """The shapes ``--models`` names for ``scenario`` (its default when not given); one it has not exits."""
    table = MODELS if scenario == "llama" else HYBRID_MODELS
    names = (args.models or SCENARIOS[scenario][0]).split(",")
    bad = [n for n in names if n not in table]
    if bad:
        sys.exit(f"--models: {', '.join(bad)} is not a {scenario} shape (of {', '.join(table)})")
    return names


def modes_for(args, scenario: str) -> list[bool]:
    """``--modes`` (default per scenario) as the ``deterministic`` flags to run."""
    modes = (args.modes or SCENARIOS[scenario][1]).split(",")
    if not set(modes) <= {"default", "deterministic"}:
        sys.exit("--modes: of default, deterministic")
    return [m == "deterministic" for m in modes]


def profile_modes(args, engine, model, reqs, label: str, scenario: str) -> None:
    """``engine.run(reqs)`` profiled once per mode of ``--modes`` (and timed by module of ``model``
    with ``--by-module``); a refused mode is said so."""
    default = engine.config
    for det in modes_for(args, scenario):
        mode = "deterministic" if det else "default"
        try:
            engine.config = replace(default, deterministic=det)
            with torch.inference_mode():
                kernel_profile(lambda: engine.run(reqs), f"{label}, {mode}", grouped=True,
                               cuda=args.dev.type == "cuda", top=args.top)
                if args.by_module:
                    module_times(args, model, lambda: engine.run(reqs), f"{label}, {mode}")
        except LogprobeError as e:
            log(f"\n## Profile: {label}, {mode}: refused: {one_line(e)}")
        except Exception as e:  # noqa: BLE001 - report it, the other modes and models go on
            log(f"\n## Profile: {label}, {mode}: failed: {one_line(e, 1200)}")
            log("```\n" + "".join(traceback.format_exc().splitlines(keepends=True)[-8:]) + "```")
        finally:
            engine.config = default


# ------------------------------------------------------------------------------ time by module


class ModuleClock:
    """The time spent inside the model's modules, by module: every child of each decoder layer
    (``model.layers``), down to ``depth`` levels (``--module-depth``), and the model's other
    children (embedding, final norm), keyed ``attribute: Class`` and summed over the layers. On
    CUDA a module's time is the stream time between two CUDA events recorded as it starts and
    ends (its kernels and the gaps between them); on the CPU the host's time. A module's own
    time is its time less its timed children's. ``with ModuleClock(...) as clock:`` hooks it in."""

    def __init__(self, model, cuda: bool, depth: int) -> None:
        self.cuda, self.spans, self.open, self.handles = cuda, [], {}, []
        self.parent: dict[str, str | None] = {}
        for name, child in model.named_children():
            if child is model.layers:
                for layer in model.layers:
                    for n, c in layer.named_children():
                        self._hook(c, f"{n}: {type(c).__name__}", None, depth - 1)
            else:
                self._hook(child, f"{name}: {type(child).__name__}", None, 0)

    def _hook(self, mod, key: str, parent: str | None, below: int) -> None:
        self.parent[key] = parent
        self.handles.append(mod.register_forward_pre_hook(self._start))
        self.handles.append(mod.register_forward_hook(
            lambda m, a, out, key=key: self.spans.append((key, self.open[id(m)].pop(), self._mark()))))
        if below > 0:
            for n, c in mod.named_children():
                self._hook(c, f"{key} / {n}: {type(c).__name__}", key, below - 1)

    def _start(self, mod, args) -> None:
        self.open.setdefault(id(mod), []).append(self._mark())

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def __enter__(self) -> ModuleClock:
        self.spans, self.open = [], {}
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def totals(self) -> dict[str, tuple[int, float]]:
        """key -> (calls, ms), in the order the modules first ended (synchronise first)."""
        out: dict[str, tuple[int, float]] = {}
        for key, a, b in self.spans:
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            n, t = out.get(key, (0, 0.0))
            out[key] = (n + 1, t + ms)
        return out

    def table(self, wall_ms: float) -> None:
        tot = self.totals()
        kids: dict[str, float] = {}
        for key, (_, ms) in tot.items():
            if self.parent.get(key):
                kids[self.parent[key]] = kids.get(self.parent[key], 0.0) + ms
        log(f"| module ({'GPU stream time' if self.cuda else 'host time'}) | calls | ms | own ms | share of wall |")
        log("| --- | ---: | ---: | ---: | ---: |")
        for key, (n, ms) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
            log(f"| {key} | {n} | {ms:.1f} | {ms - kids.get(key, 0.0):.1f} | {ms / wall_ms:.1%} |")
        top = sum(ms for key, (_, ms) in tot.items() if self.parent.get(key) is None)
        log(f"| outside these modules (the head, the engine's host work and waits) | | {wall_ms - top:.1f} | | "
            f"{(wall_ms - top) / wall_ms:.1%} |")


def module_times(args, model, run, label: str) -> None:
    """One more (warm) ``run()`` with ``ModuleClock`` hooked into ``model``: the time by module."""
    with ModuleClock(model, args.dev.type == "cuda", args.module_depth) as clock:
        _, wall = sync_time(run)
    log(f"\n### Time by module: {label}, wall {wall * 1e3:.1f} ms (hooks on, no profiler)")
    clock.table(wall * 1e3)


# ----------------------------------------------------------------------------------- scenarios


def llama_scenario(args) -> None:
    """The Llama shapes on W1's first requests (``--tiny``: save_model's tiny Llama in float32)."""
    if args.tiny:
        with tempfile.TemporaryDirectory() as tmp:
            save_model("tiny", tmp, "cpu")
            scorer = Scorer(tmp, device=str(args.dev), dtype="float32", progress=False)
            reqs = workload("W1", scorer.info.vocab_size)[:args.profile_requests]
            profile_modes(args, scorer.engine, scorer.loaded.model, reqs, f"tiny Llama W1, first {len(reqs)} requests",
                          "llama")
        return
    for name in names_for(args, "llama"):
        _, ours, lc = build_models(name, baseline=False)
        reqs = workload("W1", lc.vocab_size)[:args.profile_requests]
        engine = Engine(ours, EngineConfig(progress=False), args.dev)
        profile_modes(args, engine, ours, reqs, f"{name} W1, first {len(reqs)} requests", "llama")
        del ours, engine
        free()


def hybrid_scorer(args, name: str) -> tuple[Scorer, str]:
    """``Scorer(dir)`` of ``name``'s random checkpoint as bench/gpu_hybrid.py writes it (same
    directory names under ``--dir``, so one written there is reused) and the layers' label."""
    dtype = torch.float32 if args.tiny else torch.bfloat16
    layers, label = pick_layers(args, name, dtype.itemsize)
    _, cfg = hf_config(name, args.tiny, layers)
    dname = str(dtype).removeprefix("torch.")
    path = Path(args.dir) / f"{name}{'-tiny' if args.tiny else ''}-{layers}L-{dname}"
    make_room(Path(args.dir), path, param_bytes(name, args.tiny, layers, dtype.itemsize) + 4 * GiB)
    progress(f"{name}: checkpoint {path}: {write_hybrid_checkpoint(cfg, path, args.dev, dtype)}")
    kw = {"dtype": "float32"} if args.tiny else {}
    scorer = Scorer(str(path), device=str(args.dev), progress=False, **kw)
    progress(f"{name}: loaded, backend {scorer.info.backend} ({type(scorer.loaded.model).__name__})")
    return scorer, label


def hybrid_scenario(args) -> None:
    """The Qwen3.5 hybrids on W1's first requests, default and deterministic."""
    for name in names_for(args, "hybrid"):
        scorer, label = hybrid_scorer(args, name)
        reqs = workload("W1", scorer.info.vocab_size)[:args.profile_requests]
        profile_modes(args, scorer.engine, scorer.loaded.model, reqs,
                      f"{name} ({label}) W1, first {len(reqs)} requests", "hybrid")
        del scorer
        free()


# -------------------------------------------------------------------------------------- prefix


def prefix_scorer(args, tmp: str) -> Scorer:
    """cpu_prefix_cache.py's model (``--gpu-shape`` written to ``--checkpoint``; ``--tiny``:
    save_model's tiny Llama in ``tmp``, float32) with the prefix cache on."""
    if args.tiny:
        save_model("tiny", tmp, "cpu")
        loaded = load_model(tmp, str(args.dev), "float32")
    else:
        write_checkpoint(args.gpu_shape, Path(args.checkpoint))
        loaded = load_model(args.checkpoint, str(args.dev), "auto")
    return Scorer(loaded, config=EngineConfig(progress=False), prefix_cache=True)


class Calls:
    """The calls on ``scorer`` (its cache cleared first by ``reset``): one request each, or
    ``per_call`` requests each in a random order (``cpu_prefix_cache.py``'s arriving way: a
    batching server's steps); ``units[c]``: call c's request indices; ``passes[c]``: the (rows,
    past keys) of each forward pass of call c in the last run."""

    def __init__(self, scorer: Scorer, reqs, per_call: int = 1) -> None:
        self.scorer, self.reqs, self.passes, self.current = scorer, reqs, [], None
        order = list(range(len(reqs)))
        if per_call > 1:
            random.Random(2).shuffle(order)
        self.units = [order[k:k + per_call] for k in range(0, len(order), per_call)]
        scorer.engine.fault_hook = self._hook

    def _hook(self, rows: int, tokens: int) -> None:
        self.current.append((rows, tokens - rows))

    def reset(self) -> None:
        self.scorer.prefix_cache.clear()
        sync()

    def one(self, c: int):
        self.current = []
        self.passes.append(self.current)
        return self.scorer.engine.run([self.reqs[i] for i in self.units[c]])

    def run(self) -> None:
        self.passes = []
        for c in range(len(self.units)):
            self.one(c)

    def timed(self) -> list[float]:
        """Each call's wall seconds, synchronised (no profiler)."""
        self.passes = []
        return [sync_time(lambda c=c: self.one(c))[1] for c in range(len(self.units))]


def call_summary(args, calls: Calls, secs: list[float], tflops: float | None) -> tuple[float, float | None]:
    """Per call: computed tokens, wall ms and FLOPs, the first call of a group against the resumed
    ones. Returns (mean wall ms, mean ms of the FLOPs at the bf16 ceiling or None)."""
    lc = calls.scorer.loaded.model.config
    fl = [sum(pass_flops(lc, r, p, 0) for r, p in ps) + pass_flops(lc, 0, 0, sum(calls.reqs[i].num_scored for i in u))
          for ps, u in zip(calls.passes, calls.units)]
    rows = [sum(r for r, _ in ps) for ps in calls.passes]
    single = all(len(u) == 1 for u in calls.units)
    firsts = [i for i in range(len(secs)) if i % args.samples == 0] if single else []
    log(f"\n### {len(secs)} calls, {'one request' if single else f'{len(calls.units[0])} requests'} each, no "
        f"profiler" + (f" (first of a group: calls {', '.join(map(str, firsts))})" if single else ""))
    log("| calls | computed tokens per call | forward passes per call | wall ms per call (mean / median / max) | "
        "GFLOP per call | ms at the bf16 ceiling |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for what, idx in (("all", range(len(secs))), ("first of a group (prompt computed)", firsts),
                      ("resumed from the cache", [i for i in range(len(secs)) if i % args.samples] if single else [])):
        if not idx:
            continue
        ms = [secs[i] * 1e3 for i in idx]
        f = sum(fl[i] for i in idx) / len(idx)
        at = f"{f / (tflops * 1e12) * 1e3:.2f}" if tflops else "—"
        log(f"| {what} | {sum(rows[i] for i in idx) / len(idx):.0f} | "
            f"{sum(len(calls.passes[i]) for i in idx) / len(idx):.2f} | {sum(ms) / len(ms):.2f} / {median(ms):.2f} / "
            f"{max(ms):.2f} | {f / 1e9:.1f} | {at} |")
    return sum(secs) * 1e3 / len(secs), (sum(fl) / len(fl) / (tflops * 1e12) * 1e3 if tflops else None)


def verdict(wall_ms: float, flop_ms: float | None, k: dict, calls: int) -> None:
    """The prefix question in one line: GPU idle (the host's share) against kernels slower than their FLOPs."""
    kern, busy = k["kernel_ms"] / calls, k["busy_ms"] / calls
    idle = max(0.0, wall_ms - busy)
    log(f"\n**per call**: wall {wall_ms:.2f} ms (no profiler); kernels {kern:.2f} ms, union {busy:.2f} ms; "
        f"GPU idle ~{idle:.2f} ms = {idle / wall_ms:.0%} of the wall (host-bound time)"
        + (f"; the FLOPs at the bf16 ceiling {flop_ms:.2f} ms: kernels take {kern / flop_ms:.1f}x that "
           f"(by family: the table above)" if flop_ms else ""))


def python_profile(calls: Calls, top: int) -> None:
    """The calls under cProfile: where the host's Python time goes (Triton's launcher, module calls,
    the engine's planning), by own time and by cumulative time, per call."""
    calls.reset()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    calls.run()
    sync()
    prof.disable()
    n = len(calls.units)
    log(f"\n### cProfile, {n} calls: {(time.perf_counter() - t) * 1e3 / n:.2f} ms per call under the tracer "
        f"(totals below are over all {n} calls)")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        log(f"by {key}:\n```\n{buf.getvalue().strip()}\n```")


def prefix_scenario(args, tflops: float | None) -> None:
    """The prefix cache, one request per call: timed, kernels per call, CPU ops per call."""
    with tempfile.TemporaryDirectory() as tmp:
        scorer = prefix_scorer(args, tmp)
        reqs = rl_groups(args.groups, args.samples, args.prompt, args.response, scorer.info.vocab_size)
        reqs = reqs[:args.calls * args.per_call]
        calls = Calls(scorer, reqs, args.per_call)
        cuda = args.dev.type == "cuda"
        each = "one request" if args.per_call == 1 else f"{args.per_call} requests"
        label = (f"prefix cache, {each} per call, {scorer.info.name} ({scorer.info.dtype}), "
                 f"first {len(reqs)} of {args.groups} groups x {args.samples} (prompts <= {args.prompt}, "
                 f"responses <= {args.response})")
        log(f"\n## Profile: {label}")
        with torch.inference_mode():
            t = time.perf_counter()
            calls.reset()
            calls.run()  # warm: compiles, autotunes; then each pass starts from an empty cache
            progress(f"warm-up: {len(calls.units)} calls in {time.perf_counter() - t:.1f} s")
            calls.reset()
            wall_ms, flop_ms = call_summary(args, calls, calls.timed(), tflops)
            if args.cprofile:
                python_profile(calls, args.cprofile)
            if cuda:
                calls.reset()
                prof, wall = profiled(calls.run, cuda=True, cpu=False)
                n = len(calls.units)
                log(f"\n### CUDA profiler, kernels per call ({n} calls)")
                verdict(wall_ms, flop_ms, kernel_tables(prof, wall, args.top, grouped=True, calls=n), n)
            calls.reset()
            prof, wall = profiled(calls.run, cuda=cuda, cpu=True, stack=True)
        log(f"\n### CPU profiler, Python functions traced (the tracing slows the host): wall "
            f"{wall * 1e3 / len(calls.units):.2f} ms per call")
        cpu_table(prof, args.cpu_top, len(calls.units))
        st = scorer.prefix_cache_stats()
        log(f"prefix cache after the last pass: hit rate {st['hit_rate']:.3f}, {st['bytes'] / 2**20:.1f} MiB held")
        del scorer, calls, prof
        free()


# ------------------------------------------------------------------------------------------ main


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="llama", help=f"of {', '.join(SCENARIOS)} (comma-separated: each in turn)")
    ap.add_argument("--models", default=None, help="the scenario's shapes (llama: common.MODELS, default "
                    "llama-1b,llama-8b; hybrid: common.HYBRID_MODELS, default qwen35-35b-a3b)")
    ap.add_argument("--modes", default=None, help="default and/or deterministic (default: default; hybrid: both)")
    ap.add_argument("--profile-requests", type=int, default=64, help="W1 requests profiled (llama, hybrid)")
    ap.add_argument("--layers", type=int, default=0, help="hybrid: decoder layers (default: all, or the nearest "
                    "multiple of 4 whose bf16 weights take <= 30 GiB)")
    ap.add_argument("--dir", default="/tmp/logprobe-bench-hybrid", help="hybrid: checkpoints (gpu_hybrid.py's)")
    ap.add_argument("--calls", type=int, default=32, help="prefix: calls profiled")
    ap.add_argument("--per-call", type=int, default=1, help="prefix: requests per call (more than 1: in a random "
                                                            "order, as cpu_prefix_cache.py's arriving way)")
    ap.add_argument("--gpu-shape", default="llama-8b", choices=["llama-8b", "llama-1b"], help="prefix: the shape")
    ap.add_argument("--checkpoint", default="/tmp/llama8b", help="prefix: where --gpu-shape is written (once)")
    ap.add_argument("--groups", type=int, default=32, help="prefix: RL prompts")
    ap.add_argument("--samples", type=int, default=8, help="prefix: responses per prompt")
    ap.add_argument("--prompt", type=int, default=1024, help="prefix: prompt length (each in [prompt/2, prompt])")
    ap.add_argument("--response", type=int, default=512, help="prefix: response length (in [response/4, response])")
    ap.add_argument("--by-module", action=argparse.BooleanOptionalAction, default=True,
                    help="llama, hybrid: one more pass timed by module (CUDA events in forward hooks)")
    ap.add_argument("--module-depth", type=int, default=2, help="levels of modules timed under a decoder layer")
    ap.add_argument("--top", type=int, default=25, help="kernels listed")
    ap.add_argument("--cpu-top", type=int, default=15, help="prefix: CPU ops / functions listed")
    ap.add_argument("--cprofile", type=int, default=0, help="prefix: also run the calls under cProfile and list "
                                                           "this many Python functions (own and cumulative time)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs in float32 on the CPU (a smoke run)")
    ap.add_argument("--device", default=None, help="cuda (default), or cpu (implies --tiny)")
    args = ap.parse_args()
    args.scenarios = args.scenario.split(",")
    if not set(args.scenarios) <= set(SCENARIOS):
        ap.error(f"--scenario: of {', '.join(SCENARIOS)}")
    args.dev = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    args.tiny = args.tiny or args.dev.type == "cpu"
    return args


def main() -> None:
    args = parse_args()
    tflops = None
    if args.dev.type == "cuda":
        tflops = gpu_banner()
    else:
        log(f"device: CPU, {torch.get_num_threads()} threads; torch {torch.__version__} (tiny configs, float32)")
    runs = {"llama": llama_scenario, "hybrid": hybrid_scenario, "prefix": lambda a: prefix_scenario(a, tflops)}
    for s in args.scenarios:
        progress(f"scenario {s}")
        runs[s](args)
    progress("done")


if __name__ == "__main__":
    main()
