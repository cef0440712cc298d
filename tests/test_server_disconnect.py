"""A client that goes away frees the engine within one pass, whichever engine runs the request:
the in-process one (it asks between passes) and the worker processes of data parallelism (the
driver tells the replica, whose ranks agree between passes: ``executor.workers.Watch``). Real
parts: uvicorn on a loopback socket, a client that sends a long request and closes its socket,
two CPU worker processes over gloo; the pass count and the engine's state are read from
``/metrics`` (``logprobe_engine_passes_total``, ``logprobe_engine_busy``).

The model is a random Llama wide enough that a pass of ``BUDGET`` rows takes a good part of a
tenth of a second on one core (a client's hang-up reaches the engine well within one), and a
request of ~1,000 tokens runs in ~16 chunked passes."""

from __future__ import annotations

import json
import random
import re
import socket
import time

import pytest
import requests
import torch
from server_util import serve

from logprobe import Scorer
from logprobe.config import EngineConfig
from logprobe.engine.request import ScoreRequest
from logprobe.server import ServerConfig, create_app

BUDGET = 64  # rows per pass
LONG = 960  # tokens of the request that is dropped: 15 passes
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers as tf
    from helpers import VOCAB, byte_tokenizer

    d = tmp_path_factory.mktemp("wide-llama")
    torch.manual_seed(11)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.05, bos_token_id=1, eos_token_id=0, tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(str(d))
    tok = byte_tokenizer()[0]
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="module")
def local(model_dir):
    return Scorer(model_dir, device="cpu", dtype="float32", progress=False, max_batch_tokens=BUDGET)


@pytest.fixture(scope="module")
def replicas(model_dir):
    """Two data-parallel replicas: one worker process each, over gloo."""
    with Scorer(model_dir, device="cpu", dtype="float32", progress=False, max_batch_tokens=BUDGET,
                data_parallel_size=2) as s:
        yield s


@pytest.fixture(scope="module")
def tensor_parallel(model_dir):
    """One replica of two ranks (worker processes over gloo) that agree on cancellations."""
    with Scorer(model_dir, device="cpu", dtype="float32", progress=False, max_batch_tokens=BUDGET,
                tensor_parallel_size=2) as s:
        yield s


@pytest.fixture
def mode(request):
    """(scorer, deterministic): the scorer put in that mode for the test, then back."""
    scorer, deterministic = request.getfixturevalue(request.param[0]), request.param[1]
    scorer.config = EngineConfig(max_batch_tokens=BUDGET, deterministic=deterministic)
    yield scorer
    scorer.config = EngineConfig(max_batch_tokens=BUDGET)


def _text(n: int, seed: int) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice("abcdefghij klmnopqrst uvwxyz.") for _ in range(n))


def _ids(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 250) for _ in range(n)]


# each ~LONG tokens under the byte tokenizer: one request of the engine, run in chunks
KINDS = {
    "logprobs": ("/v1/logprobs", {"sequences": [{"prompt_token_ids": _ids(900, 1), "completion_token_ids": _ids(60, 2)}]}),
    "perplexity": ("/v1/perplexity", {"texts": [_text(LONG, 3)]}),
    "score": ("/v1/score", {"prompt": _text(100, 4), "continuations": [_text(LONG - 100, 5)]}),
    "completions": ("/v1/completions", {"prompt": _text(LONG, 6), "max_tokens": 0, "echo": True, "logprobs": 1}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": _text(100, 7)},
                                                   {"role": "assistant", "content": _text(LONG - 120, 8)}],
                                      "max_tokens": 0, "echo": True, "logprobs": True}),
    "generate": ("/generate", {"input_ids": _ids(LONG, 9), "return_logprob": True, "logprob_start_len": 0,
                               "sampling_params": {"max_new_tokens": 0}}),
}
SMALL = {"sequences": [{"prompt_token_ids": [3, 4, 5], "completion_token_ids": [6, 7]}]}


def metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} is not in /metrics"
    return float(m.group(1))


def passes(url: str) -> int:
    return int(metric(url, "logprobe_engine_passes_total"))


def wait_until(cond, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def open_request(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def drop_midway(url: str, path: str, body: dict) -> tuple[int, int]:
    """Send ``body``, close the socket once two of its passes have run; -> (passes before the
    close, passes after it until the engine is idle)."""
    start = passes(url)
    s = open_request(url, path, body)
    if not wait_until(lambda: passes(url) >= start + 2, 20):
        s.settimeout(1)
        raise AssertionError(f"the request did not start: {s.recv(1000)!r}")
    before = passes(url)
    s.close()
    assert wait_until(lambda: metric(url, 'logprobe_requests_dropped_total{reason="disconnected"}') == 1)
    assert wait_until(lambda: metric(url, "logprobe_engine_busy") == 0)
    return before - start, passes(url) - before


def check_freed(url: str, path: str, body: dict) -> None:
    before, after = drop_midway(url, path, body)
    # the pass under way at the close (and one more only if a pass ended between reading the
    # count and closing); the whole request would have taken ~15
    assert after <= 2, f"{after} passes ran after the client left ({before} before)"
    t0 = time.perf_counter()
    r = requests.post(url + "/v1/logprobs", json=SMALL, timeout=60)
    assert r.status_code == 200, r.text
    assert time.perf_counter() - t0 < 5
    assert metric(url, "logprobe_engine_busy") == 0


def full_passes(scorer: Scorer, path: str, body: dict) -> int:
    """Passes the request takes when nobody leaves (the yardstick of ``check_freed``)."""
    with serve(create_app(scorer, ServerConfig())) as url:
        start = passes(url)
        assert requests.post(url + path, json=body, timeout=120).status_code == 200
        return passes(url) - start


SLOW_KINDS = {"score", "completions", "chat", "generate"}


def _kinds(fast: set[str]) -> list:
    return [k if k in fast else pytest.param(k, marks=pytest.mark.slow) for k in KINDS]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mode", [("local", False)], indirect=True, ids=["default"])
def test_in_process_engine_is_free_within_one_pass(mode, kind):
    path, body = KINDS[kind]
    with serve(create_app(mode, ServerConfig())) as url:
        check_freed(url, path, body)


@pytest.mark.parametrize("kind", _kinds({"logprobs", "perplexity"}))
@pytest.mark.parametrize("mode", [("local", True)], indirect=True, ids=["deterministic"])
def test_in_process_engine_is_free_within_one_pass_deterministic(mode, kind):
    path, body = KINDS[kind]
    with serve(create_app(mode, ServerConfig())) as url:
        check_freed(url, path, body)


@pytest.mark.slow
def test_every_kind_runs_in_many_passes(local):
    """The yardstick: undisturbed, each request above takes more than a dozen passes."""
    for kind, (path, body) in KINDS.items():
        assert full_passes(local, path, body) >= 12, kind


@pytest.mark.parametrize("kind", _kinds({"logprobs"}))
@pytest.mark.parametrize("mode", [("replicas", False), ("replicas", True)], indirect=True,
                         ids=["default", "deterministic"])
def test_data_parallel_replicas_are_free_within_one_pass(mode, kind):
    path, body = KINDS[kind]
    with serve(create_app(mode, ServerConfig())) as url:
        check_freed(url, path, body)  # its follow-up is answered: the replicas are in step


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["logprobs", "perplexity"])
@pytest.mark.parametrize("mode", [("tensor_parallel", False), ("tensor_parallel", True)], indirect=True,
                         ids=["default", "deterministic"])
def test_tensor_parallel_ranks_are_free_within_one_pass(mode, kind):
    """Both ranks leave the request out of the same passes (else they would wait on each other's
    collectives forever), and the next request runs on both."""
    path, body = KINDS[kind]
    with serve(create_app(mode, ServerConfig())) as url:
        check_freed(url, path, body)


def test_parallel_run_leaves_a_cancelled_request_out_and_keeps_the_others_bits(replicas):
    """``ParallelEngine.run(cancelled=...)``: a request cancelled two passes in gets no pass
    after the one under way and no result; the requests beside it, on its replica too, are
    delivered with their bits (deterministic mode: a request's numbers do not depend on its
    companions or its passes); the workers then run the next requests as if nothing happened."""
    replicas.config = EngineConfig(max_batch_tokens=BUDGET, deterministic=True)
    try:
        long = ScoreRequest(_ids(LONG, 12), 1)  # 15 passes
        # 20 short requests of one pass each: the long one's replica (0) gets 3 of them, the other 17
        short = [ScoreRequest(_ids(40, 100 + k), 20) for k in range(20)]
        want = replicas.engine.run(short)
        group = replicas.engine.groups[0]
        start, seen = group.passes, []

        def cancelled(i: int) -> bool:
            if i == 0 and group.passes >= start + 2:
                seen.append(seen[0] if seen else group.passes)
                return True
            return False

        delivered = []
        got = replicas.engine.run([long, *short], on_result=lambda i, r: delivered.append(i), cancelled=cancelled)
        assert seen and got[0] is None and sorted(delivered) == list(range(1, 21))
        assert group.passes - seen[0] <= 1 + 3  # the pass under way, and the short ones beside it
        for a, b in zip(got[1:], want):
            assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.ranks, b.ranks)
        again = replicas.engine.run(short[:4])
        for a, b in zip(again, want):
            assert torch.equal(a.logprobs, b.logprobs)
    finally:
        replicas.config = EngineConfig(max_batch_tokens=BUDGET)


def test_a_row_job_on_worker_processes_stops_within_one_pass(replicas):
    """``run_rows(stop=...)`` (``logprobe logprobs`` on SIGINT/SIGTERM) over data-parallel
    replicas: asked while the workers run, it ends the batch within one pass of each replica,
    with the rows finished before it in the sink (``stopped``), not after the whole batch."""
    from logprobe.io.tables import Row
    from logprobe.jobs import ListSink, LogprobsRows, run_rows

    rows = [Row(k, f"line {k + 1}", {"prompt_token_ids": _ids(40, 200 + k), "completion_token_ids": _ids(20, 300 + k)})
            for k in range(40)]  # a pass each: 20 on each replica
    start, sink = replicas.engine.passes, ListSink()
    counts = run_rows(replicas, LogprobsRows(), rows, sink, batch_rows=40,
                      stop=lambda: replicas.engine.passes >= start + 4)
    ran = replicas.engine.passes - start
    assert counts.stopped and 0 < len(sink.rows) < 40
    assert ran <= 4 + 2 * 2  # each replica: the pass under way, and one more if a pass ended meanwhile
    assert all(len(r["logprobs"]) == 20 for r in sink.rows)
