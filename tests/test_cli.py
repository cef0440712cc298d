"""The ``logprobe`` CLI: tables, JSON, streaming JSONL with resume, and one-line errors.

The real default model is loaded once per module: ``main()`` runs in-process and shares the
CLI's model cache with the ``scorer`` fixture, so CLI output can be compared to the API exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from logprobe.cli import main as cli
from logprobe.cli.main import get_scorer, join_continuation, main

PROMPT = "The capital of France is"
SEQS = [
    {"prompt_token_ids": [1, 504, 3575, 282], "completion_token_ids": [4649, 314], "id": "a"},
    {"prompt_token_ids": [1, 20], "completion_token_ids": [30, 40, 50]},
    {"prompt_token_ids": [1, 504, 3575], "completion_token_ids": [282], "id": 7},
    {"prompt_token_ids": [2, 3, 4, 5, 6], "completion_token_ids": [7, 8]},
    {"prompt_token_ids": [1], "completion_token_ids": [100, 200, 300, 400]},
]


@pytest.fixture(scope="module")
def scorer():
    return get_scorer()  # the same cached model main() uses


def _write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")


def _read_out(path: Path) -> dict[int, dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    recs = [json.loads(x) for x in lines]
    indices = [r["index"] for r in recs]
    assert len(indices) == len(set(indices)), f"duplicated indices: {sorted(indices)}"
    return {r["index"]: r for r in recs}


def _strip(rec: dict) -> dict:
    """The result columns of an output row (the input columns pass through: dropped here)."""
    inputs = ("index", "id", "prompt_token_ids", "completion_token_ids", "temperature", "top_k")
    return {k: v for k, v in rec.items() if k not in inputs}


# -- score -----------------------------------------------------------------------------------------


def test_score_table_puts_paris_first(scorer, capsys):
    assert main(["score", PROMPT, "Paris", "London", "Berlin"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["continuation", "tokens", "log_prob", "prob", "ppl", "greedy"]
    assert len(lines) == 4
    assert lines[1].startswith("' Paris'")
    assert lines[1].split()[-1] == "yes"
    logps = [float(line.split()[-4]) for line in lines[1:]]
    assert logps == sorted(logps, reverse=True)


def test_score_json_matches_api(scorer, capsys):
    assert main(["score", PROMPT, "Paris", "London", "Berlin", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = scorer.score(PROMPT, [" Paris", " London", " Berlin"])
    assert [g["continuation"] for g in got] == [" Paris", " London", " Berlin"]  # input order
    assert [g["log_prob"] for g in got] == [w.log_prob for w in want]
    assert [g["token_logprobs"] for g in got] == [w.token_logprobs for w in want]


def test_score_entropy_and_top_k(scorer, capsys):
    assert main(["score", PROMPT, "Paris", "--top-k", "3", "--entropy", "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)
    (want,) = scorer.score(PROMPT, " Paris", top_k=3, entropy=True)
    assert got["entropy"] == want.entropy
    assert [[list(t) for t in row] for row in want.top_k] == got["top_k"]
    assert main(["score", PROMPT, "Paris", "--top-k", "2", "--entropy"]) == 0
    out = capsys.readouterr().out
    assert "entropy" in out.splitlines()[0] and "top-2" in out


def test_join_rule(scorer, capsys):
    assert join_continuation("is", "Paris", " ") == " Paris"
    assert join_continuation("is ", "Paris", " ") == "Paris"
    assert join_continuation("is", " Paris", " ") == " Paris"
    assert join_continuation("is", "\nParis", " ") == "\nParis"
    assert join_continuation("", "Paris", " ") == "Paris"
    assert join_continuation("a", "", " ") == ""
    assert join_continuation("is", "Paris", "") == "Paris"
    assert main(["score", PROMPT, "Paris", "--join", "", "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)
    assert got["continuation"] == "Paris"
    assert got["log_prob"] == scorer.score(PROMPT, "Paris")[0].log_prob


def test_score_empty_continuation_is_an_error(scorer, capsys):
    assert main(["score", "a", ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("logprobe: error: continuation")


def test_score_bad_option_fails_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(cli, "get_scorer", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["score", "a", "b", "--temperature", "0"]) == 2
    assert capsys.readouterr().err.startswith("logprobe: error: temperature")


def test_keyboard_interrupt_exits_130_quietly(monkeypatch, capsys):
    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "get_scorer", interrupt)
    assert main(["score", "a", "b"]) == 130
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


# -- perplexity ------------------------------------------------------------------------------------

TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day in the park.\n"


@pytest.mark.slow  # slow tier (pytest -m slow): the real model through the CLI
def test_perplexity_report_and_json(scorer, tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    assert main(["perplexity", "--text-file", str(f)]) == 0
    out = capsys.readouterr().out
    for label in ("perplexity", "±", "tokens", "window", "word ppl", "byte ppl", "bits/byte", "tokens/s"):
        assert label in out, label
    assert main(["perplexity", "--text-file", str(f), "--json", "--context-length", "8", "--stride", "4"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = scorer.perplexity(TEXT, context_length=8, stride=4)
    assert got["perplexity"] == want.perplexity
    assert got["num_tokens"] == want.num_tokens and got["num_windows"] == want.num_windows > 1
    assert got["bits_per_byte"] == want.bits_per_byte
    assert got["tokens_per_s"] > 0 and got["elapsed_s"] > 0


def test_perplexity_stdin_policy_max_tokens(scorer, monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(TEXT.encode("utf-8")), encoding="utf-8"))
    assert main(["perplexity", "--text-file", "-", "--json", "--policy", "llama.cpp", "--context-length", "8",
                 "--max-tokens", "17", "--no-prefix"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = scorer.perplexity(TEXT, context_length=8, policy="llama.cpp", prefix=False, max_tokens=17)
    assert got["perplexity"] == want.perplexity and got["policy"] == "llama.cpp"
    assert got["word_perplexity"] is None


def test_perplexity_empty_file(tmp_path, capsys):
    f = tmp_path / "empty.txt"
    f.write_text("  \n", encoding="utf-8")
    assert main(["perplexity", "--text-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "empty" in err and err.startswith("logprobe: error: --text-file")


def test_perplexity_missing_and_non_utf8_file(tmp_path, capsys):
    assert main(["perplexity", "--text-file", str(tmp_path / "nope.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("logprobe: error: --text-file") and "nope.txt" in err and err.count("\n") == 1
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert main(["perplexity", "--text-file", str(f)]) == 2
    assert "UTF-8" in capsys.readouterr().err


# -- logprobs --------------------------------------------------------------------------------------


def test_logprobs_end_to_end_equals_api(scorer, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(inp, SEQS)
    assert main(["logprobs", "--input", str(inp), "--output", str(out)]) == 0
    assert "5 written" in capsys.readouterr().out
    got = _read_out(out)
    want = scorer.logprobs([{k: v for k, v in s.items() if k != "id"} for s in SEQS])
    assert sorted(got) == list(range(len(SEQS)))
    for i, w in enumerate(want):
        assert _strip(got[i]) == w.to_dict()
        assert got[i]["id"] == SEQS[i].get("id")


def test_logprobs_row_with_images_fails_by_name(scorer, tmp_path, capsys):
    """A row that carries media (verl's multi_modal_data, an images column) fails alone, named; the
    others are scored. Its ids are never scored without the image."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(inp, [SEQS[0], {**SEQS[1], "images": ["a.png"]}, {**SEQS[2], "images": None}])
    assert main(["logprobs", "--input", str(inp), "--output", str(out)]) == 1
    assert "line 2: images: is a media column this job does not read" in capsys.readouterr().err
    got = _read_out(out)
    assert got[1].get("error") and got[0]["logprobs"] and got[2]["logprobs"]


@pytest.mark.slow  # slow tier (pytest -m slow): the real model through the CLI
def test_logprobs_options_and_per_line_overrides(scorer, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [dict(SEQS[0]), dict(SEQS[1], temperature=0.5, top_k=1, entropy=False)]
    _write_jsonl(inp, rows)
    # --max-batch-tokens 6: every sequence (at most 6 inputs) runs alone and whole (not chunked),
    # as in the API calls below, so values are comparable bit for bit
    assert main(["logprobs", "--input", str(inp), "--output", str(out), "--temperature", "2", "--top-k", "3",
                 "--entropy", "--max-batch-tokens", "6", "--json", "--keep-columns", "id"]) == 0  # results only
    summary = json.loads(capsys.readouterr().out)
    assert summary["written"] == 2 and summary["failed"] == 0
    got = _read_out(out)
    bare = [{k: v for k, v in r.items() if k in ("prompt_token_ids", "completion_token_ids")} for r in rows]
    (w0,) = scorer.logprobs(bare[:1], temperature=2.0, top_k=3, entropy=True)
    (w1,) = scorer.logprobs(bare[1:], temperature=0.5, top_k=1, entropy=False)
    assert _strip(got[0]) == w0.to_dict() and "entropy" in got[0] and len(got[0]["top_k_ids"][0]) == 3
    assert _strip(got[1]) == w1.to_dict() and "entropy" not in got[1] and len(got[1]["top_k_ids"][0]) == 1


@pytest.mark.slow  # slow tier (pytest -m slow): a job interrupted and resumed
def test_logprobs_resume_after_interrupt(scorer, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    _write_jsonl(inp, SEQS)
    clean, resumed = tmp_path / "clean.jsonl", tmp_path / "resumed.jsonl"
    # one sequence per forward pass in both runs, so resumed values equal the clean run bit for bit
    opts = ["--max-batch-tokens", "6"]  # each of SEQS (at most 6 inputs) alone and whole
    assert main(["logprobs", "--input", str(inp), "--output", str(clean), *opts]) == 0
    clean_lines = clean.read_text(encoding="utf-8").splitlines(keepends=True)
    k = 2
    resumed.write_text("".join(clean_lines[:k]) + clean_lines[k][: len(clean_lines[k]) // 2], encoding="utf-8")
    capsys.readouterr()
    assert main(["logprobs", "--input", str(inp), "--output", str(resumed), *opts]) == 0
    captured = capsys.readouterr()
    assert f"{len(SEQS) - k} written, {k} already done" in captured.out
    assert "incomplete line" in captured.err
    assert resumed.read_text(encoding="utf-8").endswith("\n")
    assert _read_out(resumed) == _read_out(clean)  # every index exactly once, same values
    # a finished output is left alone
    before = resumed.read_bytes()
    assert main(["logprobs", "--input", str(inp), "--output", str(resumed), *opts]) == 0
    assert resumed.read_bytes() == before
    assert f"0 written, {len(SEQS)} already done" in capsys.readouterr().out


@pytest.mark.slow  # slow tier (pytest -m slow): the real model through the CLI
def test_logprobs_bad_lines_reported_and_skipped(scorer, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    oov = {"prompt_token_ids": [1, 2], "completion_token_ids": [3, 99999]}
    rows = [SEQS[0], "{not json", "", oov, SEQS[1], "[1, 2]", {"prompt_token_ids": [1], "completion_token_ids": []}]
    _write_jsonl(inp, rows)
    assert main(["logprobs", "--input", str(inp), "--output", str(out)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4, err
    assert err[0].startswith("line 2: ") and "JSON" in err[0]
    assert err[1].startswith("line 4: completion_token_ids[1]") and "99999" in err[1] and "vocabulary" in err[1]
    assert err[2].startswith("line 6: ")
    assert err[3].startswith("line 7: completion_token_ids") and "empty" in err[3]
    recs = _read_out(out)  # bad lines are written with their error; blank lines are not rows
    assert sorted(recs) == [0, 1, 3, 4, 5, 6]
    assert sorted(i for i, r in recs.items() if r.get("error")) == [1, 3, 5, 6]
    assert recs[3]["error"].startswith("completion_token_ids[1]") and "logprobs" not in recs[3]
    # fix the bad lines and rerun: only they are computed and appended
    rows[1], rows[3], rows[5], rows[6] = SEQS[2], SEQS[3], SEQS[4], SEQS[0]
    _write_jsonl(inp, rows)
    assert main(["logprobs", "--input", str(inp), "--output", str(out)]) == 0
    assert "4 written, 2 already done, 0 failed" in capsys.readouterr().out
    recs = _read_out(out)  # the error lines were replaced, not doubled
    assert sorted(recs) == [0, 1, 3, 4, 5, 6] and not any("error" in r for r in recs.values())


def test_logprobs_missing_input(tmp_path, capsys):
    assert main(["logprobs", "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("logprobe: error: --input") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


# -- the real console script -----------------------------------------------------------------------


def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("logprobe")
    return [str(script)] if script.exists() else [sys.executable, "-m", "logprobe.cli.main"]


def test_console_script_unknown_model_one_line_error(tmp_path):
    p = subprocess.run([*_console_script(), "score", "a", "b", "--model", str(tmp_path / "no-such-model.gguf")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("logprobe: error: model: ") and "no-such-model.gguf" in p.stderr
    assert p.stdout == ""


def test_module_entry_point_version():
    p = subprocess.run([sys.executable, "-m", "logprobe.cli.main", "--version"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("logprobe ") and p.stderr == ""


def test_cli_runs_without_lm_eval(tmp_path):
    """lm-eval is optional: with it absent every command but ``eval`` works, and ``eval`` says
    how to install it in one line (exit 2). A meta-path hook hides the installed package."""
    code = textwrap.dedent('''
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name == "lm_eval" or name.startswith("lm_eval."):
                    raise ImportError(f"No module named {name!r} (hidden)")
        sys.meta_path.insert(0, Hide())
        from logprobe.cli.main import main
        try:
            print("exit", main(["eval", "--tasks", "hellaswag"]))
        except SystemExit as e:
            print("exit", e.code)
        try:
            main(["serve", "--help"])
        except SystemExit:
            pass
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "needs lm-evaluation-harness" in r.stderr and "exit 2" in r.stdout, (r.stdout, r.stderr)
    assert "usage: logprobe serve" in r.stdout, r.stdout


def test_load_format_dummy_scores_random_weights(tiny_dirs, capsys):
    """``--load-format dummy``: the model of the directory's config at random (each rank's shard
    made where it runs), the numbers of the library's ``load_format="dummy"``; not the checkpoint's."""
    from logprobe import Scorer

    path = str(tiny_dirs["llama"][0])
    args = ["score", "--model", path, "--device", "cpu", "--dtype", "float32", "--json", "ab", "cd"]
    assert main([*args, "--load-format", "dummy"]) == 0
    random = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    real = json.loads(capsys.readouterr().out)
    want = Scorer(path, device="cpu", dtype="float32", progress=False, load_format="dummy")
    assert random[0]["log_prob"] != real[0]["log_prob"]
    assert random[0]["log_prob"] == want.score("ab", [random[0]["continuation"]])[0].log_prob
