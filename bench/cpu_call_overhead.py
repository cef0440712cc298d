"""The host's fixed cost of one engine call: ``Scorer(...).engine.run([req])`` for one short
request (8 prompt + 8 response ids) on a tiny random Llama (``--layers``, 2 by default; hidden 64, vocab 512,
float32 on the CPU), whose compute is negligible, so what is timed is the planning, the attention
plans, the head call, result delivery and the per-layer Python. Default engine and
``prefix_cache=True`` (the RL group's 8 responses share a prompt, so from the second call on a
request resumes from its cached prompt), default and deterministic mode. Prints the median
milliseconds per call over ``--calls`` calls; ``--profile`` adds cProfile's top functions per call.

    python bench/cpu_call_overhead.py --calls 400
    python bench/cpu_call_overhead.py --calls 400 --layers 32
    python bench/cpu_call_overhead.py --calls 200 --profile 25
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import byte_tokenizer, git_rev  # noqa: E402

from logprobe import Scorer  # noqa: E402
from logprobe.engine.request import ScoreRequest  # noqa: E402


def tiny_llama(path: Path, layers: int = 2) -> None:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(str(path))
    byte_tokenizer().save_pretrained(str(path))


def group(rng: random.Random, prompt: int, response: int, samples: int) -> list[ScoreRequest]:
    p = [rng.randrange(3, 512) for _ in range(prompt)]
    return [ScoreRequest(p + [rng.randrange(3, 512) for _ in range(response)], prompt) for _ in range(samples)]


def calls(scorer: Scorer, n: int, seed: int = 0, prompt: int = 8, response: int = 8) -> list[float]:
    """ms per ``engine.run([r])``, one request a call, groups of 8 responses to one prompt."""
    rng, out = random.Random(seed), []
    reqs = [r for _ in range(-(-n // 8)) for r in group(rng, prompt, response, 8)][:n]
    for r in reqs:
        t = time.perf_counter()
        scorer.engine.run([r])
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (the host's per-layer Python)")
    ap.add_argument("--profile", type=int, default=0, help="print this many top functions (cProfile)")
    ap.add_argument("--prompt", type=int, default=8, help="prompt ids of a group (the RL workload: 1024)")
    ap.add_argument("--response", type=int, default=8, help="response ids of a sample (the RL workload: 512)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tiny_llama(Path(tmp), args.layers)
        base = Scorer(tmp, device="cpu", dtype="float32", progress=False)
        print(f"commit {git_rev()}, {args.layers} layers, torch threads 1, {args.calls} calls of {args.prompt} + {args.response} ids\n")
        print("| engine | median ms / call | p90 ms |\n| --- | ---: | ---: |")
        for label, kw in (("default", {}), ("prefix_cache=True", {"prefix_cache": True}),
                          ("deterministic", {"deterministic": True}),
                          ("deterministic, prefix_cache=True", {"deterministic": True, "prefix_cache": True})):
            s = Scorer(base.loaded, **kw)
            calls(s, 16, seed=1, prompt=args.prompt, response=args.response)  # warm-up
            ms = sorted(calls(s, args.calls, prompt=args.prompt, response=args.response))
            print(f"| {label} | {statistics.median(ms):.3f} | {ms[int(0.9 * len(ms))]:.3f} |", flush=True)
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                calls(s, args.calls, seed=2, prompt=args.prompt, response=args.response)
                prof.disable()
                print(f"\ncProfile, {label}, {args.calls} calls (cumulative):")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
                print(f"cProfile, {label} (tottime):")
                pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
