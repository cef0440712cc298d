"""Out of memory in the engine (issue 23): a batch that runs out is split and retried, the
working budget is lowered then raised back, and only a request that does not fit even alone
fails, alone. The test hook ``Engine.fault_hook(rows, tokens)`` raises ``torch.OutOfMemoryError``
(constructible on CPU) the way CUDA would."""

from __future__ import annotations

import pickle

import pytest
import torch

from logprobe.config import EngineConfig
from logprobe.engine.delivery import RequestOutOfMemory
from logprobe.engine.request import CaptureAt, ScoreRequest, SteerAt
from logprobe.engine.runner import MIN_OOM_CHUNK, Engine
from logprobe.errors import LogprobeError
from logprobe.loading import load_model
from logprobe.models.caps import ModelCaps

FIELDS = ("logprobs", "ranks", "entropy", "topk_ids", "topk_logprobs")


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return load_model(str(tiny_dirs["llama"][0]), "cpu", "float32").model


def mixed_requests() -> list[ScoreRequest]:
    """RL sequences sharing a 48-token prompt, short unrelated ones, a long one (chunked at budget 256)."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(2, 300, (n,), generator=g).tolist()  # noqa: E731
    prompt = ids(48)
    reqs = [ScoreRequest(prompt + ids(10 + 7 * k), 48, top_k=2 if k % 2 else 0, entropy=k == 3) for k in range(6)]
    reqs += [ScoreRequest(ids(5 + 9 * k), 1, temperature=0.7 if k == 1 else 1.0) for k in range(4)]
    reqs.insert(4, ScoreRequest(ids(700), 100, entropy=True))
    # hooks: a capture of rows and a sum (also across the chunks of a long one), a steered sequence
    v = torch.randn(64, generator=g)
    reqs.append(ScoreRequest(prompt + ids(20), 48, capture=(CaptureAt("blocks.1.resid_post", (3, 50, 67), "rows"),
                                                            CaptureAt("blocks.0.resid_mid", tuple(range(60)), "sum"))))
    reqs.append(ScoreRequest(ids(300), 1, capture=(CaptureAt("blocks.1.resid_post", (0, 150, 299), "rows"),)))
    reqs.append(ScoreRequest(prompt + ids(30), 48, steer=(SteerAt("blocks.0.resid_post", tuple(range(40, 70)),
                                                                  "add", v, 2.0),)))
    return reqs


class OOMAbove:
    """fault_hook: out of memory on passes of more than ``rows`` rows (or ``tokens`` rows + cached keys)."""

    def __init__(self, rows: int = 10**9, tokens: int = 10**9, times: int = 10**9) -> None:
        self.rows, self.tokens, self.times = rows, tokens, times
        self.raised = 0
        self.passes: list[tuple[int, int]] = []

    def __call__(self, rows: int, tokens: int) -> None:
        if (rows > self.rows or tokens > self.tokens) and self.raised < self.times:
            self.raised += 1
            raise torch.OutOfMemoryError(f"injected: {rows} rows, {tokens} tokens")
        self.passes.append((rows, tokens))


def run(model, deterministic: bool, hook=None, budget: int = 256, **kw):
    engine = Engine(model, EngineConfig(max_batch_tokens=budget, deterministic=deterministic), torch.device("cpu"))
    engine.fault_hook = hook
    return engine, engine.run(mixed_requests(), **kw)


def same(a, b, bitwise: bool, request: ScoreRequest | None = None) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is None:
            continue
        assert x.shape == y.shape, name
        if bitwise or x.dtype == torch.long:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=2e-5)
    assert (a.captures is None) == (b.captures is None)
    kinds = [c.kind for c in request.capture] if request is not None else [None] * len(a.captures or ())
    for x, y, kind in zip(a.captures or (), b.captures or (), kinds):
        # a "sum" over positions split between chunks adds partial sums: equal within rounding only
        exact = bitwise and kind != "sum"
        assert x.shape == y.shape and (torch.equal(x, y) if exact else torch.allclose(x, y, rtol=0, atol=1e-5))


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("limit", [dict(rows=100), dict(rows=20), dict(rows=150, tokens=700)])
def test_same_answers_with_injected_oom(model, deterministic, limit):
    """Every request of a mixed batch gets the same numbers with and without out-of-memory errors
    (bitwise in deterministic mode), after the engine split batches, cut chunks and lowered its budget."""
    _, ref = run(model, deterministic)
    hook = OOMAbove(**limit)
    engine, out = run(model, deterministic, hook)
    assert hook.raised > 0 and engine.oom_count == hook.raised  # the fault happened, and was survived
    assert all(rows <= limit["rows"] and tokens <= limit.get("tokens", 10**9) for rows, tokens in hook.passes)
    assert len(out) == len(ref) and all(r is not None for r in out)
    for a, b, r in zip(out, ref, mixed_requests()):
        same(a, b, deterministic, r)


def test_a_request_too_big_alone_fails_alone(model):
    """With at most 300 tokens per pass (cached keys included) the 700-token request cannot run
    even in the smallest chunks: it alone fails, naming its size; every other request is answered,
    the same bits as without the fault."""
    _, ref = run(model, True)
    errors = {}
    engine, out = run(model, True, OOMAbove(tokens=300), on_error=lambda i, e: errors.__setitem__(i, e))
    assert list(errors) == [4]
    e = errors[4]
    assert isinstance(e, RequestOutOfMemory) and isinstance(e, LogprobeError)
    assert (e.index, e.tokens) == (4, 699) and 256 <= e.fits <= 300 and e.rows <= MIN_OOM_CHUNK and e.context > 300
    assert "requests[4]: 699 input tokens do not fit in memory even alone" in str(e) and f"{e.fits} tokens" in str(e)
    assert out[4] is None
    assert str(pickle.loads(pickle.dumps(e))) == str(e)  # it can cross a process boundary
    for i, (a, b, r) in enumerate(zip(out, ref, mixed_requests())):
        if i != 4:
            same(a, b, True, r)
    # the library without on_error: every other request still reaches on_result, then the error is raised
    got = {}
    with pytest.raises(RequestOutOfMemory, match=r"requests\[4\]: 699 input tokens"):
        run(model, True, OOMAbove(tokens=300), on_result=lambda i, r: got.__setitem__(i, r))
    assert sorted(got) == [i for i in range(len(ref)) if i != 4]


def test_budget_lowered_then_raised_back(model):
    """One out-of-memory error halves the working budget (below the failed batch's rows); good
    batches double it back to the configured budget, never above."""
    budgets = []
    hook = OOMAbove(rows=100, times=1)  # a transient shortage: only the first big pass fails

    def watch(rows, tokens):
        hook(rows, tokens)
        budgets.append(engine.budget)

    engine = Engine(model, EngineConfig(max_batch_tokens=256), torch.device("cpu"))
    engine.restore_after = 2
    engine.fault_hook = watch
    reqs = mixed_requests()
    out = engine.run(reqs + reqs + reqs)
    assert hook.raised == 1 and all(r is not None for r in out)
    assert min(budgets) <= 128 and budgets[-1] == 256 and max(budgets) == 256
    low = budgets.index(min(budgets))
    assert budgets[low:] == sorted(budgets[low:])  # raised gradually, never lowered again
    assert engine.budget == 256


def test_a_whole_batch_out_of_memory_every_time_fails_each_request_alone(model):
    """Nothing fits (every pass runs out): each request fails on its own, none is lost or doubled."""
    errors = {}
    engine, out = run(model, False, OOMAbove(rows=0), on_error=lambda i, e: errors.__setitem__(i, e))
    assert sorted(errors) == list(range(len(out))) and all(r is None for r in out)
    assert all(e.fits == 0 and "no pass has fit yet" in str(e) for e in errors.values())


@pytest.mark.parametrize("where", ["layer", "head"])
def test_out_of_memory_part_way_through_a_pass(model, where):
    """Out of memory inside the model (after layer 0 appended a chunk's keys to the KV cache) or in
    the head: the cache is cut back and the retried numbers are the same bits."""
    _, ref = run(model, True)
    engine = Engine(model, EngineConfig(max_batch_tokens=256, deterministic=True), torch.device("cpu"))
    raised = []

    def boom(rows: int) -> None:
        if rows > 100:
            raised.append(rows)
            raise torch.OutOfMemoryError("injected")

    if where == "layer":
        handle = model.layers[1].register_forward_pre_hook(lambda mod, args: boom(args[0].shape[0]))
    else:
        score = engine.score
        engine.score = lambda reqs, packed, hidden: (boom(hidden.shape[0]), score(reqs, packed, hidden))[1]
    try:
        out = engine.run(mixed_requests())
    finally:
        if where == "layer":
            handle.remove()
    assert raised and engine.oom_count == len(raised)
    for a, b, r in zip(out, ref, mixed_requests()):
        same(a, b, True, r)


def test_transformers_backend_cannot_chunk_so_a_long_request_fails_alone(tiny_dirs):
    """A model on the transformers backend runs each request whole: out of memory splits batches
    down to one request; one that does not fit whole fails, the others are answered."""
    loaded = load_model(str(tiny_dirs["gpt2"][0]), "cpu", "float32")
    assert not ModelCaps.of(loaded.model).context
    g = torch.Generator().manual_seed(5)
    reqs = [ScoreRequest(torch.randint(2, 300, (n,), generator=g).tolist(), 1) for n in (20, 31, 61, 12)]
    engine = Engine(loaded.model, EngineConfig(max_batch_tokens=256), torch.device("cpu"))
    ref = engine.run(reqs)
    engine.fault_hook = OOMAbove(rows=40)
    errors = {}
    out = engine.run(reqs, on_error=lambda i, e: errors.__setitem__(i, e))
    assert list(errors) == [2] and errors[2].tokens == 60 and out[2] is None
    for i in (0, 1, 3):
        same(out[i], ref[i], bitwise=False)


def test_metrics_report_out_of_memory_recoveries(model):
    """/metrics reads the engine's out-of-memory count when scraped (the GPU soak bench reads it)."""
    from logprobe.server.metrics import Metrics

    engine = Engine(model, EngineConfig(max_batch_tokens=256), torch.device("cpu"))
    metrics = Metrics(engine)
    assert b"logprobe_engine_out_of_memory 0.0" in metrics.render()
    engine.fault_hook = OOMAbove(rows=40)
    engine.run(mixed_requests())
    assert engine.oom_count > 0
    assert f"logprobe_engine_out_of_memory {float(engine.oom_count)}".encode() in metrics.render()
    assert b"logprobe_cuda_memory_allocated_bytes 0.0" in metrics.render()  # CPU: CUDA never started
