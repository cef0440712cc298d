"""The prefix cache across requests (``Scorer(prefix_cache=...)``, ``--prefix-cache``) on repeated work.

1. RL groups (G prompts x S sampled responses, the responses scored), four ways on one engine:
   one request per call without the cache (what a framework sending each sample alone costs),
   all of them as one batch (the in-batch prefix trees share each prompt), one request per call
   with the cache, and the single requests arriving in a random order, ``--per-call`` of them per
   engine call (what a batching server takes from its queue), with the cache: there the requests of
   a call resumed from cached prompts run packed in one pass. Computed tokens (rows through the
   model, counted per forward pass), forward passes and wall time; target: singly with the cache
   within 1.2x of the one batch.
   Then the same groups through the HTTP server as an RL framework's async client sends them: one
   SGLang ``/generate`` request per sample (``logprob_start_len`` at the response), ``--in-flight``
   requests outstanding at once from a client process of its own (the server's batcher packs what
   is queued into one engine call),
   without and with the prefix cache, against the one library batch above.
2. An lm-eval-style multiple-choice set through the HTTP server (``/v1/completions`` with
   ``echo``, ``logprobs=1``, ``max_tokens=1``, one request per choice as lm-eval sends them by
   default): without and with the cache; computed tokens and wall time.

Every number with the cache is compared with the run without it (max |diff|; 0 in deterministic
mode). CPU on the default model:

    python bench/cpu_prefix_cache.py
    python bench/cpu_prefix_cache.py --weights dense --threads 1 --groups 2 --samples 8 --questions 5
    python bench/cpu_prefix_cache.py --groups 4 --samples 8 --prompt 384 --questions 10 --deterministic

GPU variant (a random-init llama-8b checkpoint written once to DIR, bf16):

    python bench/cpu_prefix_cache.py --gpu-shape llama-8b --checkpoint /tmp/llama8b --device cuda --groups 32 --samples 8 --prompt 1024 --response 512 --questions 200 --context 800
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import multiprocessing
import random
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from statistics import median

import requests
import torch
import uvicorn
from common import free, git_rev, rl_groups, write_checkpoint

from logprobe import EngineConfig, Scorer
from logprobe.cli.serve import freeze_heap
from logprobe.loading import load_model
from logprobe.server import ServerConfig, create_app


def counting(scorer: Scorer) -> list[int]:
    """[rows computed, forward passes]: every forward pass of the scorer's engine adds its rows and one."""
    box = [0, 0]

    def hook(rows: int, _tokens: int) -> None:
        box[0] += rows
        box[1] += 1

    scorer.engine.fault_hook = hook
    return box


ALLOCATOR = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_counts() -> dict[str, int]:
    """PyTorch's CUDA allocator counters that mean a pass waited on the driver: blocks allocated
    from and returned to the device (``cudaMalloc`` / ``cudaFree``, the latter synchronising),
    retries after an allocation failed (the cache emptied first); {} on CPU."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR}


def counts_since(before: dict[str, int]) -> str:
    after = allocator_counts()
    return ", ".join(f"{k.removeprefix('num_')} {after[k] - before.get(k, 0)}" for k in after)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def max_diff(a, b) -> float:
    return max(((x.logprobs - y.logprobs).abs().max().item() for x, y in zip(a, b)), default=0.0)


def in_calls(scorer: Scorer, reqs: list, per_call: int, seed: int = 2) -> list:
    """The requests in a random order, ``per_call`` per engine call; results in input order."""
    order = list(range(len(reqs)))
    random.Random(seed).shuffle(order)
    out = [None] * len(reqs)
    for k in range(0, len(order), per_call):
        part = order[k:k + per_call]
        for i, res in zip(part, scorer.engine.run([reqs[i] for i in part])):
            out[i] = res
    return out


def repeated(scorer: Scorer, box: list[int], fn, n: int) -> tuple[list, float, list[float]]:
    """``fn()`` run ``n`` times, each from an empty prefix cache with the counters reset: (the last
    run's results, the median seconds, every run's seconds); the counters keep the last run's."""
    every = []
    for _ in range(n):
        if scorer.prefix_cache is not None:
            scorer.prefix_cache.clear()
        box[0] = box[1] = 0
        out, secs = timed(fn)
        every.append(secs)
    return out, median(every), every


def runs(every: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in every)


def bench_rl(loaded, cfg: EngineConfig, args) -> None:
    reqs = rl_groups(args.groups, args.samples, args.prompt, args.response, loaded.info.vocab_size)
    fed = sum(r.num_inputs for r in reqs)
    plain = Scorer(loaded, config=cfg)
    # every scorer of the run gets the first one's batch budget: a default budget comes from the
    # memory free when a scorer starts, which the earlier ways' caches (held by the allocator) lower
    cfg = replace(cfg, max_batch_tokens=plain.engine.start_budget)
    setting = args.prefix_cache_bytes or True
    plain.engine.run(reqs[:1])  # warm-up (kernels, allocator)
    rows, results, stats = {}, {}, {}
    arriving = f"arriving singly in a random order, {args.per_call} per call, prefix cache"
    for label, cached, way in (("one request per call, no cache", False, "single"),
                               ("all as one batch (in-batch prefix trees)", False, "batch"),
                               ("one request per call, prefix cache", True, "single"),
                               (arriving, True, "calls")):
        scorer = None
        free()  # the last way's cache back to the device before this one's is sized
        scorer = Scorer(loaded, config=cfg, prefix_cache=setting) if cached else plain
        box = counting(scorer)
        if way == "batch":
            fn = lambda s=scorer: s.engine.run(reqs)  # noqa: E731
        elif way == "single":
            fn = lambda s=scorer: [s.engine.run([r])[0] for r in reqs]  # noqa: E731
        else:
            fn = lambda s=scorer: in_calls(s, reqs, args.per_call)  # noqa: E731
        before = allocator_counts()
        out, secs, every = repeated(scorer, box, fn, args.repeat if way != "single" else 1)
        if before:
            print(f"{label}: allocator (all runs) {counts_since(before)}")
        if scorer.engine.oom_count:  # an out-of-memory pass is split and retried: more passes, emptied caches
            print(f"{label}: {scorer.engine.oom_count} out-of-memory retries (budget now {scorer.engine.budget})")
        rows[label] = (box[0], box[1], secs, every)
        results[label] = out
        stats[label] = scorer.prefix_cache_stats()
    base = results["all as one batch (in-batch prefix trees)"]
    del scorer
    print(f"\nRL groups: {args.groups} prompts x {args.samples} responses, {fed} input tokens fed; batch "
          f"budget {cfg.max_batch_tokens} tokens in every way")
    print(f"(wall s: the median of {args.repeat} runs, each from an empty cache, where more than one; "
          "one request per call: one run)")
    print("| way | computed tokens | forward passes | wall s (runs) | vs one batch | max abs diff vs one batch |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    one = rows["all as one batch (in-batch prefix trees)"][2]
    for label, (n, passes, secs, every) in rows.items():
        print(f"| {label} | {n} | {passes} | {secs:.2f} ({runs(every)}) | {secs / one:.2f}x | "
              f"{max_diff(results[label], base):.2e} |")
    for label, st in stats.items():
        if st is not None:
            print(f"{label}: hit rate {st['hit_rate']:.3f}, {st['bytes'] / 2**20:.1f} MiB held")
    if not args.skip_server:
        bench_rl_server(loaded, cfg, args, reqs, base, one)


def rl_client(url: str, bodies: list[dict], in_flight: int) -> tuple[float, list[dict]]:
    """An RL framework's async client, in a process of its own (its JSON work must not share the
    server's interpreter lock): ``bodies`` posted to /generate, ``in_flight`` outstanding.
    Returns (wall seconds, each reply's meta_info)."""
    with requests.Session() as http:
        # one kept-alive connection per outstanding request (requests keeps 10 by default and opens
        # a new connection for every request beyond them, as an RL client's pool would not)
        http.mount("http://", requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=in_flight))

        def send(body: dict) -> dict:
            reply = http.post(url + "/generate", json=body, timeout=600)
            reply.raise_for_status()
            return reply.json()["meta_info"]

        with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
            t = time.perf_counter()
            metas = list(pool.map(send, bodies))
            return time.perf_counter() - t, metas


def step_totals(url: str) -> tuple[float, float]:
    """(engine steps, their seconds summed) so far, from the server's /metrics."""
    text = requests.get(url + "/metrics", timeout=30).text
    got = {}
    for line in text.splitlines():
        for key in ("logprobe_engine_step_seconds_count", "logprobe_engine_step_seconds_sum"):
            if line.startswith(key + " "):
                got[key] = float(line.split()[1])
    return got.get("logprobe_engine_step_seconds_count", 0.0), got.get("logprobe_engine_step_seconds_sum", 0.0)


class GcPauses:
    """The garbage collector's pauses while inside: ``last()`` describes those of the last entry."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, float]] = []
        self._t = 0.0

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.spans.append((info["generation"], time.perf_counter() - self._t))

    def __enter__(self):
        self.spans = []
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._hook)

    def last(self) -> str:
        by = {g: [d for gg, d in self.spans if gg == g] for g in (0, 1, 2)}
        return ", ".join(f"gen{g} x{len(d)} {sum(d) * 1e3:.0f} ms" for g, d in by.items() if d) or "none"


def replay(scorer: Scorer, steps: list[list], box: list[int], profile: bool = False) -> float:
    """The same engine steps, the same requests, from an empty cache, straight to the engine:
    seconds (what the server's steps would take without the HTTP side beside them). Prints each
    step: requests, input tokens, computed rows, forward passes, ms."""
    if scorer.prefix_cache is not None:
        scorer.prefix_cache.clear()
    sync(scorer)
    t, each, slowest = time.perf_counter(), [], (0.0, None)
    pauses = GcPauses()
    for step in steps:
        box[0] = box[1] = 0
        t0 = time.perf_counter()
        with pauses:
            scorer.engine.run(step)
            sync(scorer)
        if time.perf_counter() - t0 > slowest[0]:
            slowest = (time.perf_counter() - t0, step)
        each.append(f"{len(step)} req {sum(len(r.tokens) for r in step)} in {box[0]} rows {box[1]} passes "
                    f"{(time.perf_counter() - t0) * 1e3:.0f} ms (gc {pauses.last()})")
    secs = time.perf_counter() - t
    print("   steps replayed: " + "; ".join(each))
    if profile and slowest[1] is not None:
        profile_step(scorer, steps[:steps.index(slowest[1])], slowest[1])
    return secs


def profile_step(scorer: Scorer, before: list[list], step: list) -> None:
    """The slowest replayed step again, from the cache its earlier steps leave, under the CUDA
    profiler: its kernels by total time, and the host's CPU ops."""
    from torch.profiler import ProfilerActivity, profile
    if scorer.prefix_cache is not None:
        scorer.prefix_cache.clear()
    for earlier in before:
        scorer.engine.run(earlier)
    sync(scorer)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        scorer.engine.run(step)
        sync(scorer)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))


def sync(scorer: Scorer) -> None:
    if scorer.engine.device.type == "cuda":
        torch.cuda.synchronize(scorer.engine.device)


def generate_body(tokens: list[int], score_begin: int, temperature: float) -> dict:
    """SGLang's /generate body scoring ``tokens[score_begin:]`` (slime's: entries [1:] read)."""
    return {"input_ids": tokens, "return_logprob": True, "logprob_start_len": score_begin - 1,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature}}


def bench_rl_server(loaded, cfg: EngineConfig, args, reqs: list, base: list, one: float) -> None:
    """The groups as single /generate requests, ``args.in_flight`` outstanding, through the server."""
    bodies = [generate_body(r.tokens, r.score_begin, r.temperature) for r in reqs]
    if not args.no_freeze:  # as `logprobe serve` does once its app is built
        print(f"server ways: {freeze_heap()} objects left out of garbage collection (logprobe serve's freeze)")
    warm = [generate_body(reqs[0].tokens[::-1][:64], 32, reqs[0].temperature)]  # shares no timed prefix
    rows = {}
    flights = [int(x) for x in str(args.in_flight).split(",")]
    with multiprocessing.get_context("spawn").Pool(1) as client:
        impls = [tuple(x.split(":")) for x in args.server_impl.split(",")]
        ways = [(label, setting, impl) for impl in impls
                for label, setting in (("no cache", None), ("prefix cache", args.prefix_cache_bytes or True))]
        for label, setting, impl in ways:
            if len(impls) > 1:
                label = f"{label}, uvicorn {impl[0]}/{impl[1]}"
            scorer = None
            free()
            scorer = Scorer(loaded, config=cfg, prefix_cache=setting)  # cfg: the library ways' budget
            box = counting(scorer)
            with serving(scorer, *impl) as (url, steps):
                client.apply(rl_client, (url, warm, 1))
                for flight in flights:
                    every = []
                    before = allocator_counts()
                    for _ in range(args.repeat):
                        if scorer.prefix_cache is not None:
                            scorer.prefix_cache.clear()
                        box[0] = box[1] = 0
                        steps0, busy0 = step_totals(url)
                        steps.clear()
                        sec, metas = client.apply(rl_client, (url, bodies, flight))
                        steps1, busy1 = step_totals(url)
                        every.append(sec)
                        # where the wall goes: inside engine steps (executor.run) or around them
                        print(f"server, {label}, {flight} in flight: wall {sec:.3f} s, {steps1 - steps0:.0f} engine "
                              f"steps taking {busy1 - busy0:.3f} s, {sec - (busy1 - busy0):.3f} s outside steps")
                    secs = median(every)
                    counted = (box[0], box[1])  # the timed run's, before the replay counts its own
                    print(f"server, {label}, {flight} in flight: the last run's {len(steps)} steps replayed "
                          f"without HTTP: {replay(scorer, steps, box, args.profile_steps):.3f} s")
                    box[0], box[1] = counted
                    if before:
                        print(f"server, {label}, {flight} in flight: allocator (all runs) {counts_since(before)}")
                    if scorer.engine.oom_count:
                        print(f"server, {label}: {scorer.engine.oom_count} out-of-memory retries so far")
                    got = [torch.tensor([e[0] for e in m["input_token_logprobs"][1:]]) for m in metas]  # a None first
                    diff = max(((g - b.logprobs.float().cpu()).abs().max().item() for g, b in zip(got, base)),
                               default=0.0)
                    rows[f"{label}, {flight} in flight"] = (box[0], box[1], sum(m["cached_tokens"] for m in metas),
                                                            secs, diff, every)
    print("\nRL groups through the server: one /generate request per sample, N outstanding at once "
          "(the client in a process of its own)")
    print("| server | computed tokens | forward passes | reported cached_tokens | wall s (runs) | vs one library "
          "batch | max abs diff vs one batch |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, (n, passes, cached, secs, diff, every) in rows.items():
        print(f"| {label} | {n} | {passes} | {cached} | {secs:.2f} ({runs(every)}) | {secs / one:.2f}x | {diff:.2e} |")


@contextlib.contextmanager
def serving(scorer: Scorer, loop: str = "auto", http: str = "auto"):
    """The app on uvicorn in a thread: (its URL, the engine steps it ran); ``loop`` / ``http``:
    uvicorn's choices ("auto": uvloop and httptools where installed, as `logprobe serve`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(scorer, ServerConfig(max_top_logprobs=5))
    batcher = app.state.batcher
    steps = []  # every engine step's requests, for a replay without HTTP
    engine_call = batcher.run_batch

    def recorded(step, cancelled=None):
        steps.append(list(step))
        return engine_call(step, cancelled)

    batcher.run_batch = recorded
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop=loop,
                                           http=http))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", steps
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def mc_prompts(questions: int, choices: int, context: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    out = []
    for _ in range(questions):
        ctx = tok(rng.randint(context // 2, context))
        out += [ctx + tok(rng.randint(1, 12)) for _ in range(choices)]
    return out


def bench_mc(loaded, cfg: EngineConfig, args) -> None:
    prompts = mc_prompts(args.questions, args.choices, args.context, loaded.info.vocab_size)
    rows, answers = {}, {}
    for label, setting in (("no cache", None), ("prefix cache", args.prefix_cache_bytes or True)):
        scorer = None
        free()
        scorer = Scorer(loaded, config=cfg, prefix_cache=setting)
        box = counting(scorer)
        with serving(scorer) as (url, _):
            def send(ids):
                r = requests.post(url + "/v1/completions", json={"prompt": [ids], "max_tokens": 1, "echo": True,
                                                                 "logprobs": 1, "temperature": 0}, timeout=600)
                r.raise_for_status()
                return r.json()

            send(prompts[0][:8])  # warm-up
            box[0] = 0
            replies, secs = timed(lambda: [send(p) for p in prompts])
        cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies)
        rows[label] = (box[0], secs, cached)
        answers[label] = [r["choices"][0]["logprobs"]["token_logprobs"][1:] for r in replies]
    diff = max(abs(a - b) for x, y in zip(answers["no cache"], answers["prefix cache"]) for a, b in zip(x, y))
    fed = sum(len(p) for p in prompts)
    print(f"\nmultiple choice through the server: {args.questions} contexts x {args.choices} choices, one "
          f"/v1/completions request per choice (echo, logprobs=1, max_tokens=1), {fed} prompt tokens")
    print("| server | computed tokens | reported cached_tokens | wall s |\n| --- | ---: | ---: | ---: |")
    for label, (n, secs, cached) in rows.items():
        print(f"| {label} | {n} | {cached} | {secs:.2f} |")
    print(f"speed-up {rows['no cache'][1] / rows['prefix cache'][1]:.2f}x; max abs diff of the echoed "
          f"log-probs {diff:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="packed", choices=["packed", "dense"],
                    help="packed (the default model's default: Q4_1 expanded inside every pass, a fixed cost "
                         "per pass on CPU) or dense (expanded once at load)")
    ap.add_argument("--gpu-shape", default=None, choices=["llama-8b", "llama-1b"],
                    help="write a random-init checkpoint of this shape to --checkpoint (once) and use it")
    ap.add_argument("--checkpoint", default=None, help="directory for --gpu-shape")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=384, help="prompt length (each in [prompt/2, prompt])")
    ap.add_argument("--response", type=int, default=64, help="response length (each in [response/4, response])")
    ap.add_argument("--per-call", type=int, default=4,
                    help="RL requests per engine call in the random-arrival way (a batching server's step)")
    ap.add_argument("--in-flight", default="64",
                    help="RL requests outstanding at once through the server (an async client's concurrency; "
                         "comma-separated: each in turn, the cache cleared between)")
    ap.add_argument("--skip-mc", action="store_true", help="leave out the multiple-choice server run")
    ap.add_argument("--repeat", type=int, default=1, help="RL runs per way (the median kept; one request per "
                                                          "call: always one)")
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--context", type=int, default=300, help="context length (each in [context/2, context])")
    ap.add_argument("--prefix-cache-bytes", type=int, default=None, help="default: the library's default budget")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 keeps small passes steady on a CPU shared with other work)")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--server-impl", default="auto:auto", help="uvicorn loop:http pairs for the RL server ways, "
                    "comma-separated (asyncio:h11 is pure Python; auto takes uvloop and httptools if installed)")
    ap.add_argument("--no-freeze", action="store_true", help="server ways without `logprobe serve`'s gc freeze "
                    "(cli.serve.freeze_heap: what exists once the model is loaded is never scanned again)")
    ap.add_argument("--profile-steps", action="store_true", help="profile the slowest replayed server step (CUDA)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for this process (the server's threads share its interpreter lock)")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
        print(f"interpreter switch interval {sys.getswitchinterval()} s")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if args.gpu_shape:
        if not args.checkpoint:
            ap.error("--gpu-shape needs --checkpoint DIR")
        write_checkpoint(args.gpu_shape, Path(args.checkpoint))
        model = args.checkpoint
    loaded = load_model(model, args.device, args.dtype, weights=args.weights)
    cfg = EngineConfig(deterministic=args.deterministic, progress=False)
    print(f"{loaded.info.name} on {args.device} ({loaded.info.dtype}, {args.weights} weights), "
          f"deterministic={args.deterministic}, "
          f"commit {git_rev()}, torch threads {torch.get_num_threads()}")
    bench_rl(loaded, cfg, args)
    if not (args.skip_server or args.skip_mc):
        bench_mc(loaded, cfg, args)


if __name__ == "__main__":
    main()
