"""``serve --warmup`` on the real server stack: the port opens at once, ``/ready`` answers 503
"warming" (``/health`` 200 with status "warming") while ``Scorer.warmup`` runs, a request sent
meanwhile waits and is answered after it, then ``/ready`` is 200; a failed warm-up still ends
ready; without ``--warmup`` ready at once. ``logprobe warmup`` runs the same rounds from the CLI."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
from server_util import serve

from logprobe import Scorer
from logprobe.cli.main import main
from logprobe.server import ServerConfig, create_app

SEQS = {"sequences": [{"prompt_token_ids": [3, 4, 5, 9], "completion_token_ids": [6, 7, 8]}]}


@pytest.fixture(scope="module")
def scorer(tiny_dirs):
    return Scorer(str(tiny_dirs["llama"][0]), device="cpu", dtype="float32", max_batch_tokens=512)


def wait_ready(url: str, timeout: float = 60) -> requests.Response:
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = requests.get(url + "/ready", timeout=10)
        if r.status_code == 200:
            return r
        time.sleep(0.05)
    raise AssertionError("never ready")


def test_warming_then_ready_and_requests_wait(scorer, monkeypatch):
    gate, entered = threading.Event(), threading.Event()
    real = scorer.warmup

    def held_warmup():  # the real warm-up, held at its start until the test has looked
        entered.set()
        gate.wait(30)
        return real()

    monkeypatch.setattr(scorer, "warmup", held_warmup)
    want = requests.Response()
    with serve(create_app(scorer, ServerConfig(api_key="k", warmup=True))) as url:
        assert entered.wait(30)
        r = requests.get(url + "/ready", timeout=10)  # no key needed: a probe
        assert r.status_code == 503 and r.json() == {"status": "warming", "model": scorer.info.name}
        assert requests.head(url + "/ready", timeout=10).status_code == 503
        h = requests.get(url + "/health", timeout=10)
        assert h.status_code == 200 and h.json()["status"] == "warming"
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", requests.post(
            url + "/v1/logprobs", json=SEQS, headers={"Authorization": "Bearer k"}, timeout=60)))
        t.start()
        time.sleep(0.5)
        assert "r" not in box  # waits behind the warm-up
        gate.set()
        t.join(60)
        want = box["r"]
        r = wait_ready(url)
        assert r.json()["status"] == "ready" and requests.get(url + "/health", timeout=10).json()["status"] == "ok"
    assert want.status_code == 200, want.text
    # the warm-up changes no number: the same request on the scorer afterwards, and its log-probs
    got = scorer.logprobs(SEQS["sequences"])[0].logprobs.tolist()
    assert want.json()["results"][0]["logprobs"] == pytest.approx(got, abs=1e-6)


def test_failed_warmup_still_serves(scorer, monkeypatch, capfd):
    def broken():
        raise RuntimeError("no kernels today")

    monkeypatch.setattr(scorer, "warmup", broken)
    with serve(create_app(scorer, ServerConfig(warmup=True))) as url:
        wait_ready(url)
        assert requests.post(url + "/v1/logprobs", json=SEQS, timeout=60).status_code == 200
    assert "warm-up failed (RuntimeError: no kernels today)" in capfd.readouterr().err


def test_ready_at_once_without_warmup(scorer):
    with serve(create_app(scorer, ServerConfig())) as url:
        r = requests.get(url + "/ready", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ready"


def test_warmup_report_and_cli(scorer, tiny_dirs, capsys):
    report = scorer.warmup()
    assert set(report["rounds"]) == {"full", "small", "shared", "long"} and report["tuned"] == 0  # CPU
    assert report["tokens"] > 512  # the long round is over the budget: it ran in chunks
    assert main(["warmup", "--model", str(tiny_dirs["llama"][0]), "--device", "cpu", "--max-batch-tokens", "256",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_batch_tokens"] == 256 and out["device"] == "cpu" and out["load_seconds"] > 0
