"""The real default model (SmolLM2-135M-Instruct Q4_1) against transformers' float64 forward of the
same GGUF (transformers dequantizes it with its own code)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import WIKITEXT
from helpers import random_sequences, ref_logprobs

from logprobe.scoring.windows import llamacpp_windows, sliding_windows

TOL = 1e-4
# float64 transformers forward of the same GGUF on the same windows gave 25.23934230853823
GOLD_WIKI_2K = 25.239342
TEXT = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
        "structure in Paris. Its base is square, measuring 125 metres on each side. During its "
        "construction, the Eiffel Tower surpassed the Washington Monument to become the tallest "
        "man-made structure in the world.")


def test_paris_first(default_scorer):
    res = default_scorer.score("The capital of France is", [" Paris", " London", " Berlin"])
    assert max(res, key=lambda r: r.log_prob).continuation == " Paris"
    assert res[0].is_greedy and not res[1].is_greedy
    assert res[0].tokens == [" Paris"] and res[0].num_tokens == 1
    assert math.isclose(res[0].prob, math.exp(res[0].log_prob))


def test_score_matches_reference(default_scorer, default_reference):
    tok = default_scorer.tokenizer
    prompt, conts = "Question: What is the boiling point of water at sea level?\nAnswer:", \
        [" 100 degrees Celsius", " 50 degrees", " It depends on the pot."]
    res = default_scorer.score(prompt, conts, top_k=3, entropy=True, temperature=0.8)
    for r, c in zip(res, conts):
        ctx = tok.encode(prompt)
        ids = tok.encode(prompt + c)
        lp = ref_logprobs(default_reference, ids, 0.8)
        rows = lp[len(ctx) - 1: len(ids) - 1]
        tgt = rows.gather(1, torch.tensor(ids[len(ctx):])[:, None])[:, 0]
        assert r.token_ids == ids[len(ctx):]
        assert max(abs(a - b) for a, b in zip(r.token_logprobs, tgt.tolist())) < TOL
        assert abs(r.log_prob - float(tgt.sum())) < TOL
        ent = -(rows.exp() * rows).sum(-1)
        assert max(abs(a - b) for a, b in zip(r.entropy, ent.tolist())) < TOL
        top_lp, top_ids = rows.topk(3, -1)
        assert [[t[0] for t in row] for row in r.top_k] == top_ids.tolist()
        assert max(abs(t[2] - float(x)) for row, xs in zip(r.top_k, top_lp) for t, x in zip(row, xs)) < TOL
        assert r.is_greedy == bool((rows.argmax(-1) == torch.tensor(r.token_ids)).all())


@pytest.mark.slow  # slow tier (pytest -m slow): the real model
def test_loglikelihood_equals_score(default_scorer):
    pairs = [("The capital of France is", " Paris"), ("", "Hello world"), ("2 + 2 =", " 4")]
    ll = default_scorer.loglikelihood(pairs)
    for (ctx, cont), (lp, greedy) in zip(pairs, ll):
        r = default_scorer.score(ctx, cont)[0]
        assert abs(lp - r.log_prob) < 1e-5 and greedy == r.is_greedy  # batched vs alone: not bitwise (issue 4)


def test_empty_prompt_uses_prefix_token(default_scorer, default_reference):
    tok = default_scorer.tokenizer
    r = default_scorer.score("", "Hello world")[0]
    ids = [tok.prefix_id] + tok.encode("Hello world")
    lp = ref_logprobs(default_reference, ids)
    assert abs(r.log_prob - float(lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum())) < TOL
    assert r.num_tokens == len(ids) - 1


@pytest.mark.slow  # slow tier (pytest -m slow): the real model against float64
def test_rl_logprobs_match_reference(default_scorer, default_reference):
    tok = default_scorer.tokenizer
    seqs = [{"prompt_token_ids": tok.encode("Solve 12 * 7."), "completion_token_ids": tok.encode(" The answer is 84.")},
            {"prompt_token_ids": tok.encode("Write a haiku."), "completion_token_ids": tok.encode(" Leaves fall slow")}]
    for temperature in (1.0, 0.7, 1.3):
        out = default_scorer.logprobs(seqs, temperature=temperature, top_k=4, entropy=True)
        for s, r in zip(seqs, out):
            ids = s["prompt_token_ids"] + s["completion_token_ids"]
            rows = ref_logprobs(default_reference, ids, temperature)[len(s["prompt_token_ids"]) - 1:-1]
            tgt = rows.gather(1, torch.tensor(s["completion_token_ids"])[:, None])[:, 0]
            assert (r.logprobs.double() - tgt).abs().max() < TOL
            assert (r.entropy.double() - (-(rows.exp() * rows).sum(-1))).abs().max() < TOL
            assert (r.topk_logprobs.double() - rows.topk(4, -1).values).abs().max() < TOL


@pytest.mark.parametrize("policy", ["sliding", "llama.cpp"])
def test_perplexity_matches_reference(policy, default_scorer, default_reference):
    tok = default_scorer.tokenizer
    ctx = 64
    pr = default_scorer.perplexity(TEXT, context_length=ctx, stride=16 if policy == "sliding" else None,
                                   policy=policy, return_token_nlls=True)
    stream = ([tok.prefix_id] if policy == "sliding" else []) + tok.encode(TEXT)
    windows = sliding_windows(len(stream), ctx, 16) if policy == "sliding" else llamacpp_windows(len(stream), ctx)
    ref = []
    for w in windows:
        lp = ref_logprobs(default_reference, stream[w.begin:w.end])
        ref += [-float(lp[j - w.begin - 1, stream[j]]) for j in range(w.score_begin, w.end)]
    assert max(abs(a - b) for a, b in zip(pr.token_nlls[0], ref)) < TOL
    total = sum(ref)
    assert pr.num_tokens == len(ref)
    assert abs(pr.perplexity - math.exp(total / len(ref))) < 1e-4 * pr.perplexity
    words, nbytes = len(TEXT.split()), len(TEXT.encode())
    assert pr.num_words == words and pr.num_bytes == nbytes
    assert abs(pr.word_perplexity - math.exp(total / words)) < 1e-4 * pr.word_perplexity
    assert abs(pr.bits_per_byte - total / nbytes / math.log(2)) < 1e-6
    assert pr.nll_stderr > 0 and abs(pr.perplexity_stderr - pr.perplexity * pr.nll_stderr) < 1e-9


@pytest.mark.slow  # slow tier (pytest -m slow): the real model on real data (16 s of the fast tier's 240)
@pytest.mark.skipif(not WIKITEXT.exists(), reason="needs ../shared/data (the repo's data checkout)")
def test_wikitext_perplexity_first_2k_tokens(default_scorer):
    """Golden value on real data (2,048 wikitext-2 test tokens, context 512, stride 256), ± 1e-3."""
    txt = WIKITEXT.read_text(encoding="utf-8")
    ids = default_scorer.tokenizer.encode(txt[:20000])[:2048]
    pr = default_scorer.perplexity(ids, context_length=512, stride=256, prefix=False)
    assert pr.num_tokens == 2047
    assert abs(pr.perplexity - GOLD_WIKI_2K) < 1e-3 * GOLD_WIKI_2K



@pytest.mark.slow  # slow tier (pytest -m slow): many packings of the real model
def test_packing_on_the_real_model(default_scorer):
    """Alone vs packed: within float32 rounding by default, bitwise with deterministic=True."""
    from logprobe import Scorer

    seqs = random_sequences(6, seed=1, vocab=49152, max_prompt=150, max_completion=150)
    alone = [default_scorer.logprobs([s])[0].logprobs for s in seqs]
    packed = default_scorer.logprobs(seqs)
    assert max(float((a - b.logprobs).abs().max()) for a, b in zip(alone, packed)) < 5e-5
    inv = Scorer(default_scorer.loaded, deterministic=True, progress=False)  # shares the weights
    alone = [inv.logprobs([s])[0] for s in seqs]
    packed = inv.logprobs(seqs[::-1], top_k=2, entropy=True)[::-1]  # shuffled order, more options
    for a, b in zip(alone, packed):
        assert torch.equal(a.logprobs.view(torch.int32), b.logprobs.view(torch.int32))  # raw bits
