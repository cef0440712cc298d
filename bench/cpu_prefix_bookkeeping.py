"""The prefix cache's own work per engine call, without the model: what a resumed request costs
besides its forward pass (lookups, the resumed KV cache, appending the pass's keys, keeping the new
rows), on fake keys/values of a real shape.

RL groups (G prompts x S responses), one request per call, each call as the engine runs it with the
cache on an attention-only model: a request with nothing cached runs as a batch of one (its
keys/values recorded by ``KVCache.extend``, then ``keep_batch``); a request with a cached prefix runs
as a ``ResumePack`` of one (lookups, the pack's KV cache, ``layout``, each layer's ``extend`` by the
new rows, the final hidden rows joined, ``keep``). The model's work is replaced by fresh tensors of
the right shapes, so what is timed is the bookkeeping alone; the tensors' bytes per token are those
of the shape named (llama-8b: 32 layers x 8 KV heads x 128 x 2 bytes x (K, V) + 4096 x 2 bytes of
hidden row = 139,264 bytes). Prints milliseconds per call (median over the resumed calls) and the
bytes the calls allocated, per call.

    python bench/cpu_prefix_bookkeeping.py --layers 32 --groups 4 --samples 8 --prompt 1024 --response 512
    python bench/cpu_prefix_bookkeeping.py --evict-nodes 2000 20000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from logprobe.engine.prefix_cache import PrefixCache
from logprobe.engine.prefix_run import ResumePack, keep_batch, resumable, take_pack
from logprobe.engine.request import ScoreRequest
from logprobe.engine.scheduler import Tree
from logprobe.layers.attention import KVCache


def rl_requests(groups: int, samples: int, prompt: int, response: int, seed: int = 0) -> list[ScoreRequest]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 30000) for _ in range(n)]  # noqa: E731
    out = []
    for _ in range(groups):
        p = tok(rng.randint(prompt // 2, prompt))
        out += [ScoreRequest(p + tok(rng.randint(max(1, response // 4), response)), len(p)) for _ in range(samples)]
    return out


class Written(TorchDispatchMode):
    """Bytes of the tensors the ops produce (views excluded), outside the fake model's own."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and isinstance(out, torch.Tensor) and out._base is None and not func.is_view:
            self.bytes += out.numel() * out.element_size()
        return out


class Fake:
    """Fresh tensors standing for what a forward pass computes, counted in bytes."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, hidden: int, dtype: torch.dtype) -> None:
        self.layers, self.kv_heads, self.head_dim, self.hidden, self.dtype = layers, kv_heads, head_dim, hidden, dtype

        self.mode: Written | None = None

    def _new(self, *shape: int) -> torch.Tensor:
        if self.mode is not None:
            self.mode.paused = True
        t = torch.ones(*shape, dtype=self.dtype)
        if self.mode is not None:
            self.mode.paused = False
        return t

    def kv_rows(self, n: int) -> torch.Tensor:
        return self._new(n, self.kv_heads, self.head_dim)  # [n, Hkv, D]

    def hidden_rows(self, n: int) -> torch.Tensor:
        return self._new(n, self.hidden)  # [n, H]

    def forward(self, kv: KVCache, n: int) -> torch.Tensor:
        """Each layer's ``extend`` by n new rows, as attention does; the final hidden rows [n, H]."""
        for layer in range(self.layers):
            kv.extend(layer, self.kv_rows(n), self.kv_rows(n))
        return self.hidden_rows(n)


def one_call(cache: PrefixCache, r: ScoreRequest, fake: Fake) -> bool:
    """One engine call of one request with the cache; True when it resumed."""
    if not resumable(cache, [r], 1):
        record = KVCache.empty(fake.layers)
        hidden = fake.forward(record, r.num_inputs)
        keep_batch(cache, [Tree((0,), 0)], [r], record, hidden)
        return False
    members, _ = take_pack(cache, [r], deque([0]), 1 << 30, 1)
    rp = ResumePack(cache, [r], members, fake.layers)
    ids = rp.layout()[0]
    hidden = fake.forward(rp.kv, len(ids))
    rp.keep(rp.with_context(hidden))  # [past + T, H], as the engine scores them
    return True


def eviction(nodes: int, inserts: int = 200, seed: int = 0) -> float:
    """Milliseconds per insert into a full tree of about ``nodes`` nodes (8-token prompts, 8-token
    branches, one 4-byte row each token), every insert evicting."""
    rng = random.Random(seed)
    rows = lambda a, b: [torch.zeros(b - a, 1)]  # noqa: E731
    tree = PrefixCache(nodes * 2 * 4 * 8)
    prompts = [[rng.randrange(1000) for _ in range(8)] for _ in range(max(1, nodes // 8))]
    for _ in range(2 * nodes):
        tree.insert(rng.choice(prompts) + [rng.randrange(10 ** 6) for _ in range(8)], rows)
    t = time.perf_counter()
    for _ in range(inserts):
        tree.insert(rng.choice(prompts) + [rng.randrange(10 ** 6) for _ in range(8)], rows)
    return (time.perf_counter() - t) / inserts * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt length (each in [prompt/2, prompt])")
    ap.add_argument("--response", type=int, default=512, help="response length (each in [response/4, response])")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--evict-nodes", type=int, nargs="*", default=None,
                    help="instead: milliseconds per insert into a full tree of about these many nodes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.evict_nodes:
        for n in args.evict_nodes:
            print(f"full tree of about {n} nodes: {eviction(n):.3f} ms per insert (each evicting)")
        return
    fake = Fake(args.layers, args.kv_heads, args.head_dim, args.hidden, torch.bfloat16)
    reqs = rl_requests(args.groups, args.samples, args.prompt, args.response)
    per_token = 2 * args.layers * args.kv_heads * args.head_dim * 2 + args.hidden * 2
    cache = PrefixCache(1 << 40)
    resumed, fresh, new_rows = [], [], 0
    for r in reqs:
        t = time.perf_counter()
        hit = one_call(cache, r, fake)
        (resumed if hit else fresh).append((time.perf_counter() - t) * 1e3)
    # the same calls again on a fresh cache, counting bytes written (slower: not timed)
    cache, written = PrefixCache(1 << 40), Written()
    fake.mode = written
    for r in reqs:
        before = cache.stats.inserted_tokens
        with written:
            one_call(cache, r, fake)
        new_rows += cache.stats.inserted_tokens - before
    print(f"{len(reqs)} calls ({len(resumed)} resumed), {per_token} bytes per token, torch threads "
          f"{torch.get_num_threads()}, {cache.stats.bytes / 2**20:.0f} MiB held")
    print(f"resumed call: median {statistics.median(resumed):.1f} ms, min {min(resumed):.1f} ms")
    print(f"call with nothing cached: median {statistics.median(fresh):.1f} ms")
    print(f"bytes written by the bookkeeping: {written.bytes / len(reqs) / 2**20:.1f} MiB per call, "
          f"{written.bytes / (new_rows * per_token):.2f}x the new rows' bytes")


if __name__ == "__main__":
    main()
