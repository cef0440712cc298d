"""The HTTP server on the real stack (uvicorn + FastAPI, loopback) and the real default model:
numbers against the float64 reference and the library, bad input -> clear 4xx JSON, auth, limits."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from helpers import ref_logprobs
from server_util import serve

from logprobe.server import ServerConfig, create_app

TOL = 1e-4
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(default_scorer):
    app = create_app(default_scorer, ServerConfig(max_request_tokens=20_000, max_request_items=50,
                                                  max_body_bytes=1 << 20, max_top_logprobs=20))
    with serve(app) as url:
        yield url, app


def post(url, path, body, **kw):
    return requests.post(url + path, json=body, timeout=120, **kw)


def test_completions_echo_matches_reference(server, default_scorer, default_reference):
    url, _ = server
    tok = default_scorer.tokenizer
    ids = tok.encode("Question: What is the boiling point of water at sea level?\nAnswer: 100 degrees")
    r = post(url, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 3})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ref = ref_logprobs(default_reference, ids)  # [L, V] float64
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"] == tok.token_texts(ids)
    for j in range(1, len(ids)):
        assert abs(lp["token_logprobs"][j] - ref[j - 1, ids[j]].item()) < TOL
        top = lp["top_logprobs"][j]
        want = ref[j - 1].topk(3)
        names = tok.token_texts(want.indices.tolist())
        for name, v in zip(names, want.values.tolist()):
            assert abs(top[name] - v) < TOL
        assert tok.token_texts([ids[j]])[0] in top  # the scored token is always there
        assert len(top) in (3, 4)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                                 "prompt_tokens_details": {"cached_tokens": 0}}


def test_completions_one_greedy_token(server, default_scorer, default_reference):
    url, _ = server
    tok = default_scorer.tokenizer
    r = post(url, "/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 1, "logprobs": 1,
                                      "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    ids = tok.encode(PROMPT)
    ref = ref_logprobs(default_reference, ids)
    greedy = int(ref[-1].argmax())
    assert lp["tokens"][-1] == tok.token_texts([greedy])[0] == " Paris"
    assert choice["text"] == PROMPT + " Paris"
    assert abs(lp["token_logprobs"][-1] - ref[-1, greedy].item()) < TOL
    assert len(lp["token_logprobs"]) == len(ids) + 1
    # lm-eval's greedy test: each scored token equals the max of its top_logprobs exactly
    for t, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert (t == max(top.values())) == (t >= max(top.values()))
    # echo false: only the generated token
    r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 0})
    lp2 = r.json()["choices"][0]["logprobs"]
    assert lp2["tokens"] == [" Paris"] and lp2["text_offset"] == [len(PROMPT)]
    assert lp2["token_logprobs"][0] == lp["token_logprobs"][-1]


def test_lm_eval_payload_equals_loglikelihood(server, default_scorer):
    """What lm-eval's local-completions sends, and how it reads the reply."""
    url, _ = server
    tok = default_scorer.tokenizer
    pairs = [("The capital of France is", " Paris"), ("2 + 2 =", " 4"), ("Water boils at", " 100 degrees")]
    batch, ctxlens = [], []
    for ctx, cont in pairs:
        c, w = tok.encode(ctx), tok.encode(ctx + cont)
        batch.append(w)
        ctxlens.append(len(c))
    r = post(url, "/v1/completions", {"model": "smollm2-135m", "prompt": batch, "temperature": 0, "max_tokens": 1,
                                      "logprobs": 1, "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    want = default_scorer.loglikelihood(pairs)
    for choice, ctxlen, (lp, greedy) in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), ctxlens, want):
        got = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        is_greedy = all(t == max(top.values()) for t, top in zip(choice["logprobs"]["token_logprobs"][ctxlen:-1],
                                                                 choice["logprobs"]["top_logprobs"][ctxlen:-1]))
        assert abs(got - lp) < TOL and is_greedy == greedy


def test_text_prompts_and_lists(server, default_scorer):
    url, _ = server
    r = post(url, "/v1/completions", {"prompt": ["Hello world", "One two three"], "echo": True, "max_tokens": 0,
                                      "logprobs": 0})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[1]["text"] == "One two three"
    assert all(len(top) == 1 for top in choices[1]["logprobs"]["top_logprobs"][1:])
    # no logprobs asked: text only, no model call needed
    r = post(url, "/v1/completions", {"prompt": "Hi", "echo": True, "max_tokens": 0})
    assert r.json()["choices"][0]["logprobs"] is None and r.json()["choices"][0]["text"] == "Hi"


def test_tokenizer_endpoints(server, default_scorer):
    url, _ = server
    tok = default_scorer.tokenizer
    info = requests.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["add_bos_token"] is False
    r = post(url, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["token_strs"][-1] == " is"
    assert post(url, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == PROMPT
    models = requests.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == "smollm2-135m"


def test_native_endpoints_equal_library(server, default_scorer):
    url, _ = server
    r = post(url, "/v1/score", {"prompt": PROMPT, "continuations": [" Paris", " London"], "top_k": 2,
                                "entropy": True})
    assert r.status_code == 200, r.text
    lib = default_scorer.score(PROMPT, [" Paris", " London"], top_k=2, entropy=True)
    for got, want in zip(r.json()["results"], lib):
        assert abs(got["log_prob"] - want.log_prob) < TOL and got["is_greedy"] == want.is_greedy
        assert got["tokens"] == want.tokens and abs(got["entropy"][0] - want.entropy[0]) < TOL

    seqs = [{"prompt_token_ids": [504, 3575, 282], "completion_token_ids": [4649, 314, 6118]},
            {"prompt_token_ids": [1], "completion_token_ids": [504, 3575]}]
    r = post(url, "/v1/logprobs", {"sequences": seqs, "temperature": 0.7, "top_k": 3})
    assert r.status_code == 200, r.text
    lib = default_scorer.logprobs(seqs, temperature=0.7, top_k=3)
    for got, want in zip(r.json()["results"], lib):
        assert torch.allclose(torch.tensor(got["logprobs"]), want.logprobs, atol=TOL)
        assert got["top_k_ids"] == want.topk_ids.tolist()

    text = "The tower is 324 metres tall, about the same height as an 81-storey building. " * 6
    r = post(url, "/v1/perplexity", {"texts": text, "context_length": 64, "stride": 16})
    assert r.status_code == 200, r.text
    want = default_scorer.perplexity(text, context_length=64, stride=16)
    got = r.json()
    assert got["num_tokens"] == want.num_tokens and math.isclose(got["perplexity"], want.perplexity, rel_tol=1e-5)
    assert math.isclose(got["word_perplexity"], want.word_perplexity, rel_tol=1e-5)


BAD = [
    # (path, raw body or json, status, param, words in the message)
    ("/v1/completions", b'{"prompt": "x",', 400, "body", "not valid JSON"),
    ("/v1/completions", b'[1, 2]', 400, "body", "JSON object"),
    ("/v1/completions", {"prompt": 5, "echo": True, "max_tokens": 0}, 400, "prompt", "must be a string"),
    ("/v1/completions", {"prompt": "", "echo": True, "max_tokens": 0, "logprobs": 1}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [], "echo": True, "max_tokens": 0}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [1, 49152], "echo": True, "max_tokens": 0, "logprobs": 1}, 400, "prompt[1]",
     "outside the vocabulary"),
    ("/v1/completions", {"prompt": [[1, 2], [3, -1]], "echo": True, "max_tokens": 0}, 400, "prompt[1][1]",
     "outside the vocabulary"),
    ("/v1/completions", {"prompt": [1, True], "echo": True, "max_tokens": 0}, 400, "prompt", "mixture"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 2}, 400, "max_tokens", "at most one token"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "echo", "nothing to return"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": "1"}, 400, "logprobs",
     "integer"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 21}, 400, "logprobs", "cap"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 0, "echos": True}, 400, "echos",
     "not a known field"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 1, "temperature": -1}, 400, "temperature",
     "greater than or equal to 0"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 1, "stream": True}, 400, "stream",
     "not supported"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 1, "model": "gpt-4"}, 404, "model",
     "not served"),
    ("/v1/completions", {"prompt": [[1, 2]] * 51, "echo": True, "max_tokens": 0}, 413, "prompt", "limit of 50"),
    ("/v1/completions", {"prompt": [7] * 30_000, "echo": True, "max_tokens": 0, "logprobs": 0}, 400, "prompt",
     "context"),
    ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [1], "completion_token_ids": [2]}],
                      "temperature": 0}, 400, "temperature", "greater than 0"),
    ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [], "completion_token_ids": [2]}]}, 400,
     "sequences[0].prompt_token_ids", "at least 1"),
    ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [1], "completion_token_ids": [2.5]}]}, 400,
     "sequences[0].completion_token_ids[0]", "integer"),
    ("/v1/logprobs", {"sequences": []}, 400, "sequences", "at least 1"),
    ("/v1/logprobs", {}, 400, "sequences", "required"),
    ("/v1/score", {"prompt": PROMPT, "continuations": []}, 400, "continuations", "at least 1"),
    ("/v1/score", {"prompt": PROMPT, "continuations": ["a"], "top_k": -1}, 400, "top_k", "greater than"),
    ("/v1/perplexity", {"texts": "  "}, 400, "texts[0]", "empty"),
    ("/v1/perplexity", {"texts": "hello there", "policy": "nope"}, 400, "policy", "sliding"),
    ("/v1/perplexity", {"texts": "word " * 30_000, "context_length": 64}, 413, "body", "input tokens exceed"),
    ("/tokenize", {"text": "x"}, 400, "text", "not a known field"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens[0]", "outside the vocabulary"),
    # issue 23: these were 500s; a text of one token has no perplexity (with the prefix token: one NLL, no
    # standard error), and a lone surrogate (valid JSON, not valid Unicode) is refused before the tokenizer
    ("/v1/perplexity", {"texts": "abc"}, 400, "texts[0]", "at least 2"),
    ("/v1/perplexity", {"texts": [[5]]}, 400, "texts[0]", "at least 2"),
    ("/v1/perplexity", {"texts": [5]}, 400, "texts", "at least 2"),
    ("/v1/perplexity", {"texts": [[]]}, 400, "texts[0]", "at least one scored token"),
    ("/v1/perplexity", {"texts": "abc def", "prefix": False}, 400, "texts[0]", "at least 2"),
    ("/v1/perplexity", {"texts": "abc def ghi", "policy": "llama.cpp", "context_length": 64}, 400, "texts[0]",
     "chunk"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt", "lone surrogate (\\ud800) at character 0"),
    ("/v1/score", {"prompt": "x\ud800", "continuations": ["a"]}, 400, "prompt", "at character 1"),
    ("/v1/score", {"prompt": PROMPT, "continuations": [" a", "\udc00"]}, 400, "continuations[1]", "lone surrogate"),
    ("/v1/score", {"prompt": PROMPT, "continuations": [" a"], "model": "\udfff"}, 400, "model", "lone surrogate"),
    ("/v1/score", {"prompt": PROMPT, "continuations": [" a"], "capture": [{"at": ["embed", "\ud800"]}]}, 400,
     "capture[0].at[1]", "lone surrogate"),
    ("/v1/completions", {"prompt": "\ud800", "echo": True, "max_tokens": 0, "logprobs": 0}, 400, "prompt",
     "lone surrogate"),
    ("/v1/completions", {"prompt": ["ok", "\ud800"], "echo": True, "max_tokens": 0, "logprobs": 0}, 400, "prompt[1]",
     "lone surrogate"),
    ("/v1/completions", {"prompt": "ok", "echo": True, "max_tokens": 0, "stop": ["\ud800"]}, 400, "stop[0]",
     "lone surrogate"),
    ("/v1/perplexity", {"texts": "\ud800 hello there"}, 400, "texts", "lone surrogate"),
    ("/v1/perplexity", {"texts": ["hello there", "\ud800"]}, 400, "texts[1]", "lone surrogate"),
    ("/v1/completions", {"prompt": "ok", "echo": True, "max_tokens": 0, "logit_bias": {"\ud800": 1}}, 400,
     "logit_bias", "a key contains a lone surrogate"),
    ("/v1/score", {"prompt": PROMPT, "continuations": [" a"], "top_k": 10 ** 6}, 400, "top_k", "more than"),
    ("/v1/score", {"prompt": PROMPT, "continuations": [" a"], "temperature": 1e-300}, 400, "temperature", "float32"),
    ("/v1/completions", {"prompt": "ok", "echo": True, "max_tokens": 0, "logprobs": 10 ** 6}, 400, "logprobs",
     "cap"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_clear_4xx(server, path, body, status, param, words):
    url, _ = server
    if isinstance(body, bytes):
        r = requests.post(url + path, data=body, headers={"Content-Type": "application/json"}, timeout=60)
    else:
        r = post(url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err
    assert err["message"].startswith(param), err  # "field: problem; fix"
    # and the server keeps serving
    assert requests.get(url + "/health").json()["status"] == "ok"


def test_body_too_large_and_unknown_route(server):
    url, _ = server
    r = requests.post(url + "/v1/completions", data=b"x" * (1 << 21), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "exceed the limit" in r.json()["error"]["message"]
    r = requests.get(url + "/v2/nothing")
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]
    r = requests.get(url + "/v1/completions")
    assert r.status_code == 405


def test_openapi_document(server):
    url, _ = server
    doc = requests.get(url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/score", "/v1/logprobs", "/v1/perplexity", "/tokenize"} <= set(doc["paths"])


def test_concurrent_requests_share_engine_steps(server, default_scorer):
    """16 clients at once: every answer right, and at least one engine step served several of them."""
    url, app = server
    before = _steps_with_several(app)
    prompts = [f"Number {i} is followed by" for i in range(16)]
    want = default_scorer.loglikelihood([(p, " the") for p in prompts])
    start = threading.Barrier(16)

    def call(p):
        start.wait()
        return post(url, "/v1/score", {"prompt": p, "continuations": [" the"]})

    with ThreadPoolExecutor(16) as ex:
        replies = list(ex.map(call, prompts))
    for r, (lp, _) in zip(replies, want):
        assert r.status_code == 200 and abs(r.json()["results"][0]["log_prob"] - lp) < 5e-5
    assert _steps_with_several(app) > before
    text = requests.get(url + "/metrics").text
    assert 'logprobe_http_requests_total{endpoint="/v1/score",status="200"}' in text
    assert "logprobe_tokens_scored_total" in text and "logprobe_queue_requests" in text


def _steps_with_several(app) -> float:
    """Engine steps that served more than one HTTP request (from the batch histogram)."""
    h = app.state.metrics.batch_jobs
    samples = {s.labels["le"]: s.value for s in h.collect()[0].samples if s.name.endswith("_bucket")}
    return samples["+Inf"] - samples["1.0"]


def test_api_key(default_scorer):
    app = create_app(default_scorer, ServerConfig(api_key="s3cret"))
    with serve(app) as url:
        body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 0}
        r = post(url, "/v1/completions", body)
        assert r.status_code == 401 and "missing" in r.json()["error"]["message"]
        assert r.headers["WWW-Authenticate"] == "Bearer"
        r = post(url, "/v1/completions", body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "wrong" in r.json()["error"]["message"]
        assert requests.get(url + "/health").status_code == 200  # probes need no key
        assert requests.get(url + "/metrics").status_code == 401
        r = post(url, "/v1/completions", body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200


def test_queue_full_answers_429(default_scorer):
    """A blocked engine and a queue of 1: the second request gets 429 with Retry-After, then all recovers."""
    app = create_app(default_scorer, ServerConfig(max_queue_requests=1))
    batcher = app.state.batcher
    gate = threading.Event()
    real = batcher.run_batch

    def slow(requests_, cancelled=None):
        gate.wait(30)
        return real(requests_, cancelled)

    batcher.run_batch = slow
    with serve(app) as url:
        body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 0}
        with ThreadPoolExecutor(1) as ex:
            first = ex.submit(post, url, "/v1/completions", body)
            while batcher.queue_depth[0] == 0:
                threading.Event().wait(0.01)
            r = post(url, "/v1/completions", body)
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
            gate.set()
            assert first.result().status_code == 200
        assert post(url, "/v1/completions", body).status_code == 200


def test_openai_client(server, default_scorer):
    openai = pytest.importorskip("openai")
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="smollm2-135m", prompt=PROMPT, echo=True, logprobs=2, max_tokens=1,
                                    temperature=0)
    lp = out.choices[0].logprobs
    assert lp.tokens[-1] == " Paris" and lp.token_logprobs[0] is None
    assert abs(lp.token_logprobs[-1] - default_scorer.score(PROMPT, " Paris")[0].log_prob) < TOL
    assert out.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=5)
    assert "max_tokens" in str(e.value)


def test_deterministic_server_ignores_concurrent_traffic(default_scorer):
    """With --deterministic, a request's numbers are bitwise the same alone and amid other requests."""
    from logprobe import EngineConfig, Scorer

    scorer = Scorer(default_scorer.loaded, config=EngineConfig(deterministic=True))
    app = create_app(scorer, ServerConfig())
    body = {"prompt": "Question: Which planet is closest to the Sun?\nAnswer:", "continuations": [" Mercury", " Venus"]}
    with serve(app) as url:
        alone = post(url, "/v1/score", body).json()["results"]
        start = threading.Barrier(9)

        def call(i):
            start.wait()
            if i == 0:
                return post(url, "/v1/score", body)
            return post(url, "/v1/completions", {"prompt": f"Some other text number {i} " * (i + 1), "echo": True,
                                                 "max_tokens": 1, "logprobs": 2})

        with ThreadPoolExecutor(9) as ex:
            replies = list(ex.map(call, range(9)))
    assert all(r.status_code == 200 for r in replies)
    assert replies[0].json()["results"] == alone  # JSON floats: equal bits


def test_scoring_replies_skip_fastapi_encoder(server, monkeypatch):
    """The scoring routes hand FastAPI a finished Response: its ``jsonable_encoder`` (a Python walk
    over every float of the reply, most of the serving thread's time) never runs for them."""
    import fastapi.routing

    def boom(*a, **k):
        raise AssertionError("jsonable_encoder ran")

    monkeypatch.setattr(fastapi.routing, "jsonable_encoder", boom)
    url, _ = server
    ids = [1, 504, 3575, 282, 10]
    for path, body in [("/v1/score", {"prompt": PROMPT, "continuations": [" Paris"]}),
                       ("/v1/logprobs", {"sequences": [{"prompt_token_ids": ids[:2], "completion_token_ids": ids[2:]}]}),
                       ("/v1/perplexity", {"texts": ["The quick brown fox jumps over the lazy dog."]}),
                       ("/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1}),
                       ("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                      "return_logprob": True, "logprob_start_len": 0})]:
        r = post(url, path, body)
        assert r.status_code == 200, (path, r.text[:300])
    r = requests.get(url + "/v1/models")  # a small reply still goes through FastAPI's path: the patch bites
    assert r.status_code == 500


def test_switch_interval_set_while_serving_and_restored(default_scorer):
    """ServerConfig.switch_interval is the process's interpreter switch interval while the app
    runs (the engine thread waits less for the lock the HTTP work holds), restored after; None
    leaves it alone; bad values are refused by name."""
    import sys

    from logprobe.errors import LogprobeError

    before = sys.getswitchinterval()
    with serve(create_app(default_scorer, ServerConfig(switch_interval=0.0007))) as url:
        assert requests.get(url + "/health").status_code == 200
        assert sys.getswitchinterval() == pytest.approx(0.0007)
    assert sys.getswitchinterval() == pytest.approx(before)
    with serve(create_app(default_scorer, ServerConfig(switch_interval=None))):
        assert sys.getswitchinterval() == pytest.approx(before)
    assert ServerConfig().switch_interval == 0.0005
    for bad in (0, -1, 2, True, "0.001"):
        with pytest.raises(LogprobeError, match="switch_interval: must be a number of seconds in"):
            ServerConfig(switch_interval=bad)
