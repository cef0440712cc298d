"""What the prefix cache costs a real ``logprobe serve`` when nothing repeats, and what it buys when
prompts do: the numbers behind serve's default (off; docs/server.md, Prefix cache).

Each round starts two servers in turn (subprocesses, the default model on CPU), one with
``--prefix-cache off`` and one with ``--prefix-cache`` (the default budget: 512 MiB on CPU), and
sends each the same workloads from this process (a client, ``--in-flight`` requests outstanding),
the cache emptied (``/flush_cache``) before each workload:

* ``distinct``: lm-eval-style ``/v1/completions`` (echo, logprobs 1, max_tokens 0), one prompt of
  random token ids per request: no two share a prefix (but by chance a first token); with the
  cache, every request's keys/values are copied into the tree and, past 512 MiB, evicted;
* ``distinct+bos``: the same prompts behind one shared first token (a BOS, as Llama-3's
  tokenizer adds): once anything is cached, every request finds a 1-token prefix and the server's
  steps run as resumed packs;
* ``rl``: RL groups, one SGLang ``/generate`` per sample (``logprob_start_len`` at the response),
  in a random order: the samples of a group share their prompt.

Prints, per workload, each server's wall seconds per round, the median and the spread, the ratio
on/off of the medians, the server's CPU seconds, the hit rate and bytes the cache held, and each
server's resident memory (VmRSS at the end, VmHWM the peak) from ``/proc``. Rounds alternate off,
on. The machine may be shared: before each workload the script waits for the other work to stop
(``--quiet-wait``), counts the CPU seconds others took during it (``/proc/stat`` less the server's
and the client's), and leaves a run where they took over ``--busy`` seconds out of the medians.

    python bench/cpu_serve_prefix_default.py
    python bench/cpu_serve_prefix_default.py --rounds 2 --requests 24 --groups 2 --samples 4
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import requests
from common import git_rev

REPO = Path(__file__).resolve().parents[1]
VOCAB = 49152  # the default model's (SmolLM2-135M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli.main", "serve", "--port", str(port), "--device",
                             "cpu", "--log-level", "warning", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + proc.stderr.read())
        try:
            if requests.get(url + "/health", timeout=2).ok:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not come up")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def memory(pid: int) -> dict[str, float]:
    """The process's resident memory now and at its peak, MiB (/proc, Linux)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


TICK = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (f[0] + f[1] + f[2] + f[5] + f[6] + f[7]) / TICK  # user nice system irq softirq steal


def process_seconds(pid: int) -> float:
    """CPU seconds of one process (all its threads) so far (/proc/PID/stat: utime + stime)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def wait_quiet(limit: float) -> float:
    """Wait (at most ``limit`` s) until the machine's other work takes under 0.15 of a core over a
    second, the server being idle; returns the cores busy at the last look."""
    deadline = time.time() + limit
    while True:
        b = busy_seconds()
        time.sleep(1.0)
        cores = busy_seconds() - b
        if cores < 0.15 or time.time() > deadline:
            return cores
        time.sleep(4.0)


def prefix_metrics(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=30).text
    return {line.split()[0].removeprefix("logprobe_prefix_cache_"): float(line.split()[1])
            for line in text.splitlines() if line.startswith("logprobe_prefix_cache_")}


def workloads(args) -> dict[str, list[tuple[str, dict]]]:
    """name -> (route, body) per request, seeded: the same requests in every round and server."""
    rng = random.Random(args.seed)
    tok = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    lo, hi = args.prompt_tokens
    prompts = [tok(rng.randint(lo, hi)) for _ in range(args.requests)]
    completion = lambda ids: ("/v1/completions", {"prompt": [ids], "max_tokens": 0, "echo": True,  # noqa: E731
                                                  "logprobs": 1})
    rl = []
    for _ in range(args.groups):
        p = tok(rng.randint(args.prompt // 2, args.prompt))
        for _ in range(args.samples):
            ids = p + tok(rng.randint(max(1, args.response // 4), args.response))
            rl.append(("/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": len(p) - 1,
                                     "sampling_params": {"max_new_tokens": 0}}))
    rng.shuffle(rl)
    return {"distinct": [completion(p) for p in prompts],
            "distinct+bos": [completion([1] + p) for p in prompts],
            "rl": rl}


def drive(url: str, bodies: list[tuple[str, dict]], in_flight: int) -> float:
    """Wall seconds from the first request sent to the last answer (every answer 200)."""
    with requests.Session() as http:
        http.mount("http://", requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=in_flight))

        def send(item: tuple[str, dict]) -> None:
            r = http.post(url + item[0], json=item[1], timeout=600)
            if r.status_code != 200:
                raise RuntimeError(f"{item[0]}: {r.status_code} {r.text[:300]}")

        with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
            t = time.perf_counter()
            list(pool.map(send, bodies))
            return time.perf_counter() - t


def one_server(label: str, flags: list[str], loads: dict, args) -> dict:
    proc, url = start_server(flags)
    try:
        drive(url, loads["distinct"][:4], args.in_flight)  # warm-up
        out = {}
        for name, bodies in loads.items():
            requests.post(url + "/flush_cache", timeout=60)
            before = prefix_metrics(url)
            quiet = wait_quiet(args.quiet_wait)
            b_all, b_server, b_me = busy_seconds(), process_seconds(proc.pid), sum(os.times()[:2])
            secs = drive(url, bodies, args.in_flight)
            server = process_seconds(proc.pid) - b_server
            others = busy_seconds() - b_all - server - (sum(os.times()[:2]) - b_me)
            after = prefix_metrics(url)
            looked = after.get("lookup_tokens", 0) - before.get("lookup_tokens", 0)
            cached = after.get("cached_tokens", 0) - before.get("cached_tokens", 0)
            out[name] = {"s": secs, "hit_rate": cached / looked if looked else 0.0,
                         "mib": after.get("bytes", 0) / 2**20, "max_mib": after.get("max_bytes", 0) / 2**20,
                         "evicted": after.get("evicted_tokens", 0) - before.get("evicted_tokens", 0),
                         "server_cpu": server, "others_cpu": others, "quiet": quiet}
            print(f"  {label} {name}: {secs:.2f} s, server CPU {server:.1f} s, others' CPU {others:.1f} s "
                  f"(before: {quiet:.2f} cores busy)", file=sys.stderr, flush=True)
        out["memory"] = memory(proc.pid)
        return out
    finally:
        stop(proc)


def spread(xs: list[float]) -> str:
    return f"{median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]" if xs else "-"


def report(results: dict[str, list[dict]], loads: dict, args) -> None:
    print(f"\nlogprobe serve, default model on CPU ({os.cpu_count()} cores), commit {git_rev()}, {args.rounds} rounds "
          f"(off, on alternating), {args.in_flight} requests in flight")
    for name, bodies in loads.items():
        tokens = sum(len(b.get("input_ids") or b["prompt"][0]) for _, b in bodies)
        print(f"{name}: {len(bodies)} requests, {tokens} input tokens")
    print("\n| workload | off: wall s, median [min-max] | on: wall s, median [min-max] | on / off | server CPU s "
          "off / on (medians) | others' CPU s, most in a run | hit rate | MiB held (budget) | tokens evicted |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in loads:
        quiet = {k: [r[name] for r in results[k] if r[name]["others_cpu"] <= args.busy] for k in ("off", "on")}
        off, on = ([r["s"] for r in quiet[k]] for k in ("off", "on"))
        if not off or not on:
            print(f"| {name} | every run of one side was busy: rerun | | | | | | | |")
            continue
        cpu_off, cpu_on = (median(r["server_cpu"] for r in quiet[k]) for k in ("off", "on"))
        others = max(r[name]["others_cpu"] for k in ("off", "on") for r in results[k])
        left = sum(len(results[k]) - len(quiet[k]) for k in ("off", "on"))
        if left:
            print(f"{name}: {left} runs left out of the medians (others took over {args.busy:g} CPU s)")
        last = results["on"][-1][name]
        print(f"| {name} | {spread(off)} | {spread(on)} | {median(on) / median(off):.3f} | {cpu_off:.1f} / "
              f"{cpu_on:.1f} ({cpu_on / cpu_off:.3f}) | {others:.1f} | {last['hit_rate']:.3f} | {last['mib']:.0f} "
              f"({last['max_mib']:.0f}) | {last['evicted']:.0f} |")
    for label in ("off", "on"):
        rss = [r["memory"]["VmRSS"] for r in results[label]]
        hwm = [r["memory"]["VmHWM"] for r in results[label]]
        print(f"server resident memory, cache {label}: end {spread(rss)} MiB, peak {spread(hwm)} MiB")
    print("per round (off/on, s): " + "; ".join(
        f"{name}: " + ", ".join(f"{a[name]['s']:.2f}/{b[name]['s']:.2f}" for a, b in zip(results["off"], results["on"]))
        for name in loads))


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=48, help="distinct prompts (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=_range, default=(128, 512), metavar="MIN,MAX",
                    help="tokens per distinct prompt, uniform (default: 128,512)")
    ap.add_argument("--groups", type=int, default=4, help="RL prompts (default: %(default)s)")
    ap.add_argument("--samples", type=int, default=8, help="responses per RL prompt (default: %(default)s)")
    ap.add_argument("--prompt", type=int, default=512, help="RL prompt tokens, at most (default: %(default)s)")
    ap.add_argument("--response", type=int, default=256, help="RL response tokens, at most (default: %(default)s)")
    ap.add_argument("--in-flight", type=int, default=8, help="requests outstanding (default: %(default)s)")
    ap.add_argument("--quiet-wait", type=float, default=600.0, metavar="S",
                    help="before each workload, wait up to S s for the machine's other work to stop (default: 600)")
    ap.add_argument("--busy", type=float, default=2.0, metavar="S",
                    help="a run during which other processes took more than S CPU seconds is left out of the "
                         "medians (default: %(default)s)")
    ap.add_argument("--json", type=Path, default=None, help="also write every run's numbers here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    loads = workloads(args)
    results: dict[str, list[dict]] = {"off": [], "on": []}
    for k in range(args.rounds):
        for label, flags in (("off", ["--prefix-cache", "off"]), ("on", ["--prefix-cache"])):
            print(f"round {k + 1}/{args.rounds}, prefix cache {label}", file=sys.stderr, flush=True)
            results[label].append(one_server(label, flags, loads, args))
    report(results, loads, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
