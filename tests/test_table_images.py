"""An image column in table jobs (``--images-column``, ``jobs.images``) through the real CLI entry
point, on ``test_qwen3_5_images``'s tiny Qwen3.5 with its vision tower: paths relative to the
table file (run from another folder), lists of them, Parquet bytes; the numbers are the library's,
bitwise (deterministic mode, the CLI's cached model); a row whose image cannot be read fails
alone, naming the row and the column, and the other rows are written."""

from __future__ import annotations

import json

import pytest

from logprobe.cli.main import get_scorer, main
from logprobe.io.tables import Row
from logprobe.jobs import map_rows
from logprobe.jobs.named import row_job
from logprobe.scoring.continuations import split

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")
from test_qwen3_5_images import PAD, _image, _png, save_vl_checkpoint  # noqa: E402

A, B = _png(_image(32, 48, 1)), _png(_image(48, 48, 2))


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("table-qwen3_5")
    save_vl_checkpoint(d)
    return str(d)


def _args(vl_dir: str) -> list[str]:
    return ["--model", vl_dir, "--device", "cpu", "--dtype", "float32", "--deterministic", "--quiet"]


def _rows(path) -> dict[int, dict]:
    return {r["index"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow  # the CLI on a vision checkpoint: ~5 s on 2 cores
def test_logprobs_table_with_an_images_column(vl_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "data" / "imgs").mkdir(parents=True)
    (tmp_path / "data" / "imgs" / "a.png").write_bytes(A)
    (tmp_path / "data" / "imgs" / "b.png").write_bytes(B)
    (tmp_path / "data" / "imgs" / "bad.png").write_bytes(A[:100])  # truncated
    scorer = get_scorer(vl_dir, "cpu", "float32", deterministic=True)
    one = scorer.tokenizer.encode(f"Look: {PAD} what?")
    two = scorer.tokenizer.encode(f"{PAD} and {PAD}: same?")
    completion = scorer.tokenizer.encode(" A square.")
    rows = [{"prompt_token_ids": one, "completion_token_ids": completion, "image": "imgs/a.png"},
            {"prompt_token_ids": two, "completion_token_ids": completion, "image": ["imgs/a.png", "imgs/b.png"]},
            {"prompt_token_ids": one, "completion_token_ids": completion, "image": "imgs/missing.png"},
            {"prompt_token_ids": two, "completion_token_ids": completion, "image": ["imgs/a.png", "imgs/bad.png"]},
            {"prompt_token_ids": one, "completion_token_ids": completion, "image": ["imgs/a.png", "imgs/b.png"]},
            {"prompt_token_ids": [5, 6], "completion_token_ids": completion, "image": None}]
    inp, out = tmp_path / "data" / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # paths are the table file's, not the current folder's
    assert main(["logprobs", "--input", str(inp), "--output", str(out), "--images-column", "image",
                 *_args(vl_dir)]) == 1
    err = capsys.readouterr().err
    assert "line 3: image: 'imgs/missing.png' cannot be read" in err
    assert "line 4: image[1]: is not a readable image" in err
    assert "line 5: image: 2 images" in err  # one placeholder, two images
    got = _rows(out)
    assert [bool(got[i].get("error")) for i in range(6)] == [False, False, True, True, True, False]
    want = scorer.logprobs([{"prompt_token_ids": one, "completion_token_ids": completion, "images": [A]},
                            {"prompt_token_ids": two, "completion_token_ids": completion, "images": [A, B]},
                            {"prompt_token_ids": [5, 6], "completion_token_ids": completion}])
    assert [got[i]["logprobs"] for i in (0, 1, 5)] == [w.logprobs.tolist() for w in want]  # bitwise


@pytest.mark.slow  # pyarrow and the CLI on a vision checkpoint: ~7 s on 2 cores
def test_score_parquet_with_image_bytes(vl_dir, tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    prompt = f"Look: {PAD} what is it?"
    table = pa.table({"prompt": [prompt, prompt, f"{PAD}{PAD}"], "continuation": ["A square", "A cat", "Two"],
                      "image": [A, B, A]})
    inp, out = tmp_path / "in.parquet", tmp_path / "out.jsonl"
    pq.write_table(table, inp)
    assert main(["score", "--input", str(inp), "--output", str(out), "--images-column", "image",
                 *_args(vl_dir)]) == 1
    assert "row 3: image: 1 images for 2 <|image_pad|> placeholders" in capsys.readouterr().err
    got = _rows(out)
    scorer = get_scorer(vl_dir, "cpu", "float32", deterministic=True)
    for i, (cont, png) in enumerate([(" A square", A), (" A cat", B)]):
        ids = split(scorer.tokenizer, prompt, cont)[1]
        want = scorer.logprobs([{"prompt": prompt, "completion_token_ids": ids, "images": [png]}])[0]
        assert got[i]["token_logprobs"] == want.logprobs.tolist()  # bitwise
        assert got[i]["continuation"] == cont


def test_rows_with_images_as_ray_maps_them(vl_dir, tmp_path):
    """The mapping Ray's actors run (``row_job`` + ``map_rows``): an image column by name, a path
    relative to ``base_dir`` and bytes; the library's numbers, bitwise; a bad image fails its row."""
    (tmp_path / "a.png").write_bytes(A)
    scorer = get_scorer(vl_dir, "cpu", "float32", deterministic=True)
    one = scorer.tokenizer.encode(f"Look: {PAD} what?")
    completion = scorer.tokenizer.encode(" A square.")
    job = row_job("logprobs", images_column="img", base_dir=str(tmp_path))
    rows = [Row(0, "row 1", {"prompt_token_ids": one, "completion_token_ids": completion, "img": "a.png"}),
            Row(1, "row 2", {"prompt_token_ids": one, "completion_token_ids": completion, "img": B}),
            Row(2, "row 3", {"prompt_token_ids": one, "completion_token_ids": completion, "img": b"GIF8"})]
    got = map_rows(scorer, job, rows)
    want = scorer.logprobs([{"prompt_token_ids": one, "completion_token_ids": completion, "images": [x]} for x in (A, B)])
    assert [g["logprobs"] for g in got[:2]] == [w.logprobs.tolist() for w in want]
    assert got[2]["error"].startswith("img: is not an image") and "img" not in got[0]  # bytes not copied


def test_score_rows_with_continuations_and_chat_image_paths(vl_dir, tmp_path, monkeypatch):
    """A score row's ``continuations`` all take the row's images; a chat row's image part is a path
    relative to the table file's folder (``base_dir``), as the column's is, not the current folder's."""
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(A)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    scorer = get_scorer(vl_dir, "cpu", "float32", deterministic=True)
    prompt = f"Look: {PAD} what is it?"

    def chat(image):
        return [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "image", "image": image}]},
                {"role": "assistant", "content": "A square."}]
    job = row_job("score", images_column="img", base_dir=str(tmp_path))
    rows = [Row(0, "row 1", {"prompt": prompt, "continuations": ["A square", "A cat"], "img": "imgs/a.png"}),
            Row(1, "row 2", {"messages": chat("imgs/a.png")}),
            Row(2, "row 3", {"messages": chat("imgs/missing.png")})]
    got = map_rows(scorer, job, rows)
    want = scorer.score(prompt, [" A square", " A cat"], images=[A])
    assert got[0]["token_logprobs"] == [w.token_logprobs for w in want]  # bitwise, each continuation
    assert got[1]["token_logprobs"] == scorer.score_chat(chat(A)).token_logprobs
    assert got[2]["error"].startswith("messages[0].content[1].image: 'imgs/missing.png' cannot be read"), got[2]


def test_ray_command_passes_the_image_column(tmp_path):
    import argparse

    from logprobe.cli.ray_cmd import add_ray_parser, job_options

    parser = argparse.ArgumentParser()
    add_ray_parser(parser.add_subparsers(), argparse.ArgumentParser(add_help=False), argparse.ArgumentParser(add_help=False))
    args = parser.parse_args(["ray", "logprobs", "--input", str(tmp_path / "t.parquet"), "--output", "o",
                              "--images-column", "image"])
    for k in ("temperature", "top_k", "entropy"):
        setattr(args, k, {"temperature": 1.0, "top_k": 0, "entropy": False}[k])
    options = job_options(args)
    assert options["images_column"] == "image" and options["base_dir"] == str(tmp_path)
    args = parser.parse_args(["ray", "score", "--input", str(tmp_path / "t.parquet"), "--output", "o"])
    for k in ("temperature", "top_k", "entropy"):
        setattr(args, k, {"temperature": 1.0, "top_k": 0, "entropy": False}[k])
    assert job_options(args)["base_dir"] == str(tmp_path)  # a chat row's image paths, no image column
