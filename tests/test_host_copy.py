"""One device-to-host copy per batch, read after the next batch is launched (issue 19, ``engine.host``).

The layout is pinned by a literal table; the round trip keeps every float bit (NaN payloads, -0.0,
-inf); the engine gives the same bits, in the same order of ``on_result`` calls, with the overlap
on or off, through out-of-memory retries and a stop."""

from __future__ import annotations

import pytest
import torch
from test_oom import OOMAbove, mixed_requests, same

from logprobe.config import EngineConfig
from logprobe.engine.host import start_copy, unpack
from logprobe.engine.runner import Engine, RunStopped
from logprobe.layers.logprob_head import HeadOutput
from logprobe.loading import load_model


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return load_model(str(tiny_dirs["llama"][0]), "cpu", "float32").model


def head_output(n: int, k: int, seed: int = 0) -> HeadOutput:
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("-inf"), -0.0, float("nan"), 3.0e-45])  # a subnormal too
    lp = torch.cat([special, -torch.rand(max(0, n - 4), generator=g) * 20])[:n]
    return HeadOutput(lp, torch.zeros(n), torch.randint(0, 2**31 - 1, (n,), generator=g),
                      entropy=torch.rand(n, generator=g),
                      topk_ids=torch.randint(0, 150000, (n, k + 1), generator=g),
                      topk_logprobs=-torch.rand(n, k + 1, generator=g))


def test_layout_gold():
    """Which int32 word holds what, for n = 2 rows, top-k 2, entropy: 2 * (3 + 2 * 2) words."""
    out = HeadOutput(torch.tensor([1.0, 2.0]), torch.zeros(2), torch.tensor([5, 6]), entropy=torch.tensor([0.5, 0.25]),
                     topk_ids=torch.tensor([[10, 11, 99], [12, 13, 99]]),
                     topk_logprobs=torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -4.0, -9.0]]))
    buf = start_copy(out, top_k=2, entropy=True).buffer
    f = lambda x: torch.tensor(x, dtype=torch.float32).view(torch.int32).item()  # noqa: E731
    assert buf.tolist() == [f(1.0), f(2.0), 5, 6, f(0.5), f(0.25), 10, 11, 12, 13, f(-1.0), f(-2.0), f(-3.0), f(-4.0)]
    assert f(1.0) == 1065353216  # the float32 bits of 1.0, 0x3f800000
    assert start_copy(out, top_k=0, entropy=False).buffer.tolist() == [f(1.0), f(2.0), 5, 6]


@pytest.mark.parametrize("n,k,entropy", [(0, 0, False), (1, 0, True), (7, 3, False), (9, 5, True)])
def test_round_trip_keeps_every_bit(n, k, entropy):
    out = head_output(n, k)
    rows = start_copy(out, k, entropy).wait()
    assert torch.equal(rows.logprobs.view(torch.int32), out.logprobs.view(torch.int32))  # NaN, -0.0 too
    assert rows.ranks.dtype == torch.int64 and torch.equal(rows.ranks, out.ranks)
    assert (rows.entropy is None) == (not entropy) and (not entropy or torch.equal(rows.entropy, out.entropy))
    if k:
        assert rows.topk_ids.dtype == torch.int64 and torch.equal(rows.topk_ids, out.topk_ids[:, :k])
        assert torch.equal(rows.topk_logprobs, out.topk_logprobs[:, :k])
    else:
        assert rows.topk_ids is None and rows.topk_logprobs is None


def test_unpack_rejects_nothing_silently():
    """A buffer shorter than its layout says is an error, not a silently short result."""
    with pytest.raises(ValueError, match="does not hold 2 rows"):
        unpack(torch.zeros(5, dtype=torch.int32), 2, 0, True)
    with pytest.raises(ValueError):
        unpack(torch.zeros(15, dtype=torch.int32), 2, 2, True)


def run(model, overlap: bool, deterministic: bool = True, **kw):
    order = []
    engine = Engine(model, EngineConfig(max_batch_tokens=128, deterministic=deterministic, overlap_host=overlap),
                    torch.device("cpu"))
    engine.fault_hook = kw.pop("hook", None)
    out = engine.run(mixed_requests(), on_result=lambda i, r: order.append(i), **kw)
    return out, order


@pytest.mark.parametrize("deterministic", [True, False])
def test_overlap_same_bits_and_order(model, deterministic):
    ref, ref_order = run(model, False, deterministic)
    got, order = run(model, True, deterministic)
    assert order == ref_order and sorted(order) == list(range(len(ref)))
    for a, b, r in zip(got, ref, mixed_requests()):
        same(a, b, True, r)  # same config, same passes: the same bits, deterministic mode or not


def test_overlap_through_oom_retries(model):
    ref, _ = run(model, False)
    hook = OOMAbove(rows=40)
    got, order = run(model, True, hook=hook)
    assert hook.raised > 0 and sorted(order) == list(range(len(ref)))
    for a, b, r in zip(got, ref, mixed_requests()):
        same(a, b, True, r)


def test_stop_delivers_the_batch_in_flight(model):
    """Stopped before its third pass, the engine has delivered both earlier passes' requests (the
    second was still in flight), as many as without the overlap."""
    delivered = {}
    for overlap in (True, False):
        passes, done = [], []
        engine = Engine(model, EngineConfig(max_batch_tokens=128, deterministic=True, overlap_host=overlap),
                        torch.device("cpu"))
        engine.fault_hook = lambda rows, tokens, passes=passes: passes.append(rows)
        with pytest.raises(RunStopped):
            engine.run(mixed_requests(), on_result=lambda i, r, done=done: done.append(i),
                       stop=lambda passes=passes: len(passes) >= 2)
        assert len(passes) == 2 and done
        delivered[overlap] = done
    assert delivered[True] == delivered[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_copy_and_overlap(tiny_dirs):
    cuda_model = load_model(str(tiny_dirs["llama"][0]), "cuda", "float32").model
    out = head_output(33, 4)
    out = HeadOutput(*(t.cuda() if t is not None else None for t in (out.logprobs, out.logsumexp, out.ranks,
                                                                     out.entropy, out.topk_ids, out.topk_logprobs)))
    copy = start_copy(out, 4, True)
    assert copy.buffer.is_pinned() and copy.event is not None
    rows = copy.wait()
    assert not rows.logprobs.is_pinned() and torch.equal(rows.logprobs.view(torch.int32),
                                                          out.logprobs.cpu().view(torch.int32))
    results = {}
    for overlap in (False, True):
        engine = Engine(cuda_model, EngineConfig(max_batch_tokens=128, deterministic=True, overlap_host=overlap),
                        torch.device("cuda"))
        results[overlap] = engine.run(mixed_requests())
    for a, b, r in zip(results[True], results[False], mixed_requests()):
        same(a, b, True, r)


def _slow_head_output(device: str) -> HeadOutput:
    """Head outputs produced by a long kernel still running when the copy is queued."""
    g = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(4096, 4096, device=device, generator=g)
    for _ in range(8):
        a = torch.tanh(a @ a) * 0.5
    lp = a[:, 0].contiguous()  # [4096]
    return HeadOutput(lp, torch.zeros_like(lp), a[:, 1].mul(100).long().abs(), entropy=a[:, 2].contiguous(),
                      topk_ids=a[:, 3:6].mul(1000).long().abs(), topk_logprobs=a[:, 6:9].contiguous())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("device", ["cuda:0", "cuda:1"])
def test_cuda_copy_waits_for_the_producer(device):
    """The copy is read only after the kernels that produce it have finished, also when the
    tensors are on a GPU other than the current one (the event is recorded on their stream)."""
    if int(device[-1]) >= torch.cuda.device_count():
        pytest.skip("needs two CUDA GPUs")
    torch.cuda.set_device(0)
    out = _slow_head_output(device)
    rows = start_copy(out, 3, True).wait()
    assert torch.equal(rows.logprobs.view(torch.int32), out.logprobs.cpu().view(torch.int32))
    assert torch.equal(rows.topk_ids, out.topk_ids.cpu()) and torch.equal(rows.entropy, out.entropy.cpu())


def test_results_own_their_storage(model):
    """A request's result is not a view of the batch's buffer (pickled to another process, a view
    would carry the whole batch)."""
    out, _ = run(model, True)
    for r in out:
        for t in (r.logprobs, r.ranks, r.entropy, r.topk_ids, r.topk_logprobs):
            if t is not None:
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_engine_on_another_gpu_than_the_current(tiny_dirs):
    """An engine on cuda:1 while cuda:0 is current gives the bits of the same engine on cuda:0
    (its Triton kernels and copies run on its own device)."""
    torch.cuda.set_device(0)
    got = {}
    for dev in ("cuda:0", "cuda:1"):
        m = load_model(str(tiny_dirs["llama"][0]), dev, "float32").model
        got[dev] = Engine(m, EngineConfig(max_batch_tokens=128, deterministic=True), torch.device(dev)).run(
            mixed_requests())
        assert torch.cuda.current_device() == 0
    for a, b, r in zip(got["cuda:1"], got["cuda:0"], mixed_requests()):
        same(a, b, True, r)


@pytest.mark.parametrize("overlap", [True, False])
def test_on_batch_follows_each_pass_results(model, overlap):
    """``on_batch`` comes after each pass's results have all reached ``on_result`` (and after a
    chunked request's): never before a result of its pass, never twice with nothing between, and
    last; the results are those of a run without it."""
    events, passes = [], []
    engine = Engine(model, EngineConfig(max_batch_tokens=128, deterministic=True, overlap_host=overlap),
                    torch.device("cpu"))
    engine.fault_hook = lambda rows, tokens: passes.append(rows)
    got = engine.run(mixed_requests(), on_result=lambda i, r: events.append(i),
                     on_batch=lambda: events.append("batch"))
    ref, order = run(model, overlap)
    assert [e for e in events if e != "batch"] == order and events[-1] == "batch"
    assert all(not (a == b == "batch") for a, b in zip(events, events[1:])) and events[0] != "batch"
    assert 2 <= events.count("batch") <= len(passes)
    for a, b, r in zip(got, ref, mixed_requests()):
        same(a, b, True, r)
