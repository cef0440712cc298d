"""Bounded load test of ``logprobe serve`` on loopback: C concurrent clients for D seconds.

Starts the real server (a subprocess), drives it with lm-eval-style ``/v1/completions`` requests
(token-id prompts, echo, logprobs 1, max_tokens 1; 1-4 prompts of 32-256 tokens each, cut from a
text), stops sending after D seconds, waits for every answer, and prints throughput as all answers
over the whole wall time (load + drain of the requests in flight: the work done per second), the
same counted only within the D seconds ("in window": round-robin batching finishes many requests
together, so it favours FIFO), p50/p99 latency and status/error counts (``lost`` = sent, never
answered). It runs
twice: with continuous batching (the default) and with ``--no-batching`` (one HTTP request per
engine step), and prints the throughput ratio.

    .venv/bin/python bench/server_load.py                   # 64 clients x 60 s, both modes
    .venv/bin/python bench/server_load.py --clients 8 --duration 10 --modes batching
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2-raw-v1" / "wiki.test.raw"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "logprobe.cli.main", "serve", "--port", str(port), "--device", "cpu",
           "--log-level", "warning", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


async def wait_up(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    async with aiohttp.ClientSession() as s:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("server exited:\n" + proc.stderr.read())
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError("server did not come up")


async def run_load(url: str, stream: list[int], clients: int, duration: float, seed: int,
                   prompt_tokens: tuple[int, int], n_prompts: tuple[int, int]) -> dict:
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    tokens = 0
    in_window = [0, 0]  # requests, tokens answered OK before the load stopped (steady-state throughput)
    sent = answered = 0
    stop_at = time.perf_counter() + duration

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        nonlocal tokens, sent, answered
        rng = random.Random(seed * 1000 + i)
        while time.perf_counter() < stop_at:
            prompts = []
            for _ in range(rng.randint(*n_prompts)):
                n = rng.randint(*prompt_tokens)
                start = rng.randrange(0, len(stream) - n)
                prompts.append(stream[start:start + n])
            body = {"model": "smollm2-135m", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
                    "seed": 1234, "echo": True}
            t0 = time.perf_counter()
            sent += 1
            try:
                async with session.post(url + "/v1/completions", json=body) as r:
                    payload = await r.read()
                    key = f"{r.status // 100}xx"
                    if r.status == 200:
                        out = json.loads(payload)
                        if len(out["choices"]) != len(prompts):
                            key = "bad_reply"
                        tokens += out["usage"]["prompt_tokens"]
                        if time.perf_counter() <= stop_at:
                            in_window[0] += 1
                            in_window[1] += out["usage"]["prompt_tokens"]
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                key = f"error:{type(e).__name__}"
            answered += key != "error"
            statuses[key] = statuses.get(key, 0) + 1
            latencies.append(time.perf_counter() - t0)

    t_start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=duration + 300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=clients)) as session:
        await asyncio.gather(*[client(i, session) for i in range(clients)])
    wall = time.perf_counter() - t_start
    latencies.sort()
    ok = statuses.get("2xx", 0)

    def pct(p):
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else float("nan")

    return {"requests": sent, "ok": ok, "statuses": statuses, "lost": sent - sum(statuses.values()),
            "wall_s": wall, "req_per_s": ok / wall, "tokens_per_s": tokens / wall,
            "window_req_per_s": in_window[0] / duration, "window_tokens_per_s": in_window[1] / duration,
            "drain_s": wall - duration, "p50_s": pct(0.50),
            "p99_s": pct(0.99)}


async def metrics_summary(url: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    out = {}
    for line in text.splitlines():
        for name in ("logprobe_batch_http_requests_sum", "logprobe_batch_http_requests_count",
                     "logprobe_batch_tokens_sum"):
            if line.startswith(name + " "):
                out[name] = float(line.split()[1])
    steps = out.get("logprobe_batch_http_requests_count", 0) or 1
    return {"engine_steps": int(steps), "http_requests_per_step": out.get("logprobe_batch_http_requests_sum", 0) / steps,
            "tokens_per_step": out.get("logprobe_batch_tokens_sum", 0) / steps}


async def one_mode(mode: str, args, stream: list[int]) -> dict:
    port = free_port()
    proc = start_server(port, ["--no-batching"] if mode == "no-batching" else [])
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_up(url, proc)
        res = await run_load(url, stream, args.clients, args.duration, args.seed, args.prompt_tokens, args.prompts)
        res.update(await metrics_summary(url))
        return res
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def token_stream(path: Path, max_chars: int) -> list[int]:
    # the default model's tokenizer only (the server loads the same one)
    from logprobe.loading.gguf import gguf_reader, gguf_tokenizer
    from logprobe.loading.loader import resolve_spec

    gguf = resolve_spec(None)
    tok = gguf_tokenizer(gguf, gguf_reader(gguf))
    return tok.encode(path.read_text(encoding="utf-8")[:max_chars])


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per mode (default: 60)")
    ap.add_argument("--modes", default="batching,no-batching")
    ap.add_argument("--text-file", type=Path, default=WIKITEXT, help="text the prompts are cut from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-tokens", type=_range, default=(32, 256), metavar="MIN,MAX",
                    help="tokens per prompt, uniform (default: 32,256)")
    ap.add_argument("--prompts", type=_range, default=(1, 4), metavar="MIN,MAX",
                    help="prompts per request, uniform (default: 1,4)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    if not args.text_file.exists():
        print(f"server_load: --text-file {args.text_file} does not exist", file=sys.stderr)
        return 2
    stream = token_stream(args.text_file, 400_000)
    results = {}
    for mode in args.modes.split(","):
        print(f"[{mode}] {args.clients} clients x {args.duration:.0f} s ...", file=sys.stderr, flush=True)
        results[mode] = asyncio.run(one_mode(mode, args, stream))
    print(f"\nlogprobe serve load test: {args.clients} concurrent clients, {args.duration:.0f} s per mode, "
          f"CPU ({os.cpu_count()} cores), default model, lm-eval-style /v1/completions, "
          f"{args.prompts[0]}-{args.prompts[1]} prompts of {args.prompt_tokens[0]}-{args.prompt_tokens[1]} "
          "tokens per request\n")
    cols = ["mode", "req/s", "tokens/s", "in-window tokens/s", "wall s", "p50 s", "p99 s", "sent", "ok", "4xx", "5xx", "errors", "lost",
            "HTTP req/step", "tokens/step"]
    print(" | ".join(cols))
    for mode, r in results.items():
        st = r["statuses"]
        errors = sum(v for k, v in st.items() if k.startswith("error") or k == "bad_reply")
        print(" | ".join([mode, f"{r['req_per_s']:.2f}", f"{r['tokens_per_s']:.0f}",
                          f"{r['window_tokens_per_s']:.0f}", f"{r['wall_s']:.1f}", f"{r['p50_s']:.2f}",
                          f"{r['p99_s']:.2f}", str(r["requests"]), str(r["ok"]), str(st.get("4xx", 0)), str(st.get("5xx", 0)),
                          str(errors), str(r["lost"]), f"{r['http_requests_per_step']:.1f}",
                          f"{r['tokens_per_step']:.0f}"]))
    if "batching" in results and "no-batching" in results:
        ratio = results["batching"]["tokens_per_s"] / results["no-batching"]["tokens_per_s"]
        print(f"\nbatching / no-batching throughput: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
