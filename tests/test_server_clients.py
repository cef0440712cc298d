"""What real clients met on the real server stack (uvicorn, loopback sockets, a tiny Llama): a client
that hangs up mid-request stops its work between passes (and a running request's ``timeout`` does
too); a body that never arrives is a 408; a chunked body over the limit is a 413 naming it, not a
reset; the openai SDK's ``models.retrieve``; SGLang ``/generate`` batches with one
``sampling_params`` per item."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from server_util import serve

from logprobe import Scorer
from logprobe.server import ServerConfig, create_app

BUDGET = 64  # tokens per pass: a 400-token sequence runs in 7 chunks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers import make_hf_dir

    d = tmp_path_factory.mktemp("clients-llama")
    make_hf_dir(d, "llama", seed=7)
    return Scorer(str(d), device="cpu", dtype="float32", progress=False, max_batch_tokens=BUDGET)


class Gate:
    """fault_hook: holds the engine in its first pass until ``release()``; records each pass's rows."""

    def __init__(self) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()
        self.passes: list[int] = []

    def __call__(self, rows: int, tokens: int) -> None:
        self.entered.set()
        self.gate.wait(30)
        self.passes.append(rows)


@pytest.fixture
def gated(tiny):
    gate = Gate()
    tiny.engine.fault_hook = gate
    yield create_app(tiny, ServerConfig()), gate
    gate.gate.set()
    tiny.engine.fault_hook = None


def metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else -1.0


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            return False
        time.sleep(0.02)
    return True


LONG = {"sequences": [{"prompt_token_ids": [5] * 300, "completion_token_ids": [9] * 100}]}  # 399 inputs
SMALL = {"sequences": [{"prompt_token_ids": [3, 4, 5], "completion_token_ids": [6, 7]}]}  # 4 inputs, 2 scored


def raw_request(url: str, path: str, body: bytes, headers: bytes = b"") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers +
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def read_reply(s: socket.socket, timeout: float) -> tuple[int, dict]:
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed without a reply: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
    while len(rest) < length:
        chunk = s.recv(65536)
        assert chunk
        rest += chunk
    return int(head.split()[1]), json.loads(rest[:length])


# -- 1. a request's work stops between passes when its client leaves or its timeout passes ---------

def test_a_client_that_disconnects_mid_request_stops_its_work_between_passes(gated):
    app, gate = gated
    with serve(app) as url:
        s = raw_request(url, "/v1/logprobs", json.dumps(LONG).encode())
        assert gate.entered.wait(30)  # its first chunk (64 rows) is in the engine
        s.close()  # the client hangs up
        assert wait_until(lambda: metric(url, 'logprobe_requests_dropped_total{reason="disconnected"}') == 1)
        assert app.state.batcher.queue_depth == (0, 0)  # its slot is free at once
        gate.gate.set()
        r = requests.post(url + "/v1/logprobs", json=SMALL, timeout=60)  # runs after the step under way
        assert r.status_code == 200, r.text
        assert gate.passes == [BUDGET, 4]  # the chunk under way, then the next client: no more chunks
        # the dropped request's tokens are not counted (the count follows the reply: wait for it)
        assert wait_until(lambda: metric(url, "logprobe_tokens_scored_total") >= 2)
        assert metric(url, "logprobe_tokens_scored_total") == 2
        assert metric(url, 'logprobe_requests_dropped_total{reason="disconnected"}') == 1  # counted once
        assert app.state.batcher.queue_depth == (0, 0)


def test_a_timeout_that_passes_while_running_stops_the_work(gated):
    app, gate = gated
    with serve(app) as url, ThreadPoolExecutor(2) as pool:
        t0 = time.perf_counter()
        late = pool.submit(requests.post, url + "/v1/logprobs", json={**LONG, "timeout": 0.5}, timeout=60)
        assert gate.entered.wait(30)
        r = late.result()
        assert r.status_code == 408, r.text
        assert time.perf_counter() - t0 < 10  # at its deadline, while the engine is still in its first chunk
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("timeout", "timeout")
        assert "did not finish within 0.5 s" in err["message"]
        assert app.state.batcher.queue_depth == (0, 0)
        gate.gate.set()
        assert requests.post(url + "/v1/logprobs", json=SMALL, timeout=60).status_code == 200
        assert gate.passes == [BUDGET, 4]
        assert wait_until(lambda: metric(url, "logprobe_tokens_scored_total") >= 2)
        assert metric(url, "logprobe_tokens_scored_total") == 2
        assert metric(url, 'logprobe_requests_dropped_total{reason="timeout"}') == 1


# -- 2-5 on one server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny):
    app = create_app(tiny, ServerConfig(body_timeout=1.0, max_body_bytes=1 << 20))
    with serve(app) as url:
        yield url


def test_a_body_that_never_arrives_is_a_408_and_others_are_served(server):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        t0 = time.perf_counter()
        s.sendall(b"POST /v1/logprobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"sequences\": ")  # then silence
        assert requests.post(server + "/v1/logprobs", json=SMALL, timeout=30).status_code == 200  # meanwhile
        status, body = read_reply(s, timeout=20)
        assert status == 408, body
        assert 1.0 <= time.perf_counter() - t0 < 10
        err = body["error"]
        assert (err["param"], err["code"]) == ("body", "body_timeout")
        assert "no byte arrived for 1 s" in err["message"]
    assert requests.get(server + "/health", timeout=10).ok


def test_body_timeout_is_validated():
    from logprobe.errors import LogprobeError

    for bad in (0, -1, float("inf"), "3", True):
        with pytest.raises(LogprobeError, match="body_timeout"):
            ServerConfig(body_timeout=bad)
    assert ServerConfig().body_timeout == 30.0


def test_a_chunked_body_over_the_limit_is_a_413_naming_it(server):
    def chunks():
        for _ in range(48):  # 3 MiB, no Content-Length: Transfer-Encoding: chunked
            yield b"x" * (1 << 16)

    r = requests.post(server + "/v1/logprobs", data=chunks(), headers={"Content-Type": "application/json"},
                      timeout=60)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("body", "body_too_large")
    assert str(1 << 20) in err["message"]
    # a declared length over the limit: the same answer, read by the client (not a reset)
    r = requests.post(server + "/v1/logprobs", data=b"x" * (3 << 20), headers={"Content-Type": "application/json"},
                      timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    # a chunked body within the limit is read whole
    small = json.dumps(SMALL).encode()
    r = requests.post(server + "/v1/logprobs", data=iter([small[:10], small[10:]]),
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text


def test_openai_models_retrieve(server, tiny):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    card = client.models.retrieve(name)
    assert (card.id, card.object, card.owned_by) == (name, "model", "logprobe")
    assert client.models.retrieve(tiny.info.path).id == name  # any name `model` accepts
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert "no-such-model" in str(e.value)


def generate(url: str, body: dict) -> requests.Response:
    return requests.post(url + "/generate", json=body, timeout=60)


def test_generate_batch_with_sampling_params_per_item(server):
    ids = [[3, 4, 5, 6, 7], [8, 9, 10, 11]]
    temps = [0.5, 2.0]
    common = {"return_logprob": True, "logprob_start_len": 0}
    r = generate(server, {"input_ids": ids, **common,
                          "sampling_params": [{"temperature": t, "max_new_tokens": 0} for t in temps]})
    assert r.status_code == 200, r.text
    def values(reply):  # [[logprob, id, text], ...] -> the log-probs (the first is None)
        return torch.tensor([v[0] for v in reply["meta_info"]["input_token_logprobs"][1:]])

    for item, one, t in zip(r.json(), ids, temps):
        alone = generate(server, {"input_ids": one, **common, "sampling_params": {"temperature": t}}).json()
        # default mode: the batch and the one sequence alone agree within float32 rounding (other
        # batch shapes may take other matrix-product blockings, e.g. on one thread)
        assert [v[1] for v in item["meta_info"]["input_token_logprobs"]] == \
            [v[1] for v in alone["meta_info"]["input_token_logprobs"]]
        torch.testing.assert_close(values(item), values(alone), atol=1e-5, rtol=0)
    mixed = generate(server, {"input_ids": ids, **common, "sampling_params": {"temperature": 0.5}}).json()
    assert mixed[1]["meta_info"]["input_token_logprobs"] != r.json()[1]["meta_info"]["input_token_logprobs"]
    for bad in ([{"temperature": 1.0}], [{"temperature": 1.0}] * 3, []):
        r = generate(server, {"input_ids": ids, **common, "sampling_params": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "sampling_params"
    r = generate(server, {"input_ids": ids[0], **common, "sampling_params": [{"temperature": 1.0}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params"
    r = generate(server, {"input_ids": ids, **common, "sampling_params": [{"temperature": 1.0}, {"top_p": 0.5}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("sampling_params"), r.text


def test_engine_leaves_cancelled_requests_out_of_later_passes(tiny):
    """``Engine.run(cancelled=...)``: a request cancelled before its pass is not run, its slot is
    None and ``on_result`` never hears of it; the others' results are unchanged."""
    from logprobe.engine.request import ScoreRequest

    reqs = [ScoreRequest([3 + k] * 41, 20) for k in range(3)]  # 40 inputs each: one pass each (budget 64)
    plain = tiny.engine.run(reqs)
    passes, delivered = [], []
    tiny.engine.fault_hook = lambda rows, tokens: passes.append(rows)
    try:
        out = tiny.engine.run(reqs, on_result=lambda i, r: delivered.append(i), cancelled=lambda i: i != 1)
    finally:
        tiny.engine.fault_hook = None
    assert passes == [40] and delivered == [1]
    assert out[0] is None and out[2] is None
    assert out[1].logprobs.tolist() == plain[1].logprobs.tolist()
