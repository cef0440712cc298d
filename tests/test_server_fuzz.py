"""Property-based fuzzing of the HTTP API from its own OpenAPI document (schemathesis + hypothesis).

The real stack (uvicorn + the app, loopback, ``--api-key``) on a tiny random Llama with the byte
tokenizer. Every operation in ``/openapi.json`` gets bodies that fit the schema (positive) and bodies
that break it (negative); every answer must be:

- no server error (no 5xx of any kind),
- a status code and content type the document declares, a body that fits the declared schema
  (the 200 reply models and ``ErrorReply``) and valid JSON (no NaN/Infinity),
- for a body that breaks the schema: a 4xx.

``LOGPROBE_FUZZ_EXAMPLES`` sets the examples per operation and mode (default 150);
``LOGPROBE_FUZZ_RANDOM=1`` explores new inputs instead of the fixed (derandomized) sequence CI runs;
``LOGPROBE_FUZZ_DEBUG=1`` prints every 400 (body and message; run pytest with ``-s``).
"""

from __future__ import annotations

import importlib
import json
import os
from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")

# schemathesis imports its OpenAPI loader lazily, and pytest compiles (assertion-rewrites) those
# modules at that moment: deep inside the fixture, with the server's threads running. CPython
# 3.11.7 once failed that compile in CI ("SystemError: AST constructor recursion depth mismatch",
# a CPython bug fixed in 3.11.8; the same run passed on a rerun). Import it at collection.
importlib.import_module("schemathesis.specs.openapi.schemas")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_util import serve  # noqa: E402

from logprobe.server import ServerConfig, create_app  # noqa: E402

pytestmark = pytest.mark.slow  # slow tier (pytest -m slow): fuzzing the HTTP API

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("LOGPROBE_FUZZ_EXAMPLES", "150"))
RANDOM = os.environ.get("LOGPROBE_FUZZ_RANDOM") == "1"
DEBUG = os.environ.get("LOGPROBE_FUZZ_DEBUG") == "1"  # print each 400's body and message (with pytest -s)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
SEEN: dict[str, Counter] = {}
CHECKPOINT: list[str] = []  # the served model's directory
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """(base URL, schemathesis schema) of a server on a tiny model; prints the status codes seen at the end."""
    from helpers import make_hf_dir

    from logprobe import Scorer

    d = tmp_path_factory.mktemp("fuzz-llama")
    make_hf_dir(d, "llama", seed=3)
    CHECKPOINT.append(str(d))  # nudge() reloads it through /update_weights_from_disk
    scorer = Scorer(str(d), device="cpu", dtype="float32", progress=False)
    scorer.tokenizer.hf.chat_template = CHAT_TEMPLATE  # /v1/chat/completions reaches the model
    app = create_app(scorer, ServerConfig(api_key=KEY, max_request_tokens=4096, max_request_items=32,
                                          max_body_bytes=1 << 20, max_top_logprobs=20,
                                          max_capture_floats=1 << 16))
    with serve(app) as url:
        schema = schemathesis.openapi.from_dict(app.openapi())
        yield url, schema
    print("\nstatus codes seen:", {op: dict(sorted(c.items())) for op, c in SEEN.items()})


def operations() -> list[tuple[str, str]]:
    """Every operation of the document (listed here: parametrizing needs them before the app exists;
    ``test_document_lists_every_operation`` keeps the list equal to the document)."""
    return [("POST", p) for p in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/score", "/v1/logprobs",
                                  "/v1/perplexity", "/generate", "/update_weights_from_disk",
                                  "/init_weights_update_group", "/update_weights_from_distributed",
                                  "/destroy_weights_update_group", "/flush_cache", "/pause_generation",
                                  "/continue_generation")] + \
        [("GET", p) for p in ("/v1/models", "/v1/models/{model}", "/tokenizer_info", "/health", "/ready", "/metrics",
                                 "/get_weight_version", "/flush_cache", "/get_load")]


def test_document_lists_every_operation(api):
    _, schema = api
    doc = schema.raw_schema
    listed = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert listed == set(operations())
    for p, ops in doc["paths"].items():
        for op in ops.values():
            assert "422" not in op["responses"], p  # bad bodies answer 400, and the document says so
            if op.get("requestBody"):
                assert {"200", "400", "401"} <= set(op["responses"]), p


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("method,path", operations(), ids=[f"{m} {p}" for m, p in operations()])
def test_fuzz(api, method, path, mode):
    url, schema = api
    op = schema[path][method]
    has_body = "requestBody" in schema.raw_schema["paths"][path][method.lower()]  # POST /flush_cache has none
    if not has_body and mode == "negative":
        pytest.skip("no inputs to break")
    gen = schemathesis.GenerationMode.POSITIVE if mode == "positive" else schemathesis.GenerationMode.NEGATIVE
    checks = CHECKS + ([negative_data_rejection] if mode == "negative" else [])
    seen = SEEN.setdefault(f"{method} {path} {mode}", Counter())

    cases = op.as_strategy(generation_mode=gen)
    if mode == "positive" and has_body:
        cases = st.one_of(cases, cases.map(lambda case: nudge(case, path)))

    @given(case=cases)
    @settings(max_examples=EXAMPLES if has_body else 5, deadline=None, database=None, derandomize=not RANDOM,
              suppress_health_check=list(HealthCheck), print_blob=True)
    def run(case):
        response = case.call(base_url=url, headers=AUTH, timeout=60)
        seen[response.status_code] += 1
        if DEBUG and response.status_code == 400:
            print(path, mode, json.dumps(case.body, default=str)[:150], "->", response.json()["error"]["message"][:150])
        case.validate_response(response, checks=checks, headers=AUTH)
        if response.headers.get("content-type", [""])[0].startswith("application/json"):
            json.loads(response.text, parse_constant=_refuse)  # NaN / Infinity are not JSON

    run()
    assert sum(seen.values()) > 0
    assert not [c for c in seen if c >= 500], seen


POINTS = ["blocks.0.resid_post", "blocks.*.mlp_out", "embed", "final_norm", "blocks.1.attn_out"]
IDS = {"prompt", "texts", "tokens", "prompt_token_ids", "completion_token_ids", "input_ids"}


def nudge(case, path: str):
    """The same body made likelier to reach the model, for half of the positive cases: what the
    schema cannot say (max_tokens 0 or 1, the served model name, ids inside the vocabulary, hook
    points that exist, vectors of the model's width) is set right, so the fuzzer also exercises the
    scoring paths and their replies, not only the refusals."""
    body = case.body
    if not isinstance(body, dict):
        return case
    b = {k: v for k, v in body.items() if k != "model"}
    seed = len(json.dumps(body, default=str))
    if path == "/v1/completions":
        for k in ("n", "best_of", "stream", "logit_bias", "presence_penalty", "frequency_penalty", "suffix"):
            b.pop(k, None)
        b["max_tokens"], b["echo"] = seed % 2, True
        if isinstance(b.get("logprobs"), int):
            b["logprobs"] %= 21
    if path == "/v1/chat/completions":  # scoring only, the last message the assistant's
        for k in ("n", "stream", "add_generation_prompt", "continue_final_message", "max_completion_tokens"):
            b.pop(k, None)
        b["max_tokens"], b["echo"], b["logprobs"] = 0, True, True
        for k in ("top_logprobs", "prompt_logprobs"):
            if isinstance(b.get(k), int):
                b[k] %= 21
        msgs = [m for m in b.get("messages") or [] if isinstance(m, dict)]
        b["messages"] = [{"role": "user", "content": "hi"}, *msgs[:3],
                         {"role": "assistant", "content": (msgs[-1].get("content") if msgs else None) or "ok"}]
    for k in ("prompt", "texts"):  # generated strings are short: repeat some, for long inputs and many windows
        if isinstance(b.get(k), str) and b[k].strip():
            b[k] = b[k] * (1 + seed % 60)
    if path == "/v1/score" and isinstance(b.get("continuations"), list):
        b["continuations"] = [c or "x" for c in b["continuations"]]
    if isinstance(b.get("top_k"), int):
        b["top_k"] %= 301
    if path == "/generate":  # one input, scoring only, positions inside it, alternatives under the cap
        if (b.get("input_ids") is None) == (b.get("text") is None):
            b.pop("text", None)
            b["input_ids"] = [(seed * (j + 7)) % 300 for j in range(1 + seed % 40)]
        sp = b.get("sampling_params")
        t = sp.get("temperature") if isinstance(sp, dict) else None
        b["sampling_params"] = {"max_new_tokens": 0, **({"temperature": abs(t) % 3} if isinstance(t, float) else {})}
        b.pop("stream", None)
        for k in ("return_logprob", "logprob_start_len", "top_logprobs_num", "rid"):
            if isinstance(b.get(k), list):
                b.pop(k)
        b["return_logprob"] = True
        if isinstance(b.get("logprob_start_len"), int):
            b["logprob_start_len"] = -1 if b["logprob_start_len"] < 0 else b["logprob_start_len"] % 2
        if isinstance(b.get("top_logprobs_num"), int):
            b["top_logprobs_num"] %= 21
    if path == "/update_weights_from_disk" and CHECKPOINT and seed % 4 == 0:
        b = {"model_path": CHECKPOINT[0]}
    for k in ("context_length", "max_tokens", "stride"):
        if path == "/v1/perplexity" and isinstance(b.get(k), int):
            b[k] = 2 + b[k] % 300
    if path == "/v1/perplexity" and b.get("policy") == "llama.cpp":
        b["policy"] = "sliding"
    b = _ids_in_vocab(b)
    for kind in ("capture", "steer"):
        for i, entry in enumerate(b.get(kind) or []):
            entry["at"] = POINTS[(seed + i) % len(POINTS)]
            if isinstance(entry.get("vector"), (list, dict)):
                entry["vector"] = [0.01 * (j % 7) for j in range(64)]
    case.body = b
    return case


def _ids_in_vocab(obj, key: str | None = None):
    if isinstance(obj, dict):
        return {k: _ids_in_vocab(v, k) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_ids_in_vocab(v, key) for v in obj]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool) and key in IDS and obj == obj // 1:
        return int(abs(obj) % 300)  # 22049.0 is an integer to JSON Schema: an id in the vocabulary
    return obj


def _refuse(name: str):
    raise AssertionError(f"{name} in a JSON reply")
