"""GPU soak test of ``logprobe serve --deterministic`` (issue 23): C concurrent clients for D
seconds of mixed endpoints while another process takes most of the GPU's free memory part of the
time, then every answer is checked against the same request sent alone.

Set-up: a random-init bf16 Llama (default llama-1b, written once as a Hugging Face directory with
a byte-level tokenizer, bench/gpu_tp.py's ``write_checkpoint``) served on loopback by the real CLI
(``logprobe serve --model DIR --device cuda --deterministic``). A fixed pool of request bodies
(``--pool`` of them, seeded) over four endpoints:

* ``/v1/completions``: 1-4 token-id prompts of 32-4096 tokens, echo, ``logprobs`` 0-5, ``max_tokens`` 0/1;
* ``/v1/logprobs``: 1-8 RL sequences (prompt 64-2048, completion 16-2048 ids), temperature 1.0 or 0.7,
  ``top_k`` 0/5, entropy on or off;
* ``/v1/score``: a text prompt of 200-3000 characters and 1-4 continuations;
* ``/v1/perplexity``: 1-2 token-id texts of 1k-16k tokens, context 2048, stride 512.

Each client picks bodies from the pool at random until D seconds are up. Meanwhile the "squeezer"
(a second process on the same GPU) repeatedly allocates all but ``--leave-gib`` GiB of the free
memory for ``--squeeze-on`` seconds, then frees it for ``--squeeze-off`` seconds, starting before
the first request (so the server's caching allocator cannot reserve its working set in advance),
so batches run out of memory and the engine splits and retries them (its out-of-memory path
empties the allocator's cache, which the next squeeze takes). After the load: the squeezer stops, the
server's allocator counters are read (``/metrics``), and every distinct body is sent again alone,
one at a time; each 200 answer under load must be byte-identical (after dropping ``id`` and
``created``) to that body's lone answer. A 429 (queue full: back-pressure with a retry time) is
allowed and counted; any other 4xx, a 5xx or a lost request fails the run.

Printed: requests, statuses (5xx must be 0), lost (sent, never answered), mismatches against the
lone answers, out-of-memory recoveries the engine made, p50/p99 latency of the 200 answers overall
and per endpoint (clients are closed-loop: each sends its next request when the last is answered,
a 429 included, without waiting the retry time),
input tokens/s over the load, and CUDA memory allocated/reserved by the server at start (after
the first request) and at the end.

    python bench/gpu_soak.py                                 # 64 clients x 300 s, llama-1b
    python bench/gpu_soak.py --clients 8 --duration 20 --pool 40   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_checkpoint  # noqa: E402

GiB = 1 << 30
SQUEEZER = r"""
import sys, time, torch
leave, on, off = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
torch.cuda.init()
while True:
    held, t_end = [], time.time() + on
    while time.time() < t_end:  # keep taking what the server frees (its out-of-memory path empties its cache)
        free, _ = torch.cuda.mem_get_info()
        n = int(free - leave * (1 << 30))
        if n > 64 << 20:
            held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        time.sleep(0.2)
    print(f"squeeze: held {sum(x.numel() for x in held) / (1 << 30):.1f} GiB in {len(held)} pieces", flush=True)
    held.clear()
    torch.cuda.empty_cache()
    time.sleep(off)
"""


def log(*a):
    print(*a, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------- request pool

def make_pool(n: int, seed: int, vocab: int, scale: float = 1.0) -> list[tuple[str, dict, int]]:
    """``n`` (endpoint, body, input tokens) triples; token ids drawn below ``vocab`` (the
    byte-level tokenizer's size, so every id decodes); every length times ``scale``."""
    rng = random.Random(seed)
    randint = lambda a, b: max(2, int(rng.randint(a, b) * scale))  # noqa: E731
    ids = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    words = ["the", "model", "scores", "tokens", "of", "given", "text", "exactly", "and", "fast", "under",
             "memory", "pressure", "without", "losing", "answers", ",", "."]
    text = lambda chars: " ".join(rng.choice(words) for _ in range(chars // 5))  # noqa: E731
    pool = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            prompts = [ids(randint(32, 4096)) for _ in range(rng.randint(1, 4))]
            body = {"prompt": prompts, "echo": True, "logprobs": rng.randint(0, 5), "max_tokens": rng.randint(0, 1),
                    "temperature": 0}
            pool.append(("/v1/completions", body, sum(map(len, prompts))))
        elif kind == 1:
            seqs = [{"prompt_token_ids": ids(randint(64, 2048)), "completion_token_ids": ids(randint(16, 2048))}
                    for _ in range(rng.randint(1, 8))]
            body = {"sequences": seqs, "temperature": rng.choice([1.0, 0.7]), "top_k": rng.choice([0, 5]),
                    "entropy": rng.random() < 0.5}
            pool.append(("/v1/logprobs", body, sum(len(s["prompt_token_ids"]) + len(s["completion_token_ids"])
                                                   for s in seqs)))
        elif kind == 2:
            conts = [" " + text(randint(10, 200)) for _ in range(rng.randint(1, 4))]
            prompt = text(randint(200, 3000))
            pool.append(("/v1/score", {"prompt": prompt, "continuations": conts},
                         sum(len(prompt) + len(c) for c in conts)))  # bytes ~ tokens (byte-level tokenizer)
        else:
            texts = [ids(randint(1024, 16384)) for _ in range(rng.randint(1, 2))]
            pool.append(("/v1/perplexity", {"texts": texts, "context_length": randint(2048, 2048), "stride": randint(512, 512)},
                         sum(map(len, texts))))
    return pool


def digest(payload: bytes) -> str:
    """The answer without its per-request identity (``id``, ``created``), as a hash."""
    doc = json.loads(payload)
    if isinstance(doc, dict):
        doc.pop("id", None)
        doc.pop("created", None)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------------- load

async def post(session, url, endpoint, body):
    t0 = time.perf_counter()
    try:
        async with session.post(url + endpoint, json=body) as r:
            payload = await r.read()
            return r.status, payload, time.perf_counter() - t0
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"error:{type(e).__name__}", b"", time.perf_counter() - t0


async def load(url: str, pool, clients: int, duration: float, seed: int) -> dict:
    answers: list[tuple[int, object, str, float]] = []  # (pool index, status, digest, seconds)
    sent = 0
    stop_at = time.perf_counter() + duration

    async def client(i: int, session) -> None:
        nonlocal sent
        rng = random.Random(seed * 1000 + i)
        while time.perf_counter() < stop_at:
            k = rng.randrange(len(pool))
            endpoint, body, _ = pool[k]
            sent += 1
            status, payload, secs = await post(session, url, endpoint, body)
            answers.append((k, status, digest(payload) if status == 200 else payload[:300].decode(errors="replace"),
                            secs))

    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=duration + 600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=clients)) as s:
        await asyncio.gather(*[client(i, s) for i in range(clients)])
    return {"answers": answers, "sent": sent, "wall_s": time.perf_counter() - t0}


async def alone(url: str, pool) -> list[tuple[object, str]]:
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for endpoint, body, _ in pool:
            status, payload, _ = await post(s, url, endpoint, body)
            out.append((status, digest(payload) if status == 200 else payload[:300].decode(errors="replace")))
    return out


async def metrics(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def wait_up(url: str, proc: subprocess.Popen, errlog: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    async with aiohttp.ClientSession() as s:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise SystemExit("server exited:\n" + errlog.read_text()[-3000:])
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit("server did not come up")


# ---------------------------------------------------------------------------------------- report

def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def report(pool, res: dict, lone: list, m0: dict, m1: dict, args) -> dict:
    answers = res["answers"]
    statuses: dict[str, int] = {}
    for _, st, _, _ in answers:
        key = st if isinstance(st, str) else f"{st // 100}xx"
        statuses[key] = statuses.get(key, 0) + 1
    # a 429 (queue full, retry later) is back-pressure, not a wrong answer: only 200s are compared
    mismatched = [(k, st, d) for k, st, d, _ in answers if st == 200 and (st, d) != lone[k]]
    tokens = sum(pool[k][2] for k, st, _, _ in answers if st == 200)
    rows = {"clients": args.clients, "duration_s": args.duration, "pool": len(pool), "sent": res["sent"],
            "answered": len(answers), "lost": res["sent"] - len(answers), "statuses": statuses,
            "server_errors_5xx": statuses.get("5xx", 0), "mismatches_vs_alone": len(mismatched),
            "other_4xx": sum(1 for _, st, _, _ in answers if st != 200 and st != 429 and not isinstance(st, str)),
            "lone_statuses": sorted({str(st) for st, _ in lone}),
            "oom_recoveries": m1.get("logprobe_engine_out_of_memory", float("nan")),
            "wall_s": round(res["wall_s"], 1), "input_tokens_per_s": round(tokens / res["wall_s"]),
            "per_endpoint": {}, "memory": {}}
    # latency of the 200 answers (a 429 comes back at once and would drag the percentiles down)
    ok_lat = [a[3] for a in answers if a[1] == 200]
    rows.update(p50_ok_s=round(pct(ok_lat, 0.5), 3), p99_ok_s=round(pct(ok_lat, 0.99), 3))
    for ep in sorted({p[0] for p in pool}):
        lat = [a[3] for a in answers if pool[a[0]][0] == ep and a[1] == 200]
        rows["per_endpoint"][ep] = {"ok": len(lat), "p50_ok_s": round(pct(lat, 0.5), 3),
                                    "p99_ok_s": round(pct(lat, 0.99), 3)}
    for kind in ("allocated", "reserved"):
        key = f"logprobe_cuda_memory_{kind}_bytes"
        rows["memory"][kind] = {"start_gib": round(m0.get(key, 0) / GiB, 3), "end_gib": round(m1.get(key, 0) / GiB, 3)}
    rows["non_200_examples"] = sorted({f"{pool[k][0]} {st}: {d[:160]}" for k, st, d, _ in answers if st != 200})[:6]
    rows["mismatch_examples"] = [(pool[k][0], str(st), d[:200], str(lone[k])[:200]) for k, st, d in mismatched[:5]]
    return rows


# ------------------------------------------------------------------------------------------ main

async def soak(args, model_dir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    errlog = open(args.server_log, "w+")  # a file, not a pipe: a full pipe would block the server
    server = subprocess.Popen([sys.executable, "-m", "logprobe.cli.main", "serve", "--model", str(model_dir),
                               "--device", args.device, "--deterministic", "--port", str(port), "--log-level", "warning",
                               "--max-queue-requests", str(4 * args.clients), "--max-batch-tokens", str(args.batch_tokens)],
                              stdout=subprocess.DEVNULL, stderr=errlog, text=True, env=env)
    squeezer = None
    try:
        await wait_up(url, server, args.server_log)
        pool = make_pool(args.pool, args.seed, args.vocab, args.size_scale)
        m0 = await metrics(url)
        log(f"pool of {len(pool)} bodies; server up; allocated {m0.get('logprobe_cuda_memory_allocated_bytes', 0) / GiB:.2f} GiB")
        if args.device == "cuda":  # squeezing from the start: the server's allocator never holds enough in reserve
            squeezer = subprocess.Popen([sys.executable, "-c", SQUEEZER, str(args.leave_gib), str(args.squeeze_on),
                                         str(args.squeeze_off)], stdout=sys.stdout, stderr=sys.stderr)
            await asyncio.sleep(5)
        res = await load(url, pool, args.clients, args.duration, args.seed)
        if squeezer is not None:
            squeezer.terminate()
            squeezer.wait(timeout=30)
        await asyncio.sleep(2)
        m1 = await metrics(url)
        t0 = time.perf_counter()
        lone = await alone(url, pool)
        log(f"lone answers: {time.perf_counter() - t0:.1f} s")
        return report(pool, res, lone, m0, m1, args)
    finally:
        if squeezer is not None and squeezer.poll() is None:
            squeezer.kill()
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        errlog.close()
        err = args.server_log.read_text()
        if err.strip():
            log("server stderr (last 3000 chars):\n" + err[-3000:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--pool", type=int, default=240, help="distinct request bodies (default: %(default)s)")
    ap.add_argument("--model", default="llama-1b", help="random-init shape from bench/common.py's MODELS")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/logprobe-soak-model"))
    ap.add_argument("--leave-gib", type=float, default=0.5, help="GiB the squeezer leaves free")
    ap.add_argument("--squeeze-on", type=float, default=20.0)
    ap.add_argument("--squeeze-off", type=float, default=20.0)
    ap.add_argument("--vocab", type=int, default=259, help="token ids drawn below this (the byte tokenizer's size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-tokens", type=int, default=65536, help="the server's --max-batch-tokens: batches "
                    "larger than the squeezed memory holds, so out-of-memory splits happen (default: %(default)s)")
    ap.add_argument("--size-scale", type=float, default=1.0, help="multiply every request length (a small model's "
                    "context: 0.1)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run on an existing --model-dir, no squeezer")
    ap.add_argument("--server-log", type=Path, default=Path("/tmp/logprobe-soak-server.log"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    if not (args.model_dir / "config.json").exists():
        write_checkpoint(args.model, args.model_dir)
    log(f"checkpoint {args.model} at {args.model_dir} ({time.perf_counter() - t0:.0f} s)")
    rows = asyncio.run(soak(args, args.model_dir))
    log(json.dumps(rows, indent=1))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    ok = (rows["lost"] == 0 and rows["server_errors_5xx"] == 0 and rows["mismatches_vs_alone"] == 0
          and rows["other_4xx"] == 0
          and rows["lone_statuses"] == ["200"])  # every body is valid: each answers 200 when sent alone
    log("SOAK " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
