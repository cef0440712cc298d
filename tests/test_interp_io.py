"""capture / steer through the CLI (JSONL, side files) and the HTTP server (native endpoints, size cap)."""

from __future__ import annotations

import json

import pytest
import requests
import torch
from safetensors.torch import load_file
from server_util import serve

from logprobe.cli.main import main
from logprobe.server import ServerConfig, create_app

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(default_scorer):
    app = create_app(default_scorer, ServerConfig(max_capture_floats=10_000))
    with serve(app) as url:
        yield url


def post(url, path, body):
    return requests.post(url + path, json=body, timeout=120)


def test_server_capture_and_steer_equal_library(server, default_scorer):
    v = torch.randn(576, generator=torch.Generator().manual_seed(1))
    steer = [{"at": "blocks.10.resid_post", "vector": v.tolist(), "coeff": 3.0, "positions": "prompt"}]
    capture = [{"at": ["blocks.-1.resid_post", "l_out-3"], "positions": "last_prompt", "reduce": "last"},
               {"at": "blocks.5.mlp_out", "reduce": "project", "vector": v.tolist()}]
    r = post(server, "/v1/score", {"prompt": PROMPT, "continuations": [" Paris"], "steer": steer, "capture": capture})
    assert r.status_code == 200, r.text
    got = r.json()["results"][0]
    want = default_scorer.score(PROMPT, [" Paris"], steer=steer, capture=capture)[0]
    assert abs(got["log_prob"] - want.log_prob) < 1e-5
    assert [c["at"] for c in got["captures"]] == ["blocks.29.resid_post", "blocks.3.resid_post", "blocks.5.mlp_out"]
    for g, w in zip(got["captures"], want.captures):
        assert g["positions"] == w.positions
        torch.testing.assert_close(torch.tensor(g["value"]), w.value, atol=1e-4, rtol=1e-5)
    plain = default_scorer.score(PROMPT, [" Paris"])[0]
    assert abs(plain.log_prob - want.log_prob) > 1e-3

    seqs = [{"prompt_token_ids": [504, 3575, 282], "completion_token_ids": [4649, 314, 6118]}]
    r = post(server, "/v1/logprobs", {"sequences": seqs, "capture": [{"at": "embed", "reduce": "mean"}],
                                      "steer": [{"vector": {"7": v.tolist()}, "coeff": {"7": -1.5}}]})
    assert r.status_code == 200, r.text
    lib = default_scorer.logprobs(seqs, capture=[{"at": "embed", "reduce": "mean"}],
                                  steer=[{"vector": {7: v}, "coeff": {7: -1.5}}])[0]
    torch.testing.assert_close(torch.tensor(r.json()["results"][0]["logprobs"]), lib.logprobs, atol=1e-5, rtol=0)

    r = post(server, "/v1/perplexity", {"texts": "One two three four five six.", "capture": [
        {"at": "final_norm", "positions": "last", "reduce": "none"}]})
    assert r.status_code == 200, r.text
    assert len(r.json()["captures"][0][0]["value"]) == 1


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({"capture": [{"at": "blocks.*.resid_post", "positions": "all"}]}, 413, "capture", "exceed"),
    ({"capture": [{"at": "blocks.40.resid_post"}]}, 400, "capture[0].at", "out of range"),
    ({"capture": [{"at": "embed", "positions": [0, 50]}]}, 400, "capture[0].positions", "outside"),
    ({"steer": [{"at": "embed", "vector": [1.0, 2.0]}]}, 400, "steer[0].vector", "hidden size is 576"),
    ({"steer": [{"at": "embed", "vector": "/etc/passwd"}]}, 400, "steer[0].vector", "reads no vector files"),
    ({"steer": [{"at": "embed", "vector": [0.0] * 576, "op": "scale"}]}, 400, "steer[0].op", "add_signed"),
    ({"capture": [{"at": "embed", "positions": "middle"}]}, 400, "capture[0].positions", "unknown positions"),
    ({"capture": [{"at": "embed", "positions": [1.5, 2]}]}, 400, "capture[0].positions", "[start, end]"),
    ({"capture": [{"at": "nowhere"}]}, 400, "capture[0].at", "valid points"),
])
def test_server_bad_hooks(server, body, status, param, words):
    r = post(server, "/v1/score", {"prompt": PROMPT, "continuations": [" Paris"], **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) or param in err["message"], err
    assert words in err["message"]
    assert requests.get(server + "/health").ok


def test_cli_logprobs_capture_side_files_and_steer(tmp_path, default_scorer, capsys):
    v = torch.randn(576, generator=torch.Generator().manual_seed(2))
    lines = [
        {"prompt_token_ids": [504, 3575], "completion_token_ids": [282, 4649],
         "capture": [{"at": "blocks.2.resid_post", "reduce": "none"}, {"at": "embed", "reduce": "sum"}]},
        {"prompt_token_ids": [504, 3575], "completion_token_ids": [282, 4649],
         "steer": [{"at": "blocks.1.attn_out", "vector": v.tolist(), "coeff": 2.0}]},
        {"prompt_token_ids": [504], "completion_token_ids": [282], "capture": [{"at": "blocks.99.mlp_out"}]},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code = main(["logprobs", "--input", str(inp), "--output", str(out), "--device", "cpu"])
    assert code == 1  # the third line is bad
    err = capsys.readouterr().err
    assert "line 3: capture[0].at:" in err and "out of range" in err
    recs = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs) == [0, 1, 2] and "out of range" in recs[2]["error"]  # the bad row carries its error
    cap_none, cap_sum = recs[0]["captures"]
    side = load_file(cap_none["file"])[cap_none["key"]]
    want = default_scorer.logprobs(lines[0:1], capture=lines[0]["capture"])[0]
    assert cap_none["shape"] == [4, 576] and torch.equal(side, want.captures[0].value)
    torch.testing.assert_close(torch.tensor(cap_sum["value"]), want.captures[1].value, atol=1e-5, rtol=0)
    steered = default_scorer.logprobs(lines[1:2], steer=lines[1]["steer"])[0]
    # another process, maybe another thread count: log-probs near -13 here, steered; float32 rounding
    torch.testing.assert_close(torch.tensor(recs[1]["logprobs"]), steered.logprobs, atol=3e-5, rtol=0)


def test_cli_train_vector_and_score_with_it(tmp_path, capsys):
    pos, neg = tmp_path / "pos.txt", tmp_path / "neg.txt"
    pos.write_text("I love it, wonderful\nWhat a great day\n")
    neg.write_text("I hate it, awful\nWhat a terrible day\n")
    cv = tmp_path / "cv.gguf"
    assert main(["train-vector", "--positive", str(pos), "--negative", str(neg), "--layers", "10:12",
                 "--output", str(cv), "--device", "cpu", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["layers"] == [10, 11]
    assert main(["score", PROMPT, "Paris", "--device", "cpu", "--json",
                 "--steer", json.dumps([{"vector": str(cv), "coeff": 4.0}])]) == 0
    steered = json.loads(capsys.readouterr().out)[0]["log_prob"]
    assert main(["score", PROMPT, "Paris", "--device", "cpu", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)[0]["log_prob"]
    assert steered != plain
    assert main(["score", PROMPT, "Paris", "--device", "cpu", "--steer", "[{"]) == 2
    assert "--steer: is not valid JSON" in capsys.readouterr().err
