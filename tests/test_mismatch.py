"""The training-inference mismatch report (``scoring.mismatch``): literal gold values, a float64
reference written independently with numpy, and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from logprobe.errors import LogprobeError
from logprobe.scoring.mismatch import mismatch


def test_gold_example_from_the_docstring():
    r = mismatch([[-1.0, -2.0]], [[-1.1, -1.5]])
    o = r.overall
    assert o.tokens == 2
    assert o.max_abs == pytest.approx(0.5, abs=1e-12)
    assert o.mean_abs == pytest.approx(0.3, abs=1e-12)
    assert o.k1 == pytest.approx(0.2, abs=1e-12)
    assert o.k2 == pytest.approx(0.065, abs=1e-12)
    # exp(0.1) - 1.1 = 0.005170918075647624, exp(-0.5) - 0.5 = 0.10653065971263342
    assert o.k3 == pytest.approx((0.005170918075647624 + 0.10653065971263342) / 2, abs=1e-15)
    assert o.out_of_range == 0.5
    assert r.sequences[0] == o


def numpy_reference(ours, theirs, low, high):
    d = np.concatenate([np.asarray(a, np.float64) - np.asarray(b, np.float64) for a, b in zip(ours, theirs)])
    ratio = np.exp(d)
    return dict(tokens=d.size, max_abs=np.abs(d).max(), mean_abs=np.abs(d).mean(), k1=(-d).mean(),
                k2=(d ** 2 / 2).mean(), k3=(ratio - 1 - d).mean(), out=((ratio < low) | (ratio > high)).mean())


def test_random_sequences_equal_an_independent_float64_reference():
    rng = np.random.default_rng(0)
    lengths = [1, 7, 0, 40, 3]
    theirs = [rng.uniform(-8, 0, n) for n in lengths]
    ours = [t + rng.normal(0, 0.2, t.size) for t in theirs]
    r = mismatch(ours, theirs, low=0.9, high=1.1)
    ref = numpy_reference(ours, theirs, 0.9, 1.1)
    o = r.overall
    assert o.tokens == ref["tokens"] == sum(lengths)
    for key in ("max_abs", "mean_abs", "k1", "k2", "k3"):
        assert getattr(o, key) == pytest.approx(ref[key], rel=1e-12, abs=1e-15), key
    assert o.out_of_range == pytest.approx(ref["out"], abs=1e-15)
    assert [m.tokens for m in r.sequences] == lengths
    assert r.sequences[2].tokens == 0 and r.sequences[2].k3 == 0.0
    # overall is token-weighted: the sequences' k1 times their lengths sum to the total
    assert sum(m.k1 * m.tokens for m in r.sequences) == pytest.approx(o.k1 * o.tokens, rel=1e-12)


def test_identical_log_probs_are_zero_everywhere():
    r = mismatch([[-0.5, -3.0, -1e-9]], [[-0.5, -3.0, -1e-9]])
    assert (r.overall.max_abs, r.overall.k1, r.overall.k2, r.overall.k3, r.overall.out_of_range) == (0, 0, 0, 0, 0)
    assert "0% of tokens" in r.report()


@pytest.mark.parametrize("ours, theirs, field", [
    ([[-1.0]], [[-1.0], [-2.0]], "logprobs"),
    ([[-1.0, -2.0]], [[-1.0]], "logprobs[0]"),
    ([[-1.0]], [[math.nan]], "logprobs[0]"),
])
def test_refusals_name_the_field(ours, theirs, field):
    with pytest.raises(LogprobeError) as e:
        mismatch(ours, theirs)
    assert e.value.field == field


def test_ratio_range_is_checked():
    with pytest.raises(LogprobeError):
        mismatch([[-1.0]], [[-1.0]], low=1.2, high=1.25)


def test_cli_compare_logprobs_from_a_file_on_the_default_model(tmp_path, capsys, default_scorer):
    """``logprobe compare --logprobs-from``: a JSONL file of sequences with another engine's
    log-probs (here logprobe's own, shifted by known amounts) against the default model."""
    import json

    from logprobe.cli.main import main

    seqs = [{"prompt_token_ids": [504, 3575, 282], "completion_token_ids": [4649, 314, 2260]},
            {"prompt_token_ids": [1, 2, 3, 4], "completion_token_ids": [28, 29]}]
    exact = [r.logprobs.tolist() for r in default_scorer.logprobs(seqs)]
    shift = [[0.0, 0.5, -0.1], [0.3, 0.0]]
    theirs = [[a - d for a, d in zip(e, s)] for e, s in zip(exact, shift)]
    f = tmp_path / "rollouts.jsonl"
    f.write_text("".join(json.dumps({**s, "rollout_logprobs": t, "id": i}) + "\n"
                         for i, (s, t) in enumerate(zip(seqs, theirs))))
    out, page = tmp_path / "report.json", tmp_path / "page.html"
    assert main(["compare", "--logprobs-from", str(f), "--logprobs-column", "rollout_logprobs", "--device", "cpu",
                 "--dtype", "float32", "--json", "--output", str(out), "--plot", str(page), "--quiet"]) == 0
    overall = json.loads(capsys.readouterr().out)
    want = mismatch(exact, theirs).overall
    assert overall["tokens"] == 5
    assert overall["max_abs"] == pytest.approx(0.5, abs=1e-6)
    assert overall["k3"] == pytest.approx(want.k3, abs=1e-9)
    assert overall["out_of_range"] == pytest.approx(2 / 5)  # exp(0.5) = 1.65 and exp(0.3) = 1.35 > 1.25
    report = json.loads(out.read_text())
    assert [s["tokens"] for s in report["sequences"]] == [3, 2]
    assert "|log p - log q| per token" in page.read_text()


def test_cli_compare_needs_a_reference_or_a_file(tmp_path, capsys):
    from logprobe.cli.main import main

    assert main(["compare", "--text-file", str(tmp_path / "x.txt")]) != 0
    assert "--reference" in capsys.readouterr().err
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt_token_ids": [1], "completion_token_ids": [2, 3], "logprobs": [-1.0]}\n')
    assert main(["compare", "--logprobs-from", str(f), "--device", "cpu", "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "logprobs[0]" in err and len(err.strip().splitlines()) == 1


def test_cli_compare_reads_trl_and_vllm_rollouts(tmp_path, capsys, default_scorer):
    """The same two completions written as TRL's rollout output (rank-sorted lists, the sampled
    token's first) and as vLLM's RequestOutput JSON (one prompt, two outputs, per-token dicts keyed
    by token id): the report equals the one on the plain layout; a null log-prob is refused."""
    import json

    from logprobe.cli.main import main

    prompt, comps = [504, 3575, 282], [[4649, 314, 2260], [28, 29]]
    seqs = [{"prompt_token_ids": prompt, "completion_token_ids": c} for c in comps]
    exact = [r.logprobs.tolist() for r in default_scorer.logprobs(seqs)]
    theirs = [[a - 0.2 * (j + 1) for j, a in enumerate(e)] for e in exact]
    want = mismatch(exact, theirs).overall
    trl = tmp_path / "trl.jsonl"
    trl.write_text("".join(json.dumps({"prompt_ids": prompt, "completion_ids": c,
                                       "logprobs": [[v, v - 3.0] for v in t]}) + "\n"
                           for c, t in zip(comps, theirs)))
    vllm = tmp_path / "vllm.jsonl"
    vllm.write_text(json.dumps({"prompt_token_ids": prompt, "outputs": [
        {"token_ids": c, "logprobs": [{str(tok): {"logprob": v, "rank": 3}, "7": {"logprob": -0.01, "rank": 1}}
                                      for tok, v in zip(c, t)]} for c, t in zip(comps, theirs)]}) + "\n")
    for f in (trl, vllm):
        assert main(["compare", "--logprobs-from", str(f), "--device", "cpu", "--dtype", "float32", "--json",
                     "--quiet"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["tokens"] == 5
        assert got["k3"] == pytest.approx(want.k3, abs=1e-9) and got["max_abs"] == pytest.approx(want.max_abs, abs=1e-6)
    bad = tmp_path / "null.jsonl"
    bad.write_text(json.dumps({"prompt_ids": prompt, "completion_ids": [28, 29], "logprobs": [[-1.0], [None]]}) + "\n")
    assert main(["compare", "--logprobs-from", str(bad), "--device", "cpu", "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "logprobs[1]" in err and "line 1" in err and len(err.strip().splitlines()) == 1
