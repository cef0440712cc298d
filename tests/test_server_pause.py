"""SGLang's /pause_generation, /continue_generation and /get_load over real HTTP: a /generate sent
while paused waits, then returns the same log-probs as unpaused; bad modes are 4xx JSON."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from server_util import serve

from logprobe.server import ServerConfig, create_app


@pytest.fixture(scope="module")
def server(default_scorer):
    with serve(create_app(default_scorer, ServerConfig())) as url:
        yield url


def gen(url, ids):
    r = requests.post(url + "/generate", json={"input_ids": ids, "return_logprob": True,
                                               "logprob_start_len": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return [e[0] for e in r.json()["meta_info"]["input_token_logprobs"][1:]]


def load(url):
    r = requests.get(url + "/get_load", timeout=30)
    assert r.status_code == 200
    return r.json()[0]


def test_request_waits_while_paused_then_completes(server):
    ids = [1, 5, 9, 4, 7]
    before = gen(server, ids)
    assert load(server)["paused"] is False
    r = requests.post(server + "/pause_generation", json={"mode": "retract"}, timeout=30)
    assert r.status_code == 200 and r.json()["success"]
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("lp", gen(server, ids)))
    t.start()
    for _ in range(100):  # the request is held, visible as waiting
        if load(server)["num_waiting_reqs"] == 1:
            break
        time.sleep(0.05)
    assert load(server)["num_waiting_reqs"] == 1 and "lp" not in out
    assert {"num_running_reqs", "num_tokens", "dp_rank"} <= set(load(server))
    assert requests.post(server + "/continue_generation", timeout=30).json()["success"]
    t.join(60)
    assert out["lp"] == before
    assert load(server)["num_waiting_reqs"] == 0 and load(server)["paused"] is False


@pytest.mark.parametrize("body,field", [({"mode": "stop"}, "mode"), ({"mode": "abort", "x": 1}, "x")])
def test_bad_pause_body_names_field(server, body, field):
    r = requests.post(server + "/pause_generation", json=body, timeout=30)
    assert 400 <= r.status_code < 500
    assert field in r.text
    assert load(server)["paused"] is False
