"""HTTP answers on the real server stack (uvicorn, loopback sockets, the default model): a body the
JSON parser cannot read says where it failed and how to fix it (not FastAPI's bare "There was an
error parsing the body"); a chat message's role must be one the model's chat template takes, on
every chat door; HEAD on the GET routes (load balancers probe /health with it) answers as GET,
without a body."""

from __future__ import annotations

import json
import re
import socket

import pytest
import requests
from server_util import serve

from logprobe.errors import LogprobeError
from logprobe.server import ServerConfig, create_app

SMALL = {"sequences": [{"prompt_token_ids": [3, 4, 5], "completion_token_ids": [6, 7]}]}


@pytest.fixture(scope="module")
def server(default_scorer):
    with serve(create_app(default_scorer, ServerConfig(api_key="k"))) as url:
        yield url


AUTH = {"Authorization": "Bearer k"}


def post(url: str, path: str, data: bytes) -> requests.Response:
    return requests.post(url + path, data=data, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)


def error(r: requests.Response, status: int = 400) -> tuple[str, str]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"].startswith(f"{err['param']}: "), err  # "field: problem; fix", as every error
    return err["param"], err["message"]


# -- a body the parser cannot read ----------------------------------------------------------------

def test_a_body_that_is_not_utf8_names_the_byte(server):
    body = b'{"prompt": "caf\xe9", "continuations": [" au lait"]}'  # Latin-1, not UTF-8
    param, message = error(post(server, "/v1/score", body))
    assert param == "body"
    assert "is not valid UTF-8 at byte 15 (line 1, column 16" in message and "0xe9" in message
    assert "send the JSON text encoded as UTF-8" in message
    body = b'{"sequences": [],\n "model": "\xff"}'  # on line 2
    param, message = error(post(server, "/v1/logprobs", body))
    assert param == "body" and "at byte 29 (line 2, column 12" in message and "0xff" in message


def test_a_body_nested_ten_thousand_deep_says_so(server):
    for path, body in (("/v1/logprobs", b"[" * 10_000 + b"]" * 10_000),
                       ("/v1/score", b'{"prompt": "[[[", "continuations": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")):
        param, message = error(post(server, path, body))
        assert param == "body"
        assert "is nested deeper than the JSON parser reads" in message
        assert "this body reaches 10,00" in message  # 10,000 (10,001 inside the object)
        assert "none nests more than a few levels" in message
    assert requests.get(server + "/health", timeout=10).ok  # and the server is still serving


def test_a_json_syntax_error_names_its_line_and_column(server):
    param, message = error(post(server, "/v1/logprobs", b'{"sequences": [\n  {"prompt_token_ids": [1,, 2]}]}'))  # json: line 2 column 27
    assert param == "body"
    assert "is not valid JSON at line 2, column 27" in message and "send a JSON object" in message


# -- chat roles -----------------------------------------------------------------------------------

WIZARD = [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Abracadabra."},
          {"role": "assistant", "content": "Hello!"}]
ROLES = "use one of: system, user, assistant, tool, developer"  # SmolLM2's ChatML writes the role


def test_a_chat_role_the_template_does_not_take_is_refused(server, default_scorer):
    r = requests.post(server + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": WIZARD, "max_tokens": 0, "echo": True, "logprobs": True})
    param, message = error(r)
    assert param == "messages[1].role"
    assert "'wizard' is not a role the model's chat template takes" in message and ROLES in message
    # the library and a score table's messages column take the same path
    with pytest.raises(LogprobeError, match=re.escape(ROLES)) as e:
        default_scorer.score_chat(WIZARD)
    assert e.value.field == "messages[1].role"
    from logprobe.jobs.chat import chat_row_job
    from logprobe.scoring.options import HeadOptions

    with pytest.raises(LogprobeError, match="messages\\[1\\].role"):
        chat_row_job(json.dumps(WIZARD), default_scorer.context, HeadOptions())
    # the standard roles are taken
    ok = [{"role": "system", "content": "Be brief."}, *WIZARD[:1], WIZARD[2]]
    r = requests.post(server + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": ok, "max_tokens": 0, "echo": True, "logprobs": True})
    assert r.status_code == 200, r.text


def test_template_roles_of_common_templates():
    from logprobe.scoring.chat import template_roles

    llama3 = ("{% for message in messages %}{% if message.role == 'ipython' %}{% endif %}"
              "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] }}"
              "{% endfor %}")
    assert template_roles(llama3) == ("system", "user", "assistant", "tool", "developer", "ipython")
    mistral = ("{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] }}"
               "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% else %}"
               "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
    assert template_roles(mistral) == ("user", "assistant")
    gemma = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             "{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
             "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' }}"
             "{% endfor %}")
    assert "wizard" not in template_roles(gemma) and "user" in template_roles(gemma)
    assert template_roles({"default": mistral, "tool_use": mistral + "{% if m.role in ['tool'] %}{% endif %}"}) \
        == ("user", "assistant", "tool")


# -- HEAD -----------------------------------------------------------------------------------------

def raw(url: str, requests_: list[bytes]) -> bytes:
    """Send each request on one keep-alive connection; everything read until the peer has answered
    them all (a HEAD reply with a body would shift the next reply)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(10)
        s.sendall(b"".join(requests_))
        data = b""
        while data.count(b"HTTP/1.1 ") < len(requests_) or not _complete(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def _complete(data: bytes) -> bool:
    """The last reply's head is in, and its body if it has one (the last request is a GET)."""
    head, sep, body = data.rpartition(b"HTTP/1.1 ")[2].partition(b"\r\n\r\n")
    m = re.search(rb"(?i)content-length: (\d+)", head)
    return bool(sep) and m is not None and len(body) >= int(m.group(1))


def test_head_answers_as_get_without_a_body(server, default_scorer):
    name = requests.get(server + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]
    for path in ("/health", "/metrics", "/v1/models", f"/v1/models/{name}", "/get_weight_version", "/get_load",
                 "/tokenizer_info"):
        head = requests.head(server + path, headers=AUTH, timeout=10)
        get = requests.get(server + path, headers=AUTH, timeout=10)
        assert head.status_code == get.status_code == 200, (path, head.status_code)
        assert head.headers["content-type"] == get.headers["content-type"] and head.content == b""
    assert requests.head(server + "/health", timeout=10).status_code == 200  # open without the key, as GET
    assert requests.head(server + "/v1/models", timeout=10).status_code == 401
    assert requests.head(server + "/v1/models/no-such-model", headers=AUTH, timeout=10).status_code == 404
    # a GET with an effect is not probed: HEAD /flush_cache would empty the prefix cache
    assert requests.head(server + "/flush_cache", headers=AUTH, timeout=10).status_code == 405
    # no body on the wire: the next reply on the same connection is read intact
    data = raw(server, [b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"])
    first, second = data.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200 ") and first.endswith(b"\r\n\r\n")  # headers only
    assert second.startswith(b"200 ") and json.loads(second.partition(b"\r\n\r\n")[2])["status"] == "ok"
    assert "HEAD" not in json.dumps(requests.get(server + "/openapi.json", headers=AUTH, timeout=10).json()["paths"])


@pytest.mark.parametrize("path, body, param, words", [
    ("/generate", {"input_ids": [3, 4, 5], "image_data": ["data:image/png;base64,AA=="],
                   "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0},
     "image_data", "no vision tower"),
    ("/v1/logprobs", {"sequences": [{**SMALL["sequences"][0], "multi_modal_data": {"image": ["x"]}}]},
     "sequences[0].multi_modal_data.image", "no vision tower"),
    ("/v1/logprobs", {**SMALL, "multi_modal_data": {"image": ["x"]}}, "multi_modal_data", "does not take them yet"),
    ("/generate", {"input_ids": [3, 4, 5], "video_data": ["x"], "return_logprob": True}, "video_data",
     "does not take them yet"),
    ("/v1/completions", {"prompt": [3, 4], "max_tokens": 0, "echo": True, "logprobs": 0,
                         "multi_modal_data": {"image": ["x"]}}, "multi_modal_data", "does not take them yet"),
])
def test_media_fields_are_named_for_what_they_are(server, path, body, param, words):
    """Images for this text-only model (SGLang's image_data, verl's multi_modal_data) are refused
    naming them; video, and media on routes that take none, as media not taken yet (the text
    would otherwise be scored without them), not as a misspelt field."""
    p, msg = error(post(server, path, json.dumps(body).encode()))
    assert p == param and words in msg, msg
