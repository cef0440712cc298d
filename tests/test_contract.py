"""The prompt/continuation boundary rule, with a word-level fake tokenizer and the real one."""

from __future__ import annotations

import re

import pytest

from logprobe.errors import LogprobeError
from logprobe.scoring.contract import split_continuation

VOCAB: dict[str, int] = {}


def fake_encode(text: str) -> list[int]:
    """GPT-2-like: a space is glued to the word after it."""
    return [VOCAB.setdefault(p, len(VOCAB) + 10) for p in re.findall(r" ?\S+| +$", text)]


def toks(ids):
    inv = {v: k for k, v in VOCAB.items()}
    return [inv.get(i, i) for i in ids]


@pytest.mark.parametrize("prompt, cont, gold_ctx, gold_cont", [
    ("The capital of France is", " Paris", ["The", " capital", " of", " France", " is"], [" Paris"]),
    # trailing whitespace of the prompt moves onto the continuation
    ("The capital of France is ", "Paris", ["The", " capital", " of", " France", " is"], [" Paris"]),
    ("a b", " c d", ["a", " b"], [" c", " d"]),
    # empty prompt: the prefix token stands in
    ("", "Paris", [1], ["Paris"]),
])
def test_split_gold(prompt, cont, gold_ctx, gold_cont):
    ctx, c = split_continuation(prompt, cont, fake_encode, prefix_id=1)
    assert toks(ctx) == gold_ctx
    assert toks(c) == gold_cont


def test_bos_precedes_prompt_when_the_model_adds_it():
    ctx, c = split_continuation("a", " b", fake_encode, prefix_id=1, add_bos=True, bos_id=1)
    assert ctx[0] == 1 and toks(ctx[1:]) == ["a"] and toks(c) == [" b"]


def test_empty_and_vanishing_continuations():
    with pytest.raises(LogprobeError, match="continuation"):
        split_continuation("a", "", fake_encode, 1)
    # "   " after "a" moves nowhere: trailing spaces of the prompt plus the continuation's own
    with pytest.raises(LogprobeError, match="tokenizes to nothing"):
        split_continuation("a", "x", lambda s: [] if s == "x" else fake_encode(s), 1)


def test_real_tokenizer_boundary(default_scorer):
    tok = default_scorer.tokenizer
    ctx, cont = split_continuation("The capital of France is ", "Paris", tok.encode, tok.prefix_id)
    assert tok.token_texts(cont) == [" Paris"]
    assert ctx == tok.encode("The capital of France is")
    ctx2, cont2 = split_continuation("The capital of France is", "Paris", tok.encode, tok.prefix_id)
    assert tok.token_texts(cont2) != [" Paris"]  # no space: a different token


def test_token_texts_kept_per_id(default_scorer):
    """Each id's text alone, as the tokenizer decodes it, in the order asked (repeats too); an id
    decoded once is not decoded again."""
    from logprobe.tokenizer import Tokenizer
    hf = default_scorer.tokenizer.hf
    tok = Tokenizer(hf, add_bos=False)
    ids = hf.encode("The capital of France is Paris. The capital", add_special_tokens=False) + [0, 5, 0]
    want = [hf.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids]
    asked = []
    real = hf.batch_decode

    def counting(batch, **kw):
        asked.extend(i for (i,) in batch)
        return real(batch, **kw)

    hf.batch_decode = counting
    try:
        assert tok.token_texts(ids) == want
        assert sorted(asked) == sorted(set(ids))  # each distinct id once
        asked.clear()
        assert tok.token_texts(ids[::-1]) == want[::-1] and asked == []
    finally:
        del hf.batch_decode
