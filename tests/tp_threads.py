"""Tensor parallelism emulated in one process: each rank's model (the real layers, loader cuts and
engine) runs in its own thread on one device, and the collectives are exchanged through memory
(``ThreadContext``) instead of NCCL or gloo. What differs from a worker run is only the transport,
which copies (gathers) or adds exact zeros (sums of one non-zero), so a rank's bits are the bits
its worker would compute: one GPU can then show whether (and where) deterministic mode leaves
TP = 1's bits, without two GPUs.

    models = rank_models(cfg, state, size=2, experts=2, device="cuda", dtype=torch.bfloat16)
    results = run_ranks(models, requests, config)  # rank 0's results
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

import logprobe.models.llama as llama
from logprobe.engine.runner import Engine
from logprobe.loading.checkpoint import SKIP
from logprobe.loading.llama import build_native
from logprobe.loading.loader import parallel_context
from logprobe.loading.sharding import rank_cut, rank_model
from logprobe.models.moe import native_model_class
from logprobe.parallel.context import ParallelContext, Pending


class Hub:
    """The ranks' meeting point: each collective is one ``exchange``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=600)
        self.slots: list[torch.Tensor | None] = [None] * size

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order (copies: a rank may overwrite its own afterwards)."""
        self.slots[rank] = x
        self.barrier.wait()
        got = [t.clone() for t in self.slots]
        self.barrier.wait()
        return got


class ThreadContext(ParallelContext):
    """``ParallelContext`` whose collectives go through a ``Hub`` (same results as NCCL's here:
    gathers copy; the sums and maxima the layers ask for have one rank's value per element)."""

    hub: Hub

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        xs = self.hub.exchange(self.rank, x)
        total = xs[0]
        for y in xs[1:]:
            total = total + y
        return x.copy_(total)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(torch.stack(self.hub.exchange(self.rank, x)).amax(0))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.hub.exchange(self.rank, x.contiguous()))  # [size, *]

    def all_gather_start(self, x: torch.Tensor) -> Pending:  # done at once: the hub has no streams
        return Pending(self.all_gather(x))

    def reduce_scatter_start(self, x: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
        block = self.reduce_scatter_sum(x)
        return Pending(block if out is None else out.copy_(block))

    def reduce_scatter_sum(self, x: torch.Tensor) -> torch.Tensor:  # default mode's MoE sum (sum_rows)
        xs = self.hub.exchange(self.rank, x.contiguous())
        total = xs[0]
        for y in xs[1:]:
            total = total + y
        return total.chunk(self.size)[self.rank].clone()


def random_state(cfg, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Whole float32 weights by parameter name (norm gains near 1, the rest 0.02 N(0, 1)), made on
    ``device`` from one seed, in the layout the model computes with (rope rows as they are)."""
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in native_model_class(cfg)(cfg).state_dict().items()}
    gen = torch.Generator(device).manual_seed(seed)
    state = {}
    for name, shape in names.items():
        w = torch.randn(shape, generator=gen, device=device)
        state[name] = 1.0 + 0.3 * w if name.endswith("norm.weight") else 0.02 * w
    return state


def rank_models(cfg, state: dict[str, torch.Tensor], size: int, experts: int, device: str,
                dtype: torch.dtype) -> list[torch.nn.Module]:
    """Each rank's model of ``size`` (experts in ``experts`` groups), cut from ``state`` by the
    loaders' own rules (``rank_cut``); size 1: the whole model, as one process loads it."""
    if size == 1:
        return [build_native(cfg, iter(state.items()), torch.device(device), dtype, rope_interleaved=True)]
    hub, models = Hub(size), []
    for rank in range(size):
        pc = parallel_context(cfg, rank, size, None, experts)
        ctx = ThreadContext(rank, size, None, pc.blocks, pc.experts)
        ctx.hub = hub
        meta = rank_model(cfg, ctx)

        def cut(items, meta=meta):
            for name, t in items:
                how = rank_cut(meta, name)
                if how is not SKIP:
                    yield name, t if how is None else how(t).contiguous()

        models.append(build_native(cfg, cut(state.items()), torch.device(device), dtype, rope_interleaved=True,
                                   ctx=ctx))
    return models


_THREAD = threading.local()  # .rank: the rank this thread runs (tracing)


def run_ranks(models: list[torch.nn.Module], requests, config) -> list:
    """``requests`` through one engine per rank, each rank in its own thread -> rank 0's results
    (a rank's failure is raised here)."""
    device = next(models[0].parameters()).device
    out: list = [None] * len(models)
    errors: list[BaseException] = []

    def work(r: int) -> None:
        _THREAD.rank = r
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            out[r] = Engine(models[r], config, device).run(requests, progress=False)
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
            errors.append(e)
            if len(models) > 1:
                models[r].ctx.hub.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out[0]


@contextmanager
def trace_attention(models: list[torch.nn.Module]):
    """While active, record each rank's Llama-family attention steps per head, in call order: the
    q and k entering and leaving their per-head norms (Qwen3), the rotated q and k, the attention
    output (each [T, heads, D]). Yields ``steps(rank)`` -> [(name, tensor)]; ``first_head_step``
    sets the ranks' heads beside one process's."""
    records: list[list[tuple[str, torch.Tensor]]] = [[] for _ in models]

    def put(name: str, t: torch.Tensor) -> None:
        records[getattr(_THREAD, "rank", 0)].append((name, t.detach().clone()))

    rotary, attention = llama.apply_rotary_pair, llama.packed_attention

    def traced_rotary(q, k, cis, triton=False):
        q, k = rotary(q, k, cis, triton)
        put("q_rotated", q)
        put("k_rotated", k)
        return q, k

    def traced_attention(*args, **kw):
        o = attention(*args, **kw)
        put("attention", o)
        return o

    def norm_hook(name: str):
        def hook(module, inputs, output):
            put(f"{name}_in", inputs[0])
            put(f"{name}_out", output)
        return hook

    hooks = [m.register_forward_hook(norm_hook(kind)) for model in models for a in model.modules()
             if isinstance(a, llama.LlamaAttention) and a.q_norm is not None and not a.qk_norm_full
             for kind, m in (("q_norm", a.q_norm), ("k_norm", a.k_norm))]
    llama.apply_rotary_pair, llama.packed_attention = traced_rotary, traced_attention
    try:
        yield lambda rank: records[rank]
    finally:
        llama.apply_rotary_pair, llama.packed_attention = rotary, attention
        for h in hooks:
            h.remove()


def first_head_step(one: list[tuple[str, torch.Tensor]], ranks: list[list[tuple[str, torch.Tensor]]]) -> str | None:
    """The first traced step (``trace_attention``) where the ranks' heads side by side leave one
    process's bits: "call i: name (max |d|)"; None if every step is bitwise."""
    for i, (name, want) in enumerate(one):
        parts = [r[i] for r in ranks]
        if any(n != name for n, _ in parts):
            return f"call {i}: {name} has no counterpart in every rank ({[n for n, _ in parts]})"
        got = torch.cat([t for _, t in parts], dim=1)  # [T, heads, D]: the ranks' heads in order
        if got.shape != want.shape or not torch.equal(got, want):
            if got.shape != want.shape:
                return f"call {i}: {name} (shapes {tuple(got.shape)} and {tuple(want.shape)})"
            where = (got != want).any(-1).nonzero()  # [n, 2]: (row, head) pairs that differ
            d = (got.float() - want.float()).abs().max().item()
            return f"call {i}: {name} (max |d| {d:.2e}, {len(where)} (row, head) pairs: {where[:4].tolist()})"
    return None
