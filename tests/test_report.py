"""report/ pages (issue 21): the numbers on a page are the scorer's own, bitwise; the token count
shown is the count scored; windows with gaps (llama.cpp policy) and without a prefix land on the
right tokens; the KL page's histogram counts every token."""

from __future__ import annotations

import argparse
import html
import json
import re

import pytest
import torch

from logprobe.cli.report import compare_page, perplexity_page, score_page
from logprobe.errors import LogprobeError
from logprobe.report import Segment, Token, kl_page, locate_targets, surprisal_page
from logprobe.report.html import kl_histogram_svg
from logprobe.report.tokens import stream_tokens
from logprobe.scoring.options import Windows

TEXT = ("The river rises in the hills north of the town and runs south through a wide valley. In spring "
        "the water is high and fast; by late summer it is slow.")
ARGS = argparse.Namespace(html_top_k=3)


def _logprobs(page: str) -> list[float]:
    return [float(x) for x in re.findall(r'data-logprob="([^"]+)"', page)]


def _data(page: str) -> list[dict]:
    blob = re.search(r'<script type="application/json" id="token-data">(.*?)</script>', page, re.S).group(1)
    return json.loads(blob.replace("<\\/", "</"))


def _count(page: str) -> int:
    return int(re.search(r'<span id="token-count">(\d+)</span>', page).group(1))


@pytest.mark.parametrize("options", [dict(context_length=32, stride=8),
                                     dict(context_length=16, policy="llama.cpp"),
                                     dict(context_length=32, stride=32, prefix=False)])
def test_perplexity_page_equals_scorer(default_scorer, options):
    page, _ = perplexity_page(default_scorer, TEXT, ARGS, Windows(**options))
    ref = default_scorer.perplexity(TEXT, return_token_nlls=True, **options)
    assert _count(page) == ref.num_tokens == len(_logprobs(page))
    assert _logprobs(page) == [-x for x in ref.token_nlls[0]]  # bitwise: the same jobs on the same engine
    # the coloured tokens are the scored ones, at their places in the text
    ids = default_scorer.tokenizer.encode(TEXT)
    texts = default_scorer.tokenizer.token_texts(ids)
    spans = re.findall(r'<span class="(tok|ctx)"[^>]*>(.*?)</span>', page.split('<div class="text">')[1])
    assert "".join(html.unescape(t) for _, t in spans) == "".join(texts)
    scored = [i for i, (kind, _) in enumerate(spans) if kind == "tok"]
    if options.get("policy") == "llama.cpp":
        C = options["context_length"]
        want = [b + j for b in range(0, len(ids) - C + 1, C) for j in range(C // 2 + 1, C)]
        assert scored == want
    elif options.get("prefix") is False:
        assert scored == list(range(1, len(ids)))
    else:
        assert scored == list(range(len(ids)))


def test_page_ranks_and_alternatives_equal_logprobs(default_scorer):
    """Ranks, entropies and top-k on the page equal Scorer.logprobs on the same windows' ids."""
    from logprobe.scoring.windows import sliding_windows

    page, _ = perplexity_page(default_scorer, TEXT, ARGS, Windows(context_length=24, stride=12))
    stream = [default_scorer.tokenizer.prefix_id] + default_scorer.tokenizer.encode(TEXT)
    seqs = [{"prompt_token_ids": stream[w.begin:w.score_begin], "completion_token_ids": stream[w.score_begin:w.end]}
            for w in sliding_windows(len(stream), 24, 12)]
    ref = default_scorer.logprobs(seqs, top_k=3, entropy=True)
    data = _data(page)
    ranks = torch.cat([r.ranks for r in ref]).tolist()
    ent = torch.cat([r.entropy for r in ref]).tolist()
    top_ids = torch.cat([r.topk_ids for r in ref]).tolist()
    top_lp = torch.cat([r.topk_logprobs for r in ref]).tolist()
    assert len(data) == len(stream) - 1 == len(ranks)
    assert [d["r"] for d in data] == ranks and 0 in ranks and max(ranks) > 0
    assert max(abs(d["h"] - e) for d, e in zip(data, ent)) <= 1e-5
    for d, i_row, lp_row in zip(data, top_ids, top_lp):
        assert [a for a, _ in d["top"]] == default_scorer.tokenizer.token_texts(i_row)
        assert max(abs(b - c) for (_, b), c in zip(d["top"], lp_row)) <= 1e-5
        if d["r"] == 0:
            assert d["top"][0][0] == d["t"]


def test_score_page_equals_score(default_scorer):
    conts = [" Paris", " London", " a city of bridges"]
    page, _ = score_page(default_scorer, "The capital of France is", conts, ARGS)
    ref = default_scorer.score("The capital of France is", conts)
    assert _logprobs(page) == [x for r in ref for x in r.token_logprobs]
    assert _count(page) == sum(r.num_tokens for r in ref)
    assert [d["r"] == 0 for d in _data(page)] == [x == 0 for r in default_scorer.logprobs(
        [{"prompt_token_ids": default_scorer.tokenizer.encode("The capital of France is"),
          "completion_token_ids": r.token_ids} for r in ref]) for x in r.ranks.tolist()]


def test_compare_page_same_model_has_zero_kl(default_scorer):
    res = default_scorer.compare(default_scorer, TEXT, context_length=32, stride=8, return_token_stats=True)
    page = compare_page(default_scorer, default_scorer, TEXT, res, Windows(context_length=32, stride=8))
    kl = [float(x) for x in re.findall(r'data-kl="([^"]+)"', page)]
    assert _count(page) == res.num_tokens == len(kl) and kl == res.token_kl and set(kl) == {0.0}
    assert "<svg" in page and "Mean    KLD" in page


def test_kl_histogram_counts_every_token():
    kl = [0.0, 1e-7, 2e-6, 3e-4, 3e-4, 0.02, 0.5, 4.0, 50.0]
    svg = kl_histogram_svg(kl, bins=7)  # one bin per decade from 1e-6 to 10
    counts = [int(c) for c in re.findall(r"<title>(\d+) tokens</title>", svg)]
    assert counts == [3, 0, 2, 0, 1, 1, 2]  # 0.02 in 1e-2..1e-1; 50 clamped into the last
    page = kl_page([Segment("s", [Token("a", kl=v) for v in kl])], "t")
    assert _count(page) == len(kl)


def test_locate_targets_and_bad_windows():
    assert locate_targets([1, 2, 3, 4, 5, 6], [([9, 1, 2], [1, 2]), ([2, 3, 4], [3, 4]), ([4, 5, 6], [5, 6])]) == [0, 2, 4]
    assert locate_targets([1, 2, 3, 4, 5, 6, 7, 8], [([9, 2, 3], [3]), ([9, 6, 7], [7])]) == [2, 6]
    with pytest.raises(LogprobeError):
        locate_targets([1, 2, 3], [([1, 4], [4])])
    toks = stream_tokens(["a", "b", "c", "d"], [0, 2], [[Token("a", -1.0)], [Token("c", -2.0), Token("d", -3.0)]])
    assert [t.logprob for t in toks] == [-1.0, None, -2.0, -3.0]


def test_page_escapes_text_and_survives_inf():
    seg = Segment("<b>", [Token("</script><x>"), Token("&", float("-inf"), rank=7, top=[("<", -0.1)])])
    page = surprisal_page([seg], "t <i>")
    assert "</script><x>" not in page.split("<body>")[1].split('<script type="application/json"')[0]
    data = _data(page)
    assert data == [{"t": "&", "lp": None, "r": 7, "h": None, "kl": None, "top": [["<", -0.1]]}]
    assert _count(page) == 1


def test_compare_page_shows_both_models_and_their_alternatives(default_scorer):
    """The compare page's hover data: each model's log-p, Δp and each model's top-k (the numbers of
    the compare run itself), equal to what the perplexity page shows on the same windows."""
    from logprobe.scoring.compare import compare_models

    s, w = default_scorer, Windows(context_length=32, stride=8)
    res = compare_models(s.context, s.engine, s.context, s.engine, TEXT, w, return_token_stats=True, top_k=3)
    data = _data(compare_page(s, s, TEXT, res, w))
    ppl, _ = perplexity_page(s, TEXT, ARGS, w)  # ARGS: --html-top-k 3
    ref = _data(ppl)
    assert len(data) == len(ref) == res.num_tokens
    for d, e in zip(data, ref):
        assert d["t"] == e["t"] and d["lp"] == d["lpr"] and d["dp"] == 0.0 and d["kl"] == 0.0
        assert abs(d["lp"] - e["lp"]) <= 1e-4
        assert len(d["top"]) == len(d["topr"]) == 3 and d["top"] == d["topr"]
        assert [a for a, _ in d["top"]] == [a for a, _ in e["top"]]
        assert max(abs(b - c) for (_, b), (_, c) in zip(d["top"], e["top"])) <= 1e-4
    page = compare_page(s, s, TEXT, res, w)
    assert "top alternatives (R)" in page and "log-p R" in page and "&Delta;p" in page
