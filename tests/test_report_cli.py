"""``--html`` on the CLI commands: the page written equals what the command printed / the scorer
gives, and bad uses are one-line errors (exit 2) before any model is loaded."""

from __future__ import annotations

import json
import re

import pytest

from logprobe.cli.main import get_scorer, main

pytestmark = pytest.mark.slow

TEXT = "The river rises in the hills north of the town and runs south through a wide valley."


def _page_numbers(path) -> tuple[int, list[float], list[float]]:
    page = path.read_text(encoding="utf-8")
    count = int(re.search(r'<span id="token-count">(\d+)</span>', page).group(1))
    return (count, [float(x) for x in re.findall(r'data-logprob="([^"]+)"', page)],
            [float(x) for x in re.findall(r'data-kl="([^"]+)"', page)])


def test_perplexity_html(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "p.html"
    assert main(["perplexity", "--text-file", str(text), "--context-length", "12", "--stride", "4", "--json",
                 "--html", str(out), "--html-top-k", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    count, lps, _ = _page_numbers(out)
    ref = get_scorer().perplexity(TEXT, context_length=12, stride=4, return_token_nlls=True)
    assert count == printed["num_tokens"] == ref.num_tokens == len(lps)
    assert lps == [-x for x in ref.token_nlls[0]]


def test_score_html(tmp_path, capsys):
    out = tmp_path / "s.html"
    assert main(["score", "The capital of France is", "Paris", "London", "--json", "--html", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    count, lps, _ = _page_numbers(out)
    assert lps == [x for r in printed for x in r["token_logprobs"]] and count == len(lps) == 2


def test_compare_html(tmp_path, capsys, monkeypatch):
    loaded = get_scorer().loaded  # Q and R: the CLI's cached default model (no second load)
    monkeypatch.setattr("logprobe.loading.load_model", lambda *a, **k: loaded)
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "k.html"
    assert main(["compare", "--reference", "smollm2-135m", "--text-file", str(text), "--context-length", "12",
                 "--json", "--html", str(out), "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out)
    count, _, kl = _page_numbers(out)
    assert count == printed["num_tokens"] == len(kl) and set(kl) == {0.0}  # a model against itself
    assert "<svg" in out.read_text(encoding="utf-8")


@pytest.mark.parametrize("argv, message", [
    (["score", "A", "B", "--html", "x.html", "--html-top-k", "-1"], "--html-top-k: must be an integer >= 0"),
    (["score", "--input", "rows.jsonl", "--output", "o.jsonl", "--html", "x.html"], "--html: shows one text"),
    (["perplexity", "--input", "rows.jsonl", "--html", "x.html"], "--html: shows one text"),
])
def test_html_errors_are_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("logprobe.cli.main._scorer", lambda a: pytest.fail("no model should be loaded"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("logprobe: error: ") and message in err[0]


def test_unwritable_html_path(tmp_path, capsys):
    assert main(["score", "A", "B", "--html", str(tmp_path / "missing" / "x.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--html: cannot write" in err[0]


@pytest.mark.parametrize("argv", [
    ["perplexity", "--text-file", "{text}", "-c", "12", "--stride", "12", "--json"],
    ["score", "The capital of France is", "Paris", "London", "--top-k", "1", "--json"],
], ids=["perplexity", "score"])
def test_html_scores_the_text_once(tmp_path, capsys, monkeypatch, argv):
    """--html adds no engine pass: the page and the printed numbers come from one run of the job,
    with the page's top-k and entropy requested in it (the printed ones stay as asked)."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    argv = [a.replace("{text}", str(text)) for a in argv]
    engine_cls = type(get_scorer().engine)
    real_run = engine_cls.run
    runs: list[int] = []  # tokens per engine run

    def counting_run(self, requests, *a, **k):
        runs.append(sum(len(r.tokens) for r in requests))
        return real_run(self, requests, *a, **k)

    monkeypatch.setattr(engine_cls, "run", counting_run)
    assert main(argv) == 0
    plain, plain_runs = json.loads(capsys.readouterr().out), list(runs)
    runs.clear()
    out = tmp_path / "p.html"
    assert main([*argv, "--html", str(out), "--html-top-k", "3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(plain_runs) == 1 and runs == plain_runs  # one pass, the same tokens, with or without the page
    _, lps, _ = _page_numbers(out)
    page = out.read_text(encoding="utf-8")
    if argv[0] == "score":
        assert printed == plain and lps == [x for r in printed for x in r["token_logprobs"]]
        assert all(len(alts) == 1 for r in printed for alts in r["top_k"]) and printed[0]["entropy"] is None
        assert "top" in page and ", 1 token, " in page and "1 tokens" not in page  # ' Paris': one token
    else:
        assert {k: v for k, v in printed.items() if k not in ("elapsed_s", "tokens_per_s")} == \
            {k: v for k, v in plain.items() if k not in ("elapsed_s", "tokens_per_s")}
        assert len(lps) == printed["num_tokens"]


def test_compare_html_top_k_and_both_models(tmp_path, capsys, monkeypatch):
    """compare --html honours --html-top-k: each token's hover data has both models' log-p, Δp and
    each model's top-k alternatives."""
    loaded = get_scorer().loaded
    monkeypatch.setattr("logprobe.loading.load_model", lambda *a, **k: loaded)
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "k.html"
    assert main(["compare", "--reference", "smollm2-135m", "--text-file", str(text), "--context-length", "12",
                 "--json", "--html", str(out), "--html-top-k", "2", "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert "token_top_q" not in printed and "token_logprobs_q" not in printed
    page = out.read_text(encoding="utf-8")
    blob = re.search(r'<script type="application/json" id="token-data">(.*?)</script>', page, re.S).group(1)
    data = json.loads(blob.replace("<\\/", "</"))
    assert len(data) == printed["num_tokens"]
    assert all(len(d["top"]) == len(d["topr"]) == 2 and d["lp"] == d["lpr"] and d["dp"] == 0.0 for d in data)
    assert all(d["top"][0][1] >= d["lp"] - 1e-4 for d in data)  # the best alternative: at least the target
