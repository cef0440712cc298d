"""Table files: JSONL/CSV/Parquet in, JSONL/Parquet out, the same numbers; resume after kill -9;
bad rows reported with their row number and written with an error.

A tiny random Llama (byte tokenizer) keeps it fast; the CLI runs in process (its model cache is
shared), except the kill -9 run, which is a real subprocess.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from logprobe import Scorer
from logprobe.cli.main import main
from logprobe.io.tables import read_output

TEXTS = ["The quick brown fox jumps over the lazy dog.", "It was a sunny day in the park, and then it rained.",
         "Exact numbers first.", "A row\nwith a newline, a comma and \"quotes\"."]
SCORE_ROWS = [{"prompt": "The capital of France is", "continuation": "Paris", "q": 1},
              {"prompt": "Hello", "continuation": " world", "q": 2},
              {"prompt": "", "continuation": "x", "q": 3},
              {"prompt": "2 + 2 =", "continuation": "4", "q": 4}]
MANY_ROWS = [{"prompt": "The capital of France is", "continuations": ["Paris", "London", "Berlin"]},
             {"prompt": "Yes or", "continuations": ["no", " maybe"]}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers import make_hf_dir

    d = tmp_path_factory.mktemp("tiny-llama")
    make_hf_dir(d, "llama", seed=3)
    return d


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return Scorer(str(tiny_dir), device="cpu", dtype="float32", progress=False, deterministic=True)


def write_table(path: Path, rows: list[dict]) -> Path:
    """``rows`` as JSONL, CSV (lists as JSON text) or Parquet, by ``path``'s extension."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif path.suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def by_index(path: Path) -> dict[int, dict]:
    rows = read_output(str(path))
    index = [r["index"] for r in rows]
    assert len(index) == len(set(index)), f"rows doubled: {sorted(index)}"
    return {r["index"]: {k: v for k, v in r.items() if not (k == "error" and v is None)} for r in rows}


def run(tiny_dir, *argv: str) -> int:
    """The CLI in deterministic mode: rows batched together give the API's bits for each alone."""
    return main([*argv, "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", "--quiet", "--deterministic"])


@pytest.mark.parametrize("rows", [SCORE_ROWS, MANY_ROWS], ids=["continuation", "continuations"])
def test_score_every_format_same_numbers(tiny, tiny_dir, tmp_path, rows, capsys):
    outs = {}
    for ext in ("jsonl", "csv", "parquet"):
        src = write_table(tmp_path / f"in.{ext}", rows)
        for out_ext in ("jsonl", "parquet"):
            out = tmp_path / f"out-{ext}.{out_ext}"
            assert run(tiny_dir, "score", "--input", str(src), "--output", str(out), "--keep-columns", "prompt") == 0
            outs[ext, out_ext] = by_index(out)
    first = outs["jsonl", "jsonl"]
    for key, got in outs.items():
        assert got == first, key  # identical numbers, whatever the formats (float32 columns lose nothing)
    for i, row in enumerate(rows):
        conts = row.get("continuations") or [row["continuation"]]
        want = tiny.score(row["prompt"], [c if c[0].isspace() or not row["prompt"] else " " + c for c in conts])
        got = first[i]
        assert got["prompt"] == row["prompt"]
        log_probs = got["log_prob"] if "continuations" in row else [got["log_prob"]]
        assert log_probs == [w.log_prob for w in want]
        tokens = got["token_logprobs"] if "continuations" in row else [got["token_logprobs"]]
        assert tokens == [w.token_logprobs for w in want]
    schema = pq.read_schema(next((tmp_path / "out-csv.parquet").glob("part-*.parquet")))
    assert schema.field("token_logprobs").type in (pa.list_(pa.float32()), pa.list_(pa.list_(pa.float32())))


def test_logprobs_every_format_same_numbers(tiny, tiny_dir, tmp_path):
    from helpers import random_sequences

    seqs = [dict(s, id=f"s{i}") for i, s in enumerate(random_sequences(5, seed=1))]
    outs = {}
    for ext in ("jsonl", "csv", "parquet"):
        src = write_table(tmp_path / f"in.{ext}", seqs)
        for out_ext in ("jsonl", "parquet"):
            out = tmp_path / f"out-{ext}.{out_ext}"
            assert run(tiny_dir, "logprobs", "--input", str(src), "--output", str(out), "--top-k", "2",
                       "--entropy", "--max-batch-tokens", "80", "--keep-columns", "id") == 0  # CSV cells: text
            outs[ext, out_ext] = by_index(out)
    first = outs["jsonl", "jsonl"]
    assert all(got == first for got in outs.values())
    want = tiny.logprobs([{k: s[k] for k in ("prompt_token_ids", "completion_token_ids")} for s in seqs],
                         top_k=2, entropy=True)
    for i, w in enumerate(want):
        assert first[i]["id"] == f"s{i}"
        assert first[i]["logprobs"] == w.logprobs.tolist() and first[i]["top_k_ids"] == w.topk_ids.tolist()


def test_failed_first_batch_writes_every_result_column(tiny_dir, tmp_path):
    """A part of failed rows only has the result columns too (null, with their types), so a reader
    that takes the first part's schema (``pq.read_table(dir)``) loses nothing."""
    from helpers import random_sequences

    good = random_sequences(2, seed=3)
    bad = {"prompt_token_ids": [5], "completion_token_ids": [99999]}
    src = write_table(tmp_path / "in.jsonl", [bad, *good])
    out = tmp_path / "out.parquet"
    assert run(tiny_dir, "logprobs", "--input", str(src), "--output", str(out), "--top-k", "2",
               "--batch-rows", "1") == 1
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == 3
    schemas = [pq.read_schema(p) for p in parts]
    assert all(s.equals(schemas[0]) for s in schemas), schemas
    assert schemas[0].field("logprobs").type == pa.list_(pa.float32())
    assert schemas[0].field("top_k_ids").type == pa.list_(pa.list_(pa.int64()))
    whole = pq.read_table(out)
    assert whole.num_rows == 3 and whole["logprobs"].null_count == 1 and whole["top_k_logprobs"].null_count == 1


def test_perplexity_rows_and_aggregate(tiny, tiny_dir, tmp_path, capsys):
    src = write_table(tmp_path / "in.csv", [{"text": t, "source": f"doc{i}"} for i, t in enumerate(TEXTS)])
    out = tmp_path / "ppl.parquet"
    opts = ["--context-length", "16", "--stride", "4"]
    assert run(tiny_dir, "perplexity", "--input", str(src), "--output", str(out), "--keep-columns", "source",
               "--json", *opts) == 0
    agg = json.loads(capsys.readouterr().out)
    rows = by_index(out)
    for i, t in enumerate(TEXTS):
        one = tiny.perplexity(t, context_length=16, stride=4)
        assert rows[i]["perplexity"] == one.perplexity and rows[i]["num_tokens"] == one.num_tokens
        assert rows[i]["source"] == f"doc{i}"
    want = tiny.perplexity(TEXTS, context_length=16, stride=4)
    assert agg["num_rows"] == len(TEXTS) and agg["num_tokens"] == want.num_tokens
    assert math.isclose(agg["perplexity"], want.perplexity, rel_tol=1e-12)
    assert math.isclose(agg["perplexity_stderr"], want.perplexity_stderr, rel_tol=1e-9)
    assert math.isclose(agg["word_perplexity"], want.word_perplexity, rel_tol=1e-12)
    assert math.isclose(agg["bits_per_byte"], want.bits_per_byte, rel_tol=1e-12)
    # without --output: the same aggregate, rows in the JSON
    assert run(tiny_dir, "perplexity", "--input", str(src), "--json", *opts) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["perplexity"] == agg["perplexity"] and len(again["rows"]) == len(TEXTS)


def test_bad_rows_reported_written_and_rerun(tiny_dir, tmp_path, capsys):
    rows = [{"prompt": "a", "continuations": "[\"b\"]"}, {"prompt": "a", "continuations": "[b"},
            {"prompt": "c", "continuations": ""}, {"prompt": "d", "continuations": "[\"e\", \"f\"]"}]
    src, out = write_table(tmp_path / "in.csv", rows), tmp_path / "out.parquet"
    assert run(tiny_dir, "score", "--input", str(src), "--output", str(out), "--batch-rows", "2") == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("row 2: continuations: is not a JSON list"), err
    assert err[1].startswith("row 3: continuation: is missing"), err
    got = by_index(out)
    assert sorted(got) == [0, 1, 2, 3] and "continuations" in got[1]["error"] and got[1]["log_prob"] is None
    assert len(got[3]["log_prob"]) == 2 and "error" not in got[0]
    rows[1]["continuations"], rows[2]["continuations"] = "[\"x\"]", "[\"y\"]"  # fixed: only they run again
    write_table(src, rows)
    assert run(tiny_dir, "score", "--input", str(src), "--output", str(out), "--batch-rows", "2") == 0
    assert "2 written, 2 already done, 0 failed" in capsys.readouterr().out
    fixed = by_index(out)
    assert sorted(fixed) == [0, 1, 2, 3] and not any("error" in r for r in fixed.values())
    assert fixed[0] == got[0] and fixed[3] == got[3]


@pytest.mark.slow  # slow tier (pytest -m slow): kill -9 of a real job
def test_parquet_output_survives_kill_9(tiny_dir, tmp_path):
    """A run killed (SIGKILL) right after its first part is written; the rerun adds the rest:
    every row once, bitwise equal to a run never interrupted (deterministic mode)."""
    from helpers import random_sequences

    lines = [json.dumps(s) + "\n" for s in random_sequences(7, seed=2)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(lines), encoding="utf-8")
    out, clean = tmp_path / "out.parquet", tmp_path / "clean.parquet"
    opts = ["--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", "--deterministic", "--batch-rows", "2"]
    # stdin is a pipe we feed: after 3 rows the job has written part 0 (rows 0-1), holds row 2 and
    # waits for more input, so the kill lands at a known point
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli.main", "logprobs", *opts, "--input", "-",
                             "--output", str(out)], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.write("".join(lines[:3]))
    proc.stdin.flush()
    deadline = time.time() + 120
    while not (out / "part-00000.parquet").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    proc.stdin.close(), proc.stderr.close()
    assert sorted(by_index(out)) == [0, 1]
    (out / ".part-00001.parquet.tmp").write_bytes(b"half a part")  # what a kill mid-write leaves
    assert main(["logprobs", *opts, "--quiet", "--input", str(src), "--output", str(out)]) == 0
    assert main(["logprobs", *opts, "--quiet", "--input", str(src), "--output", str(clean)]) == 0
    assert by_index(out) == by_index(clean) and sorted(by_index(out)) == list(range(7))
    assert not (out / ".part-00001.parquet.tmp").exists()
    assert len(list(out.glob("part-*.parquet"))) == 4  # 2 rows, then 2 + 2 + 1


def test_input_errors_are_one_line(tiny_dir, tmp_path, capsys):
    assert run(tiny_dir, "score", "--input", str(tmp_path / "in.xlsx"), "--output", str(tmp_path / "o.jsonl")) == 2
    err = capsys.readouterr().err
    assert err.startswith("logprobe: error: --input") and err.count("\n") == 1
    assert run(tiny_dir, "score", "--input", str(tmp_path / "nope.csv"), "--output", str(tmp_path / "o.jsonl")) == 2
    assert "nope.csv" in capsys.readouterr().err
    src = write_table(tmp_path / "in.jsonl", SCORE_ROWS[:1])
    assert run(tiny_dir, "score", "a", "b", "--input", str(src), "--output", str(tmp_path / "o.jsonl")) == 2
    assert "drop PROMPT" in capsys.readouterr().err


def test_progress_bar_and_version(capsys):
    from logprobe.cli.main import version_text
    from logprobe.cli.rows import Progress

    bar = Progress(4, enabled=True)
    bar.update(1, 300)
    bar.update(1, 100)
    bar.close()
    err = capsys.readouterr().err
    assert "2/4" in err and "400 tok" in err and "tok/s" in err and "<" in err  # done/total, tokens, ETA
    assert Progress(4, enabled=False).bar is None
    text = version_text()
    assert text.startswith("logprobe ") and "torch " in text and "device " in text and "triton" in text
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == text


@pytest.mark.parametrize("out_name", ["out.parquet", "out.jsonl"])
def test_output_in_input_order_with_input_columns(tiny_dir, tmp_path, capsys, out_name):
    """Rows come back in input order (a failed row is not written first; a resumed run's rows are
    put in their places) with every input column, so the output lines up with the input."""
    import pandas as pd

    rows = [{"prompt": p, "continuation": c, "q": k, "note": f"n{k}"} for k, (p, c) in enumerate(
        [("The capital of France is", "Paris"), ("Hello", " world"), ("a", None), ("2 + 2 =", "4"), ("Yes or", "no")])]
    src, out = write_table(tmp_path / "in.jsonl", rows), tmp_path / out_name
    assert run(tiny_dir, "score", "--input", str(src), "--output", str(out), "--batch-rows", "5") == 1
    read = (lambda: pd.read_parquet(out)) if out_name.endswith(".parquet") else (lambda: pd.read_json(out, lines=True))
    got = read()
    assert got["index"].tolist() == [0, 1, 2, 3, 4]
    assert got["q"].tolist() == [0, 1, 2, 3, 4] and got["note"].tolist() == [f"n{k}" for k in range(5)]
    assert got["prompt"].tolist() == [r["prompt"] for r in rows] and got["error"].notna().tolist()[2]
    rows[2]["continuation"] = "b"  # fixed: the rerun computes row 2 only, and it lands in its place
    write_table(src, rows)
    assert run(tiny_dir, "score", "--input", str(src), "--output", str(out), "--batch-rows", "5") == 0
    assert "1 written, 4 already done" in capsys.readouterr().out
    again = read()
    assert again["index"].tolist() == again["q"].tolist() == [0, 1, 2, 3, 4]
    assert again["log_prob"].notna().all() and again["log_prob"].tolist()[:2] == got["log_prob"].tolist()[:2]
    assert run(tiny_dir, "score", "--input", str(src), "--output", str(tmp_path / "kept.jsonl"),
               "--keep-columns", "q") == 0
    assert "note" not in by_index(tmp_path / "kept.jsonl")[0]  # --keep-columns: only those
