"""Are small passes host-bound, and do CUDA graphs (``EngineConfig.cuda_graph_tokens``) fix it?

W1 (RL groups: 32 prompts x 8 sampled responses, 480k input ids) on a random-weight model built on
the GPU (``--shape``, ``load_format="dummy"``, bf16), with the prefix cache, three ways:

1. one batch of every request (the reference: each prompt shared in-batch by its 8 responses);
2. one request per call, in group order (a framework sending each sample alone: each group's
   prompt cached by its first sample, the others resumed from it): wall, × the one batch;
3. ``--per-call`` requests per call in a shuffled order (what a batching server takes from its
   queue): wall, × the one batch;

(``--server``: 4. one SGLang ``/generate`` request per sample, ``--in-flight`` outstanding, through the
real app on uvicorn, the client in a process of its own, with ``ServerConfig.pipeline_steps`` off and
on: × the library's one batch, and the engine steps the batcher ran), then the GPU's
busy share of a cached single call: kernel time over ``--profile-calls`` single
calls under torch.profiler, divided by the same calls' wall time without it. Each with CUDA graphs
(the default) and without (``cuda_graph_tokens=0``), in default and deterministic mode; every
number of a graphed way against the eager way's (max |diff|; deterministic: bitwise), and, as the
scale of default mode's own rounding, each way's one batch against its single calls. Targets
(docs/perf.md): one request per call within 1.1x of the one batch, a cached single call >= 80% busy.
"captures (s)": buckets captured and their time (each bucket's first pass; warm-up passes included).

    python bench/gpu_small_passes.py                                  # llama-8b shape, one H200
    python bench/gpu_small_passes.py --shape llama-1b --modes default
    python bench/gpu_small_passes.py --shape qwen3-30b-a3b --modes default       # a mixture of experts
    python bench/gpu_small_passes.py --shape llama-8b --modes default --server   # and through the server
    python bench/gpu_small_passes.py --shape llama-8b --server-only --in-flight 16,64   # the server rows alone
    python bench/gpu_small_passes.py --shape tiny --device cpu --limit 24 --profile-calls 4   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import random
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from common import MODELS, QWEN3_30B_A3B, GiB, TritonBuilds, free, log, sync, sync_time, workload

from logprobe import EngineConfig, Scorer
from logprobe.loading import load_model

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=8192, rms_norm_eps=1e-5)
# mixtures of experts (transformers config class, kwargs): Qwen3-30B-A3B's shape, and a tiny one
MOE = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "tiny-moe": ("Qwen3MoeConfig", dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
}


def write_config(shape: str, path: str) -> None:
    """config.json and a byte tokenizer: the weights are built at random where they run."""
    import transformers as tf
    from common import byte_tokenizer

    if shape in MOE:
        cls, kw = MOE[shape]
        cfg = getattr(tf, cls)(**kw, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
    else:
        kw = TINY if shape == "tiny" else MODELS[shape]
        cfg = tf.LlamaConfig(**kw, bos_token_id=1, eos_token_id=2)
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


def git_rev() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    return os.environ.get("LOGPROBE_COMMIT") or r.stdout.strip() or "unknown"  # a copy's .git may be stale


def kernel_seconds(device: str, fn) -> float | None:
    """GPU kernel time of ``fn`` (torch.profiler's CUDA activity, graph replays' kernels included)."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6


# an RL framework's async client, in processes of their own (stdlib only: its JSON work and sockets
# must not share the server's interpreter lock, nor one client's threads one lock: 64 threads of one
# process wait their turn at it): argv = url, bodies.json, requests outstanding, this process's index,
# the processes, the CLOCK_MONOTONIC instant to start at; prints its seconds, log-probs and its start
# and end. A rollout worker's client is long-lived: each process sends one GET /health first (its
# opener and its first connection made), then all start together at the given instant, so the
# clock measures the server, not Python starting eight processes
CLIENT = r"""
import concurrent.futures, json, sys, time, urllib.request
url, bodies, flight, i, n = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
bodies = [json.dumps(b).encode() for b in bodies[i::n]]
def send(body):
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        assert r.status == 200, r.status
        return len(json.loads(r.read())["meta_info"]["input_token_logprobs"])
urllib.request.urlopen(url + "/health", timeout=60).read()
with concurrent.futures.ThreadPoolExecutor(max(1, flight // n)) as pool:
    time.sleep(max(0.0, float(sys.argv[6]) - time.monotonic()))
    t = time.monotonic()
    k = sum(pool.map(send, bodies))
print(time.monotonic() - t, k, t, time.monotonic())
"""


def run_clients(url: str, bodies: str, in_flight: int, processes: int,
                lead: float = 2.0) -> tuple[tuple[float, float], float, int]:
    """``CLIENT`` in ``processes`` processes (``in_flight`` requests outstanding in all), started
    together ``lead`` seconds from now: ((first start, last start), last end, log-probs answered)."""
    import sys

    start_at = str(time.monotonic() + lead)
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, url, bodies, str(in_flight), str(i), str(processes),
                               start_at], stdout=subprocess.PIPE, text=True) for i in range(processes)]
    outs = [p.communicate()[0].split() for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a client process failed")
    return (min(float(o[2]) for o in outs), max(float(o[2]) for o in outs)), max(float(o[3]) for o in outs), \
        sum(int(o[1]) for o in outs)


class GilProbe(threading.Thread):
    """How long a thread of this process waits for the interpreter lock: it sleeps 1 ms in a loop
    and records each wake-up's lateness (a sleep releases the lock; waking takes it back)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.late: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            self.late.append(time.perf_counter() - t - 0.001)

    def summary(self) -> tuple[float, float]:
        """(mean, 99th percentile) lateness in ms."""
        self.stop.set()
        self.join()
        late = sorted(self.late) or [0.0]
        return sum(late) / len(late) * 1e3, late[int(0.99 * (len(late) - 1))] * 1e3


def through_server(loaded, reqs, args, graphs: int, pipeline: bool = False, in_flight: int = 64,
                   switch: float | None = None) -> dict:
    """W1 as one SGLang ``/generate`` request per sample (``logprob_start_len`` at the response),
    ``in_flight`` outstanding, through the real app on uvicorn (the server's batcher packs what is
    queued into one engine call; ``pipeline``: ``ServerConfig.pipeline_steps``): the client's wall
    seconds, and the engine steps' count, mean requests and summed seconds (the batcher's own
    ``StepStats``: the engine's busy time as the server saw it). ``switch``: the interpreter's switch
    interval while the app runs (``ServerConfig.switch_interval``; None: the server's default)."""
    import json
    import socket

    import uvicorn

    from logprobe.server import ServerConfig, create_app

    s = Scorer(loaded, config=EngineConfig(cuda_graph_tokens=graphs), prefix_cache=True)
    s.engine.run(reqs[:16])  # warm, as the library ways
    s.engine.prepare_graphs()  # every bucket captured before the clock starts (Scorer.warmup's)
    s.prefix_cache.clear()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = ServerConfig(pipeline_steps=pipeline)
    app = create_app(s, config if switch is None else dataclasses.replace(config, switch_interval=switch))
    steps, arrivals = [], []
    batcher = app.state.batcher
    observe, submit = batcher.on_step, batcher.submit_tagged
    batcher.on_step = lambda st: (steps.append((time.monotonic(), st)), observe(st))

    async def arriving(*a, **k):  # when each request reached the queue (after HTTP, JSON, checks)
        arrivals.append(time.monotonic())
        return await submit(*a, **k)
    batcher.submit_tagged = arriving
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        bodies = [{"input_ids": r.tokens, "return_logprob": True, "logprob_start_len": r.score_begin - 1,
                   "sampling_params": {"max_new_tokens": 0}} for r in reqs]
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(bodies, f)
        probe = GilProbe()
        probe.start()
        captured = s.engine.graphs.captures if s.engine.graphs else 0
        with TritonBuilds() as built:
            starts, end, answered = run_clients(f"http://127.0.0.1:{port}", f.name, in_flight, args.clients)
        captured = (s.engine.graphs.captures if s.engine.graphs else 0) - captured
        start = starts[0]
        gil = probe.summary()
        if answered < sum(len(r.tokens) - r.score_begin for r in reqs):
            raise SystemExit(f"the server answered {answered} log-probs, fewer than were asked")
        first = steps[0][0] - steps[0][1].seconds
        busy = sum(st.seconds for _, st in steps)
        return dict(wall=end - start, steps=len(steps), requests=sum(st.requests for _, st in steps) / len(steps),
                    busy=busy, head=first - start, between=steps[-1][0] - first - busy, tail=end - steps[-1][0],
                    gil=gil, arrive=min(arrivals) - start, spread=starts[1] - start, built=built.names,
                    captured=captured)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        s.close()


def one_mode(loaded, reqs, args, det: bool, graphs: int) -> dict:
    cfg = EngineConfig(deterministic=det, cuda_graph_tokens=graphs)
    s = Scorer(loaded, config=cfg, prefix_cache=True)
    eng = s.engine
    eng.run(reqs[:16])  # warm: kernels compiled, graphs of the common buckets captured
    s.prefix_cache.clear()
    batch, batch_s = sync_time(lambda: eng.run(reqs))
    s.prefix_cache.clear()
    single, single_s = sync_time(lambda: [eng.run([r])[0] for r in reqs])
    s.prefix_cache.clear()
    order = list(range(len(reqs)))
    random.Random(0).shuffle(order)
    groups = [order[i:i + args.per_call] for i in range(0, len(order), args.per_call)]
    _, packed_s = sync_time(lambda: [eng.run([reqs[i] for i in g]) for g in groups])
    # cached single calls: later samples of the first groups, their prompts cached by the first
    s.prefix_cache.clear()
    eng.run([reqs[i] for i in range(0, len(reqs), 8)])
    calls = [r for i, r in enumerate(reqs) if i % 8][:args.profile_calls]
    _, wall = sync_time(lambda: [eng.run([r]) for r in calls])
    s.prefix_cache.clear()
    eng.run([reqs[i] for i in range(0, len(reqs), 8)])
    kern = kernel_seconds(args.device, lambda: [eng.run([r]) for r in calls])
    g = eng.graphs
    out = dict(batch=batch_s, single=single_s, packed=packed_s, call_ms=wall / len(calls) * 1e3,
               busy=None if kern is None else kern / wall, single_results=[x.logprobs for x in single],
               batch_gap=max(float((a.logprobs.float() - b.logprobs.float()).abs().max()) for a, b in zip(batch, single)),
               captures=g.captures if g else 0, capture_s=g.capture_seconds if g else 0.0,
               replays=g.replays if g else 0,
               failed=g.failed if g else None)
    s.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-8b", choices=["tiny", *MODELS, *MOE])
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default="default,det")
    p.add_argument("--per-call", type=int, default=16)
    p.add_argument("--profile-calls", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="the first N requests of W1 (a smoke run)")
    p.add_argument("--server", action="store_true", help="also W1 through `logprobe serve`'s app, default mode")
    p.add_argument("--in-flight", default="64", help="with --server: requests outstanding at once (a comma list)")
    p.add_argument("--clients", type=int, default=8, help="with --server: client processes sharing --in-flight")
    p.add_argument("--switch-ms", default="", help="with --server: the server's interpreter switch interval(s) "
                   "in ms (ServerConfig.switch_interval; a comma list; empty: the server's default; 5 is Python's)")
    p.add_argument("--repeat", type=int, default=1, help="with --server: each row this many times (interleaved)")
    p.add_argument("--server-only", action="store_true",
                   help="only the library's one batch (graphs on, best of 2) and the server rows")
    args = p.parse_args()
    dev = args.device
    log(f"# small passes: {args.shape}, {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, "
        f"commit {git_rev()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        write_config(args.shape, tmp)
        t0 = time.perf_counter()
        loaded = load_model(tmp, device=dev, dtype="bfloat16" if dev == "cuda" else "float32", load_format="dummy")
        log(f"random weights built in {time.perf_counter() - t0:.1f} s"
            + (f", {torch.cuda.memory_allocated() / GiB:.1f} GiB" if dev == "cuda" else ""))
        reqs = workload("W1", loaded.model.config.vocab_size)[:args.limit]
        log(f"W1: {len(reqs)} requests, {sum(len(r.tokens) for r in reqs):,} ids")
        if args.server_only:
            server_rows(loaded, reqs, args, batch_only(loaded, reqs))
            return
        log("| mode | graphs | one batch s | one per call s (×) | "
            f"{args.per_call} per call s (×) | cached single call ms | GPU busy | captures (s) | max |diff| vs eager | max |diff| one batch vs one per call |")
        log("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        batch_default = {}
        for mode in args.modes.split(","):
            det = mode == "det"
            eager = one_mode(loaded, reqs, args, det, 0)
            free()
            graphed = one_mode(loaded, reqs, args, det, EngineConfig().cuda_graph_tokens)
            free()
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in
                       zip(eager["single_results"], graphed["single_results"]))
            if mode == "default":
                batch_default = {0: eager["batch"], EngineConfig().cuda_graph_tokens: graphed["batch"]}
            for name, r in (("off", eager), ("on", graphed)):
                busy = "n/a" if r["busy"] is None else f"{r['busy']:.0%}"
                d = "" if name == "off" else (f"{diff:.3g}" + (" (bitwise)" if diff == 0 else ""))
                note = f" (failed: {r['failed']})" if r["failed"] else ""
                log(f"| {mode} | {name}{note} | {r['batch']:.2f} | {r['single']:.2f} ({r['single'] / r['batch']:.2f}×) | "
                    f"{r['packed']:.2f} ({r['packed'] / r['batch']:.2f}×) | {r['call_ms']:.1f} | {busy} | "
                    f"{r['captures']} ({r['capture_s']:.1f}) | {d} | {r['batch_gap']:.3g} |")

        if args.server and batch_default:
            server_rows(loaded, reqs, args, batch_default)


def server_rows(loaded, reqs, args, batch_default: dict) -> None:
    """W1 through the server against the library's one batch, pipelined steps off and on, at each
    ``--in-flight`` count; the engine's steps as the batcher saw them."""
    from logprobe.server import ServerConfig

    log("\nW1 through the server: one /generate request per sample, N outstanding, default mode, against the "
        "library's one batch of the same graphs setting; engine busy = the batcher's steps' summed time")
    log("wall = the client's; before first step / between steps / after last: the engine idle (from the client's "
        "start to the first step's, between steps, from the last step's end to the client's last answer); "
        "lock wait: a 1 ms sleeper thread's lateness in the server's process, mean / 99th percentile; "
        "before = start spread (the last client process's start; all warm, set to start together) / first "
        "request queued (after its HTTP, JSON and checks) / first step begun, each from the first client's start")
    log(f"client: {args.clients} processes; switch: the server's interpreter switch interval "
        "(ServerConfig.switch_interval, ms)")
    log("| graphs | pipelined steps | in flight | switch ms | server s | one batch s | × | steps | requests / step | "
        "engine busy s (share of wall) | idle before / between / after s | lock wait ms | before: spread / queued / step s | "
        "built in the run: Triton kernels / graphs |")
    log("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    flights = [int(x) for x in str(args.in_flight).split(",")]
    switches = [float(x) / 1e3 for x in args.switch_ms.split(",")] if args.switch_ms else [None]
    for graphs, one in batch_default.items():
        # a first server run in the process is slower (imports, the first requests' paths): not counted,
        # shown; in the server's default mode (steps not pipelined)
        r = through_server(loaded, reqs, args, graphs, False, flights[0], switches[0])
        free()
        log(f"| (warm-up, not counted) | off | {flights[0]} | | {r['wall']:.2f} | {one:.2f} | {r['wall'] / one:.2f}× | "
            f"{r['steps']} | {r['requests']:.1f} | {r['busy']:.2f} | | | | {len(r['built'])} / {r['captured']} |")
        for _, flight, switch, pipeline in itertools.product(range(args.repeat), flights, switches, (False, True)):
            r = through_server(loaded, reqs, args, graphs, pipeline, flight, switch)
            free()
            ms = (switch if switch is not None else ServerConfig().switch_interval) * 1e3
            log(f"| {'on' if graphs else 'off'} | {'on' if pipeline else 'off'} | {flight} | {ms:g} | "
                f"{r['wall']:.2f} | {one:.2f} | {r['wall'] / one:.2f}× | {r['steps']} | {r['requests']:.1f} | "
                f"{r['busy']:.2f} ({r['busy'] / r['wall']:.0%}) | {r['head']:.2f} / {r['between']:.2f} / "
                f"{r['tail']:.2f} | {r['gil'][0]:.2f} / {r['gil'][1]:.1f} | "
                f"{r['spread']:.3f} / {r['arrive']:.3f} / {r['head']:.3f} | "
                f"{len(r['built'])} {','.join(sorted(set(r['built'])))} / {r['captured']} |")


def batch_only(loaded, reqs) -> dict:
    """``--server-only``: the library's one batch (default mode, graphs on), best of 2."""
    s = Scorer(loaded, prefix_cache=True)
    s.engine.run(reqs[:16])
    times = []
    for _ in range(2):
        s.prefix_cache.clear()
        times.append(sync_time(lambda: s.engine.run(reqs))[1])
    s.close()
    return {EngineConfig().cuda_graph_tokens: min(times)}


if __name__ == "__main__":
    main()
