"""``/v1/chat/completions`` (``server.chat_compat``): the final assistant message of a conversation
scored under the default model's chat template, asked for as vLLM's prompt-logprob chat request
through the ``openai`` SDK against a real server; the numbers are ``Scorer.score_chat``'s."""

from __future__ import annotations

import pytest
import requests
from server_util import serve

from logprobe.server import create_app

openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."}]


@pytest.fixture(scope="module")
def server(default_scorer):
    with serve(create_app(default_scorer)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def test_echo_logprobs_are_the_last_message_tokens(client, default_scorer):
    want = default_scorer.score_chat(CHAT, top_k=2)
    name = client.models.list().data[0].id
    r = client.chat.completions.create(model=name, messages=CHAT, max_tokens=0, logprobs=True, top_logprobs=2,
                                       extra_body={"echo": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == CHAT[-1]["content"] and r.usage.completion_tokens == 0
    got = choice.logprobs.content
    assert [t.token for t in got] == want.tokens
    assert [t.logprob for t in got] == pytest.approx(want.token_logprobs, abs=1e-5)
    assert [[a.token for a in t.top_logprobs] for t in got] == [[s for _, s, _ in alts] for alts in want.top_k]
    assert all(t.bytes == list(t.token.encode()) for t in got)


def test_text_content_parts_through_the_sdk(client, default_scorer):
    """The SDK's content-part form of the same conversation scores the same tokens, bitwise."""
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    want = default_scorer.score_chat(CHAT)
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=parts, max_tokens=0,
                                       logprobs=True, extra_body={"echo": True})
    assert r.choices[0].message.content == CHAT[-1]["content"]
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(want.token_logprobs, abs=1e-5)


def test_prompt_logprobs_cover_the_templated_conversation(client, default_scorer):
    hf = default_scorer.tokenizer.hf
    ids = hf.apply_chat_template(CHAT, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT, max_tokens=0,
                                       extra_body={"prompt_logprobs": 1})
    entries = r.model_extra["prompt_logprobs"]
    assert r.usage.prompt_tokens == len(ids) == len(entries) and entries[0] is None
    assert r.choices[0].logprobs is None and r.choices[0].message.content == ""
    assert all(next(iter(e)) == str(t) for e, t in zip(entries[1:], ids[1:]))  # the token itself first
    want = default_scorer.score_chat(CHAT)
    tail = [e[str(t)]["logprob"] for e, t in zip(entries[-want.num_tokens:], want.token_ids)]
    assert tail == pytest.approx(want.token_logprobs, abs=1e-5)
    assert all(min(v["rank"] for v in e.values()) == 1 for e in entries[1:])


@pytest.mark.parametrize("body, param", [
    ({"messages": CHAT, "logprobs": True, "echo": True}, "max_tokens"),  # OpenAI's default would generate
    ({"messages": CHAT, "max_tokens": 0}, "echo"),
    ({"messages": CHAT, "max_tokens": 0, "echo": True, "logprobs": True, "add_generation_prompt": True},
     "add_generation_prompt"),
    ({"messages": CHAT[:1], "max_tokens": 0, "prompt_logprobs": 0}, "messages"),
    ({"messages": [CHAT[0], {"role": "assistant"}], "max_tokens": 0, "prompt_logprobs": 0}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
                   CHAT[1]], "max_tokens": 0, "prompt_logprobs": 0}, "messages[0].content[1]"),
])
def test_refusals_name_the_field(server, body, param):
    r = requests.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
