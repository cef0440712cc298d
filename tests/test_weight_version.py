"""``weight_version``: the weights' name (SGLang's), set at load ("0") and by every update (the
caller's, else the update count as a string). The library (``Scorer.weight_version``), the server
(every scoring reply, ``GET /get_weight_version``, ``/update_weights_from_disk``'s
``weight_version``), and a request under way during an update answering the old name."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import requests
import torch
from helpers import make_hf_dir
from server_util import serve

from logprobe import Scorer
from logprobe.engine.request import RequestResult, ScoreRequest
from logprobe.errors import LogprobeError
from logprobe.server import ServerConfig, create_app
from logprobe.server.batcher import Batcher
from logprobe.server.weights import ServedWeights

IDS = [5, 71, 72, 3, 140, 8]


def scorer(path) -> Scorer:
    return Scorer(str(path), device="cpu", dtype="float32", progress=False, deterministic=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, seed in (("a", 3), ("b", 4)):
        d = tmp_path_factory.mktemp(f"wv-{name}")
        out[name] = (d, make_hf_dir(d, "llama", seed=seed))
    return out


def test_library_weight_version(models):
    s = scorer(models["a"][0])
    assert s.weight_version == "0" and s.weights_version == 0
    state = {k: v.float() for k, v in models["b"][1].state_dict().items()}
    assert s.update_weights(state, weight_version="step-7") == 1
    assert s.weight_version == "step-7"
    s.load_weights(str(models["a"][0]))  # no name: the count
    assert s.weight_version == "2" and s.weights_version == 2
    bad = dict(state)
    bad.pop(next(iter(bad)))
    with pytest.raises(LogprobeError):
        s.update_weights(bad, weight_version="never")
    assert s.weight_version == "2"  # a failed update changes nothing
    s.load_weights(str(models["b"][0]), weight_version="b")
    assert s.weight_version == "b"


def post(url, path, body):
    return requests.post(url + path, json=body, timeout=120)


def test_server_weight_version(models):
    app = create_app(scorer(models["a"][0]), ServerConfig(max_top_logprobs=5))
    with serve(app) as url:
        def check_all(name: str, number: int):
            assert requests.get(url + "/get_weight_version", timeout=30).json() == {"weight_version": name}
            health = requests.get(url + "/health", timeout=30).json()
            assert health["weight_version"] == name and health["weights_version"] == number
            gen = post(url, "/generate", {"input_ids": IDS, "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 0}})
            assert gen.status_code == 200, gen.text
            assert gen.json()["meta_info"]["weight_version"] == name and gen.json()["weights_version"] == number
            for path, body in (("/v1/score", {"prompt": "a", "continuations": ["b"]}),
                               ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [5], "completion_token_ids": [6]}]}),
                               ("/v1/perplexity", {"texts": "hello world"}),
                               ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                                                      {"role": "assistant", "content": "yo"}]})):
                r = post(url, path, body)
                if path == "/v1/chat/completions" and r.status_code == 400:
                    continue  # the byte tokenizer may have no chat template
                assert r.status_code == 200, (path, r.text)
                assert r.json()["weight_version"] == name and r.json()["weights_version"] == number, path

        check_all("0", 0)
        r = post(url, "/update_weights_from_disk", {"model_path": str(models["b"][0]), "weight_version": "rl-step-3"})
        assert r.status_code == 200, r.text
        assert r.json()["weight_version"] == "rl-step-3" and r.json()["weights_version"] == 1
        check_all("rl-step-3", 1)
        r = post(url, "/update_weights_from_disk", {"model_path": str(models["a"][0])})  # no name: the count
        assert r.json()["weight_version"] == "2"
        check_all("2", 2)
        r = post(url, "/update_weights_from_disk", {"model_path": str(models["a"][0]) + "-missing",
                                                    "weight_version": "never"})
        assert r.status_code == 400
        check_all("2", 2)


def test_request_under_way_answers_the_old_name(tmp_path):
    """Job A has started (one request per step) when the update comes: A finishes on the old
    weights and is stamped with the old version, whose name is still the old one; job B, queued
    meanwhile, runs after the swap under the new name."""
    step = threading.Semaphore(0)
    log: list = []

    def engine(reqs: list[ScoreRequest], cancelled=None) -> list[RequestResult]:
        step.acquire(timeout=10)
        log.extend(r.tokens[0] for r in reqs)
        return [RequestResult(torch.zeros(r.num_scored), torch.zeros(r.num_scored, dtype=torch.long)) for r in reqs]

    fake = SimpleNamespace(weights_version=0, weight_version="0")

    def load_weights(path, weight_version=None):
        log.append("swap")
        fake.weights_version += 1
        fake.weight_version = weight_version or str(fake.weights_version)

    fake.load_weights = load_weights
    b = Batcher(engine, max_batch_tokens=2, max_queue_requests=10, max_queue_tokens=1000)
    weights = ServedWeights(fake, b)

    async def main():
        b.start()
        a = asyncio.ensure_future(b.submit_tagged([ScoreRequest([10 + i, 0, 0], 1) for i in range(3)]))
        await asyncio.sleep(0.05)
        step.release()
        await asyncio.sleep(0.05)
        swap = asyncio.ensure_future(asyncio.to_thread(weights.load, str(tmp_path), "new"))
        await asyncio.sleep(0.05)
        bjob = asyncio.ensure_future(b.submit_tagged([ScoreRequest([20, 0, 0], 1)]))
        for _ in range(3):
            await asyncio.sleep(0.05)
            step.release()
        out = await asyncio.gather(a, swap, bjob)
        b.close()
        return out

    (_, tag_a), version, (_, tag_b) = asyncio.run(main())
    assert log == [10, 11, 12, "swap", 20]
    assert (weights.name(tag_a), weights.name(tag_b), weights.weight_version) == ("0", "new", "new")
    assert (tag_a, version, tag_b) == (0, 1, 1)
