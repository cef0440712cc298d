"""Chat conversations: ``Scorer.score_chat`` scores the final assistant message under the model's
own chat template; the ``score`` table job takes a ``messages`` column (JSON list) the same way."""

from __future__ import annotations

import json

import pytest

from logprobe.errors import LogprobeError

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."}]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def template_ids(hf, messages, generation_prompt=False) -> list[int]:
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_score_chat_is_the_assistant_turn_under_the_template(default_scorer):
    s, hf = default_scorer, default_scorer.tokenizer.hf
    got = s.score_chat(CHAT)
    context, full = template_ids(hf, CHAT[:-1], True), template_ids(hf, CHAT)
    assert full[:len(context)] == context and got.token_ids == full[len(context):]
    assert got.continuation == "The capital of France is Paris.<|im_end|>\n"
    assert got.tokens[-2:] == ["<|im_end|>", "\n"] and got.num_tokens == len(got.token_logprobs) == 9
    # the same numbers as the token-id route on the template's ids, bitwise
    want = s.logprobs([{"prompt_token_ids": context, "completion_token_ids": got.token_ids}])[0]
    assert got.token_logprobs == want.logprobs.tolist() and got.log_prob == want.sum_logprob
    # the answer matters: a wrong one is less likely
    wrong = s.score_chat([*CHAT[:-1], {"role": "assistant", "content": "The capital of France is Rome."}])
    assert wrong.log_prob < got.log_prob
    top = s.score_chat(CHAT, top_k=2, entropy=True)
    assert top.token_logprobs == got.token_logprobs and len(top.top_k) == len(top.entropy) == 9


def test_one_bos_with_a_template_that_writes_it(tiny_dirs):
    """A template that writes {{ bos_token }}: the template's own tokenization adds no second one."""
    from logprobe import Scorer

    s = Scorer(str(tiny_dirs["llama"][0]), device="cpu", dtype="float32", progress=False)
    with pytest.raises(LogprobeError, match="no chat template") as e:  # the byte tokenizer has none
        s.score_chat(CHAT)
    assert e.value.field == "messages"
    s.tokenizer.hf.chat_template = TEMPLATE
    got = s.score_chat(CHAT)
    bos = s.tokenizer.bos_id
    context = template_ids(s.tokenizer.hf, CHAT[:-1], True)
    assert context[0] == bos and context.count(bos) == 1 and bos not in got.token_ids
    assert s.tokenizer.decode(context + got.token_ids) == \
        "<s><|system|>You are terse.<|endoftext|><|user|>What is the capital of France?<|endoftext|><|assistant|>" \
        "The capital of France is Paris.<|endoftext|>"
    assert got.continuation == "The capital of France is Paris.<|endoftext|>"


@pytest.mark.parametrize("bad, field, words", [
    ("hi", "messages", "at least two"), ([CHAT[-1]], "messages", "at least two"),
    ([CHAT[1], {"role": "user", "content": "x"}], "messages[1].role", "must be the assistant's"),
    ([CHAT[1], {"role": "assistant"}], "messages[1]", "a content"),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
      CHAT[1]], "messages[0].content[1]", "image_url part"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, CHAT[1]], "messages[0].content[0]",
     "input_audio part"),
    ([{"role": "user", "content": [{"type": "text"}]}, CHAT[1]], "messages[0].content[0]", "text part"),
    ([{"role": "user", "content": ["Hi"]}, CHAT[1]], "messages[0].content[0]", "text part"),
])
def test_bad_messages(default_scorer, bad, field, words):
    with pytest.raises(LogprobeError) as e:
        default_scorer.score_chat(bad)
    assert e.value.field == field and words in str(e.value)


def test_text_parts_are_the_joined_string(default_scorer):
    """OpenAI content parts of text: the conversation scored as if each message's parts were one
    string joined by newlines (vLLM's rendering for string templates)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "The capital of France is Paris."}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}, CHAT[-1]]
    a, b = default_scorer.score_chat(parts), default_scorer.score_chat(joined)
    assert a.token_ids == b.token_ids and a.token_logprobs == b.token_logprobs


def test_score_rows_take_a_messages_column(default_scorer):
    """The table job (``logprobe score --input``): a ``messages`` column, a list or JSON text (CSV),
    gives the library's numbers; a bad one is that row's error."""
    from logprobe.io.tables import Row
    from logprobe.jobs import ScoreRows, map_rows

    rows = [Row(0, "row 1", {"messages": CHAT}), Row(1, "row 2", {"messages": json.dumps(CHAT)}),
            Row(2, "row 3", {"messages": "[1, 2"}), Row(3, "row 4", {"messages": CHAT[:2]})]
    out = map_rows(default_scorer, ScoreRows(), rows)
    want = default_scorer.score_chat(CHAT)
    for o in out[:2]:  # batched with the other row (not deterministic mode): equal to float32 rounding
        assert (o["continuation"], o["num_tokens"], o["is_greedy"]) == (want.continuation, want.num_tokens,
                                                                        want.is_greedy)
        assert o["log_prob"] == pytest.approx(want.log_prob, abs=1e-4)
        assert o["token_logprobs"] == pytest.approx(want.token_logprobs, abs=1e-4)
    assert out[2]["error"].startswith("messages: is not a JSON list")
    assert out[3]["error"].startswith("messages[1].role: is 'user'")


def test_media_in_a_sequence_is_refused(default_scorer):
    """verl's and vLLM's multimodal field beside token ids: refused by name (the ids would be
    scored without the image), in the library as over HTTP."""
    seq = {"prompt_token_ids": [3, 4, 5], "completion_token_ids": [6], "multi_modal_data": {"image": ["x"]}}
    with pytest.raises(LogprobeError) as e:
        default_scorer.logprobs([{"prompt_token_ids": [3, 4], "completion_token_ids": [5]}, seq])
    assert e.value.field == "sequences[1].multi_modal_data" and "does not take them yet" in str(e.value)
