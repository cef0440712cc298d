"""The server's own cost per request, apart from the model: ``logprobe serve`` on a tiny random
Llama (2 layers, hidden 64: the forward pass is cheap, so what is measured is HTTP, validation,
batching, result conversion and JSON), C closed-loop clients posting RL-style ``/v1/logprobs``
bodies (8 sequences of 64 + 64 ids, top-5) for D seconds.

``--baseline-src DIR`` also serves from another checkout's ``src`` (e.g. ``git worktree add
/tmp/before HEAD~1``) in the same run, alternating, and prints the ratio.

    .venv/bin/python bench/server_overhead.py --clients 16 --duration 20
    .venv/bin/python bench/server_overhead.py --baseline-src /tmp/before/src
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
CLI = "import sys; from logprobe.cli.main import main; sys.exit(main(sys.argv[1:]))"


def tiny_model(path: Path) -> None:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models

    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    vocab = {f"<{i}>": i for i in range(300)}
    tf.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<0>")),
                               bos_token="<1>", eos_token="<2>").save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def load(url: str, clients: int, duration: float) -> tuple[int, float]:
    rng = random.Random(0)
    done = 0

    async def client() -> None:
        nonlocal done
        async with aiohttp.ClientSession() as s:
            end = time.monotonic() + duration
            while time.monotonic() < end:
                seqs = [{"prompt_token_ids": [rng.randrange(3, 290) for _ in range(64)],
                         "completion_token_ids": [rng.randrange(3, 290) for _ in range(64)]} for _ in range(8)]
                async with s.post(url + "/v1/logprobs", json={"sequences": seqs, "top_k": 5}) as r:
                    await r.read()
                    if r.status != 200:
                        raise SystemExit(f"HTTP {r.status}")
                done += 1

    t = time.monotonic()
    await asyncio.gather(*[client() for _ in range(clients)])
    return done, time.monotonic() - t


async def wait_up(url: str, proc: subprocess.Popen) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit("the server exited")
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit("the server did not come up")


def serve_and_load(src: Path, model: Path, clients: int, duration: float) -> float:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(src))
    proc = subprocess.Popen([sys.executable, "-c", CLI, "serve", "--model", str(model), "--device", "cpu", "--dtype",
                             "float32", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_up(url, proc))
        asyncio.run(load(url, clients, 2.0))  # warm-up
        n, dt = asyncio.run(load(url, clients, duration))
        return n / dt
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per source")
    ap.add_argument("--baseline-src", type=Path, default=None, help="another checkout's src/ to compare with")
    args = ap.parse_args()
    sources = {"this": REPO / "src"}
    if args.baseline_src is not None:
        sources = {"baseline": args.baseline_src, **sources}
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "tiny"
        tiny_model(model)
        rates: dict[str, list[float]] = {k: [] for k in sources}
        for _ in range(args.rounds):
            for name, src in sources.items():
                rates[name].append(serve_and_load(src, model, args.clients, args.duration))
                print(f"{name}: {rates[name][-1]:.1f} req/s", flush=True)
    print(f"\n{args.clients} clients x {args.duration:.0f} s, /v1/logprobs of 8 x (64 + 64) ids, top-5, CPU float32")
    print("| server | req/s (best of rounds) | input tok/s | vs baseline |\n| --- | ---: | ---: | ---: |")
    base = max(rates["baseline"]) if "baseline" in rates else None
    for name, r in rates.items():
        ratio = f"{max(r) / base:.2f}x" if base else "-"
        print(f"| {name} | {max(r):.1f} | {max(r) * 8 * 128:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
