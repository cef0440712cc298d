"""Issue 23, bad bodies: every string is checked before a tokenizer sees it, no non-finite float
reaches JSON, and a request that would fail inside a shared engine batch is refused before it.

A tiny random Llama with the byte tokenizer (one token per UTF-8 byte) keeps this file fast; the
issue's exact bodies on the real default model are in ``test_server.py`` (``BAD``)."""

from __future__ import annotations

import json
import math

import pytest
import requests
from server_util import serve

from logprobe import LogprobeError, Scorer
from logprobe.io import check_text, dumps, json_safe
from logprobe.server import ServerConfig, create_app

KEY = "faults"
AUTH = {"Authorization": f"Bearer {KEY}"}


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity (Python's json accepts them; JSON does not)."""
    def refuse(name):
        raise AssertionError(f"{name} in JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers import make_hf_dir

    d = tmp_path_factory.mktemp("faults-llama")
    make_hf_dir(d, "llama", seed=4)
    return Scorer(str(d), device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def server(tiny):
    app = create_app(tiny, ServerConfig(api_key=KEY))
    with serve(app) as url:
        yield url, app


def post(url, path, body):
    return requests.post(url + path, json=body, headers=AUTH, timeout=60)


# -- the JSON layer --------------------------------------------------------------------------------


def test_json_layer_writes_null_with_a_reason():
    obj = {"perplexity": math.inf, "nll": 1.5, "logprobs": [-1.0, -math.inf, math.nan],
           "nested": {"x": [[1.0, math.nan]]}, "ok": [1, 2], "text": "é"}
    out = strict_json(dumps(obj))
    assert out["perplexity"] is None and out["perplexity_reason"] == \
        "1 value not representable in JSON (inf) written as null"
    assert out["logprobs"] == [-1.0, None, None] and "(-inf, nan)" in out["logprobs_reason"]
    assert out["nested"] == {"x": [[1.0, None]], "x_reason": "1 value not representable in JSON (nan) written as null"}
    assert "nll_reason" not in out and "ok_reason" not in out and out["text"] == "é"
    assert strict_json(dumps([math.nan, 1.0])) == [None, 1.0]  # no key to hang a reason on
    assert json_safe({"a": 1.0}) == {"a": 1.0}
    # a string with no UTF-8 form (only a bug could bring one): the document is ASCII-escaped, still valid
    text = dumps({"s": "a\ud800"})
    text.encode("utf-8")
    assert json.loads(text) == {"s": "a\ud800"}
    assert dumps({"a": [1, 2]}) == '{"a":[1,2]}' and dumps({"a": 1}, compact=False) == '{"a": 1}'


def test_check_text():
    assert check_text("héllo 𝄞", "prompt") == "héllo 𝄞"
    with pytest.raises(LogprobeError) as e:
        check_text("ab\udfffc", "texts[2]")
    assert str(e.value) == ("texts[2]: contains a lone surrogate (\\udfff) at character 2, which is not valid "
                            "Unicode; send UTF-8 text")
    assert e.value.field == "texts[2]"


# -- the library -----------------------------------------------------------------------------------


@pytest.mark.parametrize("call,field", [
    (lambda s: s.score("\ud800", "a"), "prompt"),
    (lambda s: s.score("a", ["b", "c\udc00"]), "continuations[1]"),
    (lambda s: s.loglikelihood([("a", "b"), ("a", "\ud800")]), "pairs[1][1]"),
    (lambda s: s.perplexity(["hello", "\ud800 there"]), "texts[1]"),
    (lambda s: s.perplexity("a"), "texts[0]"),  # one token + the prefix token: one NLL, no standard error
    (lambda s: s.perplexity([[7]]), "texts[0]"),
    (lambda s: s.perplexity([7]), "texts"),
    (lambda s: s.perplexity([[]]), "texts[0]"),
    (lambda s: s.perplexity("ab", prefix=False), "texts[0]"),
    (lambda s: s.perplexity(["abcdef", "x"], prefix=False), "texts[1]"),
    (lambda s: s.perplexity("abcdef", policy="llama.cpp", context_length=64), "texts[0]"),
    (lambda s: s.score("a", "b", temperature=1e-40), "temperature"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_library_refuses_with_the_field(tiny, call, field):
    with pytest.raises(LogprobeError) as e:
        call(tiny)
    assert e.value.field == field, str(e.value)
    assert str(e.value).startswith(field + ": ")


def test_perplexity_of_two_scored_tokens_is_fine(tiny):
    assert tiny.perplexity(["a", "b"]).num_tokens == 2  # each one token + prefix: two NLLs in all
    r = tiny.perplexity("abc", prefix=False)
    assert r.num_tokens == 2 and math.isfinite(r.perplexity_stderr)


# -- the server ------------------------------------------------------------------------------------


def test_overflowing_results_are_null_with_a_reason(server):
    """Numbers a float64 cannot hold answer 200 with null and a stated reason, never a 500 or NaN."""
    url, _ = server
    # 400 nats in one "word": its word perplexity exp(2400+) is beyond float64
    r = post(url, "/v1/perplexity", {"texts": "a" * 400})
    assert r.status_code == 200, r.text
    out = strict_json(r.text)
    assert out["word_perplexity"] is None and "(inf)" in out["word_perplexity_reason"]
    assert math.isfinite(out["perplexity"]) and math.isfinite(out["byte_perplexity"])
    # a tiny temperature: log-probs of -1e20, whose per-token perplexity exp(1e20) is beyond float64
    r = post(url, "/v1/score", {"prompt": "ab", "continuations": ["cd"], "temperature": 1e-20})
    assert r.status_code == 200, r.text
    res = strict_json(r.text)["results"][0]
    assert res["perplexity"] is None and "perplexity_reason" in res and res["log_prob"] < -1e15
    # steering by a huge vector: the model's own numbers overflow to NaN
    r = post(url, "/v1/score", {"prompt": "ab", "continuations": ["cd"], "entropy": True,
                                "steer": [{"at": "blocks.0.resid_post", "vector": [1e38] * 64, "coeff": 100.0}]})
    assert r.status_code == 200, r.text
    res = strict_json(r.text)["results"][0]
    assert res["token_logprobs"] == [None, None] and "token_logprobs_reason" in res


def test_what_would_fail_a_shared_batch_is_refused_before_it(server):
    """The head refuses top_k > vocab and a temperature that is 0 in float32, but there it would fail
    every request in the engine step: the server refuses them before queueing (no engine step)."""
    url, app = server
    batcher = app.state.batcher
    real, calls = batcher.run_batch, []
    batcher.run_batch = lambda reqs, cancelled=None: (calls.append(len(reqs)), real(reqs, cancelled))[1]
    try:
        bad = [("/v1/score", {"prompt": "ab", "continuations": ["c"], "top_k": 301}, "top_k"),
               ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [3], "completion_token_ids": [4]}],
                                 "top_k": 1000}, "top_k"),
               ("/v1/completions", {"prompt": "ab", "echo": True, "max_tokens": 0, "logprobs": 301}, "logprobs"),
               ("/v1/score", {"prompt": "ab", "continuations": ["c"], "temperature": 1e-45}, "temperature"),
               ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [3], "completion_token_ids": [4]}],
                                 "temperature": 1e-300}, "temperature")]
        for path, body, field in bad:
            r = post(url, path, body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert calls == []
        assert post(url, "/v1/score", {"prompt": "ab", "continuations": ["c"], "top_k": 300}).status_code == 200
        assert calls
    finally:
        batcher.run_batch = real


def test_field_names_and_dict_keys_with_lone_surrogates(server):
    url, _ = server
    for body, field, words in [
        ({"prompt": "x", "\ud800": 1}, "body", "a field name contains a lone surrogate"),
        ({"prompt": "ab", "continuations": ["c"], "steer": [{"vector": {"\ud800": [0.0] * 64}}]}, "steer[0].vector",
         "lone surrogate"),
        ({"prompt": "ab", "continuations": ["c"], "steer": [{"vector": [0.0] * 64, "at": "embed",
                                                            "coeff": {"\udc00": 1.0}}]}, "steer[0].coeff",
         "a key contains a lone surrogate"),
        ({"prompt": "ab", "continuations": ["c"], "capture": [{"at": "embed", "positions": "\ud800"}]},
         "capture[0].positions", "lone surrogate"),
    ]:
        r = post(url, "/tokenize" if "continuations" not in body else "/v1/score", body)
        assert r.status_code == 400, r.text
        err = strict_json(r.text)["error"]
        assert err["param"] == field and words in err["message"] and err["message"].startswith(field + ": "), err
        r.content.decode("utf-8")  # the reply is UTF-8, the surrogate written as \\ud800


def test_tokenize_empty_prompt(server):
    url, _ = server
    r = post(url, "/tokenize", {"prompt": "", "return_token_strs": True})
    assert r.json()["tokens"] == [] and r.json()["token_strs"] == []


def test_openapi_documents_every_reply(server):
    """The document states the 200 body and the error body of each route, and no 422 (bad bodies are 400s)."""
    url, _ = server
    doc = requests.get(url + "/openapi.json", headers=AUTH).json()
    for path, ops in doc["paths"].items():
        for op in ops.values():
            codes = set(op["responses"])
            assert "422" not in codes and "200" in codes, (path, codes)
    ref = doc["paths"]["/v1/perplexity"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert ref["$ref"].endswith("/ErrorReply")
    texts = doc["components"]["schemas"]["PerplexityBody"]["properties"]["texts"]
    assert {"type": "string", "minLength": 1} in texts["anyOf"]  # not {} (a plain validator hides the shape)
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
