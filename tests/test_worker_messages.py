"""The worker messages' pickling (``executor.workers.send`` / ``recv``): CPU tensors travel as numpy
arrays, bit for bit, through a real pipe; what numpy cannot hold takes torch's own reduction."""

import pickle
from multiprocessing import Pipe

import torch

from logprobe.engine.request import RequestResult
from logprobe.executor.messages import Result, Results, StageWeights
from logprobe.executor.workers import Outbox, dumps, recv, send


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of t (so -0.0 and NaN payloads compare)."""
    return t.contiguous().view(torch.uint8)


def test_results_cross_a_pipe_bitwise():
    nan_payload = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)  # a NaN with a payload
    lp = torch.cat([torch.tensor([-0.0, 0.0, float("-inf"), 1e-45]), nan_payload, torch.randn(5)])
    res = RequestResult(lp, torch.arange(10, dtype=torch.int64), entropy=torch.rand(10, dtype=torch.float64),
                        topk_ids=torch.randint(0, 50, (10, 3)), topk_logprobs=torch.randn(10, 3).t(),  # a view
                        captures=[torch.randn(2, 4, dtype=torch.bfloat16), torch.tensor(3.5)], cached_tokens=7)
    a, b = Pipe()
    send(a, Result(4, res))
    got = recv(b)
    assert isinstance(got, Result) and got.index == 4 and got.result.cached_tokens == 7
    for name in ("logprobs", "ranks", "entropy", "topk_ids", "topk_logprobs"):
        x, y = getattr(res, name), getattr(got.result, name)
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(bits(y), bits(x)), name
    assert got.result.captures[0].dtype == torch.bfloat16  # torch's own reduction
    assert torch.equal(got.result.captures[0], res.captures[0])
    assert got.result.captures[1].shape == () and got.result.captures[1].item() == 3.5
    got.result.logprobs[0] = 1.0  # an unpickled tensor owns writable memory


def test_a_view_carries_only_its_elements():
    big = torch.randn(1_000_000)
    view = big[10:20]
    assert len(dumps(view)) < 1_000  # torch's own reduction would write the whole 4 MB storage
    assert len(pickle.dumps(view)) > 4_000_000
    assert torch.equal(pickle.loads(dumps(view)), view)


def test_parameters_and_bool_tensors():
    p = torch.nn.Parameter(torch.randn(3, 2))
    mask = torch.tensor([True, False, True])
    got = pickle.loads(dumps(StageWeights([("w", p), ("m", mask)])))
    (n0, p0), (n1, m1) = got.pairs
    assert (n0, n1) == ("w", "m") and isinstance(p0, torch.nn.Parameter) and torch.equal(p0, p)
    assert m1.dtype == torch.bool and torch.equal(m1, mask)


def test_outbox_sends_a_pass_as_one_message():
    a, b = Pipe()
    box = Outbox(a)
    box.flush()  # nothing kept: nothing sent
    for i in (3, 0, 7):
        box.add(i, RequestResult(torch.full((2,), float(i)), torch.zeros(2, dtype=torch.int64)))
    box.flush()
    box.add(5, RequestResult(torch.zeros(1), torch.zeros(1, dtype=torch.int64)))
    box.flush()
    first, second = recv(b), recv(b)
    assert not b.poll(0)
    assert isinstance(first, Results) and [r.index for r in first.items] == [3, 0, 7]
    assert first.items[2].result.logprobs.tolist() == [7.0, 7.0]
    assert [r.index for r in second.items] == [5]


def test_outbox_reports_passes_that_delivered_nothing_when_asked():
    """A watched run's rank 0 (``Watch.between``, before each pass) sends the engine's pass count
    alone after passes that delivered no result (a long request's chunks), once per change."""
    from types import SimpleNamespace

    a, b = Pipe()
    engine = SimpleNamespace(passes=4)
    box = Outbox(a, engine)
    box.flush(report=True)  # no pass since it was made: nothing
    engine.passes = 6
    box.flush()  # an ordinary flush with nothing kept sends nothing
    assert not b.poll(0)
    box.flush(report=True)
    box.flush(report=True)  # nothing new
    box.add(2, RequestResult(torch.zeros(1), torch.zeros(1, dtype=torch.int64)))
    engine.passes = 7
    box.flush()
    first, second = recv(b), recv(b)
    assert not b.poll(0)
    assert (first.items, first.passes) == ([], 6)
    assert [r.index for r in second.items] == [2] and second.passes == 7
