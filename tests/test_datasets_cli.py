"""``logprobe perplexity --dataset``: a local dataset equals ``--text-file`` on the same text;
joining is stated and selectable; offline with nothing cached is one clear line; the flags vLLM,
lm-eval and llama.cpp users type parse to the same options."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from logprobe.cli.main import build_parser, main

# wikitext-like rows: headings, paragraphs, empty rows between them
ROWS = ["", " = Valkyria Chronicles = \n", "", " Senjō no Valkyria is a tactical role @-@ playing game .\n",
        " It was released in January 2011 in Japan .\n", "", " = = Gameplay = = \n", "",
        " The game 's battle system , the BliTZ system , is carried over .\n"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers import make_hf_dir

    d = tmp_path_factory.mktemp("tiny-llama")
    make_hf_dir(d, "llama", seed=7)
    return d


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    """A dataset directory laid out like a hub dataset repo: data/<split>-00000-of-00001.parquet."""
    d = tmp_path_factory.mktemp("tiny-wikitext")
    (d / "data").mkdir()
    pq.write_table(pa.table({"text": ROWS}), d / "data" / "test-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": ROWS[:3]}), d / "data" / "train-00000-of-00001.parquet")
    return d


def ppl(tiny_dir, capsys, *argv: str) -> dict:
    code = main(["perplexity", *argv, "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", "--json",
                 "--quiet", "--context-length", "32", "--stride", "8"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_dataset_equals_text_file(tiny_dir, dataset_dir, tmp_path, capsys):
    text = tmp_path / "joined.txt"
    text.write_text("\n\n".join(ROWS), encoding="utf-8")  # the Hugging Face guide's join (the default)
    want = ppl(tiny_dir, capsys, "--text-file", str(text))
    got = ppl(tiny_dir, capsys, "--dataset", str(dataset_dir), "--split", "test", "--text-field", "text")
    for k in ("perplexity", "perplexity_stderr", "num_tokens", "num_windows", "word_perplexity", "bits_per_byte"):
        assert got[k] == want[k], k
    text.write_text("\n".join(ROWS[:5]), encoding="utf-8")  # another join, the first 5 rows
    want = ppl(tiny_dir, capsys, "--text-file", str(text))
    got = ppl(tiny_dir, capsys, "--dataset", str(dataset_dir), "--num-samples", "5", "--join", "\\n")
    assert got["perplexity"] == want["perplexity"] and got["num_tokens"] == want["num_tokens"]


def test_saved_dataset_and_per_row_join(tiny_dir, tmp_path, capsys):
    import datasets

    saved = tmp_path / "saved"
    docs = [r for r in ROWS if r.strip()]
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"page": docs})}).save_to_disk(str(saved))
    text = tmp_path / "joined.txt"
    text.write_text("\n\n".join(docs), encoding="utf-8")
    joined = ppl(tiny_dir, capsys, "--dataset", str(saved), "--text-field", "page")
    assert joined["perplexity"] == ppl(tiny_dir, capsys, "--text-file", str(text))["perplexity"]
    per_doc = ppl(tiny_dir, capsys, "--dataset", str(saved), "--text-field", "page", "--join", "none")
    assert per_doc["num_rows"] == len(docs) and len(per_doc["rows"]) == len(docs)
    assert per_doc["num_tokens"] == sum(r["num_tokens"] for r in per_doc["rows"])


def test_missing_dataset_offline_is_one_line(tiny_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert main(["perplexity", "--dataset", "no-such-org/no-such-dataset", "--model", str(tiny_dir),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("logprobe: error: --dataset") and "no-such-dataset" in err
    assert "cache" in err and "Traceback" not in err
    assert main(["perplexity", "--model", str(tiny_dir)]) == 2
    assert "exactly one of --text-file, --dataset, --input" in capsys.readouterr().err


def test_flags_as_other_tools_spell_them():
    parse = build_parser().parse_args
    base = ["perplexity", "--dataset", "wikitext", "--dataset-config", "wikitext-2-raw-v1"]
    a = parse([*base, "--context-length", "512", "--stride", "256", "--num-samples", "10"])
    for other in (["-c", "512", "--stride", "256", "--limit", "10"],
                  ["--ctx-size", "512", "--stride", "256", "--limit", "10"]):
        b = parse([*base, *other])
        assert (b.context_length, b.stride, b.num_samples) == (a.context_length, a.stride, a.num_samples) == (512, 256, 10)
    assert parse(["perplexity", "-f", "wiki.test.raw"]).text_file == "wiki.test.raw"
    assert parse(["perplexity", "--dataset-path", "x", "--dataset-name", "y"]).dataset_config == "y"


def test_missing_input_fails_before_loading(tmp_path, capsys, monkeypatch):
    from logprobe.cli import main as cli

    monkeypatch.setattr(cli, "get_scorer", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["perplexity", "--input", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("logprobe: error: --input") and "nope.jsonl" in err and err.count("\n") == 1
