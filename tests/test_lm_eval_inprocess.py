"""``--model logprobe`` (integrations/lm_eval.py) and ``logprobe eval``, without a server.

The window and truncation functions are checked against lm-eval's own (``get_rolling_token_windows``,
``make_disjoint_window``, the hf backend's cut); the numbers against the server path are in
tests/test_lm_eval.py (test_in_process_equals_server, test_truncated_and_empty_contexts_equal_server)."""

from __future__ import annotations

import json
import random

import pytest
from conftest import REPO

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from logprobe.cli.main import main  # noqa: E402
from logprobe.errors import LogprobeError  # noqa: E402
from logprobe.integrations.lm_eval import LogprobeLM, rolling_sequences, truncate_pair  # noqa: E402

DATA = REPO / "tests" / "data" / "lm_eval"


@pytest.mark.parametrize("max_length", [1, 2, 3, 7, 16])
def test_rolling_sequences_are_lm_evals_windows(max_length):
    for n in [1, 2, 3, max_length, max_length + 1, 2 * max_length + 1, 5 * max_length + 3, 40]:
        ids = list(range(100, 100 + n))
        theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=ids, prefix_token=1, max_seq_len=max_length, context_len=1)]
        ours = [(s["prompt_token_ids"], s["completion_token_ids"]) for s in rolling_sequences(ids, 1, max_length)]
        assert ours == theirs, (n, max_length)
        assert [t for _, c in ours for t in c] == ids  # every token once, in order
    assert rolling_sequences([], 1, 4) == []


def test_truncate_pair_is_the_hf_backends_cut():
    rng = random.Random(0)
    for _ in range(200):
        L = rng.randint(1, 12)
        ctx = list(range(rng.randint(1, 20)))
        cont = list(range(50, 50 + rng.randint(1, L)))
        c, k = truncate_pair(ctx, cont, L)
        whole = (ctx + cont)[-(L + 1):]  # lm-eval hf: inp = (context_enc + continuation_enc)[-(max_length+1):][:-1]
        assert c + k == whole and k == cont
    with pytest.raises(LogprobeError, match="more than max_length"):
        truncate_pair([1], [2, 3, 4], 2)


def test_model_args_are_checked_before_loading():
    with pytest.raises(LogprobeError, match="unknown 'temperature'"):
        LogprobeLM.create_from_arg_string("model=smollm2-135m,temperature=2")
    with pytest.raises(LogprobeError, match="deterministic"):
        LogprobeLM.create_from_arg_string("deterministic=maybe", {"device": "cpu"})
    with pytest.raises(LogprobeError, match="max_batch_tokens"):
        LogprobeLM.create_from_arg_obj({"max_batch_tokens": 0})
    with pytest.raises(LogprobeError, match="disagree"):
        LogprobeLM(model="a", pretrained="b")


@pytest.mark.slow
def test_lm_requests_and_refusals(default_scorer):
    lm = LogprobeLM(scorer=default_scorer)
    assert lm.max_length == 2048 and lm.device == "cpu"
    reqs = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0),
            Instance("loglikelihood", {}, ("", " Paris"), 1)]
    assert lm.loglikelihood(reqs) == default_scorer.loglikelihood([r.args for r in reqs])
    assert lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("",), 0)]) == [0.0]
    gen = Instance("generate_until", {}, ("Q: 2+2?", {"until": ["\n"]}), 0, metadata=("gsm8k", 0, 1))
    with pytest.raises(LogprobeError, match="gsm8k needs generate_until"):
        lm.generate_until([gen])
    with pytest.raises(LogprobeError, match="max_length"):
        LogprobeLM(scorer=default_scorer, max_length=default_scorer.info.max_length)


@pytest.mark.slow
def test_logprobe_eval_cli_runs_lm_eval_in_process(tmp_path, monkeypatch, capsys, default_scorer):
    """``logprobe eval`` with lm-eval's own options passed through (--include_path, --limit, --output_path,
    --log_samples): every logged answer equals the library's loglikelihood."""
    seen = []
    monkeypatch.setattr("logprobe.scorer.load_model",  # the session's weights, not a second load
                        lambda *a, **kw: seen.append(a) or default_scorer.loaded)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text((DATA / "mc.yaml.in").read_text().replace("@DATA@", str(DATA)))
    out = tmp_path / "out"
    rc = main(["eval", "--device", "cpu", "--tasks", "logprobe_mc", "--include_path", str(tasks), "--limit", "2",
               "--output_path", str(out), "--log_samples", "--max-length", "512"])
    assert rc == 0 and seen == [(None, "cpu", "auto")]  # --device reached the Scorer through lm-eval
    stdout = capsys.readouterr().out
    assert "logprobe_mc" in stdout and "acc" in stdout
    samples = [json.loads(x) for f in out.rglob("samples_logprobe_mc_*.jsonl") for x in f.read_text().splitlines()]
    assert len(samples) == 2
    for s in samples:
        pairs = [tuple(a[k] for k in sorted(a)) for _, a in sorted(s["arguments"].items())]
        want = default_scorer.loglikelihood(pairs)
        got = [(float(r[0]), r[1] in (True, "True")) for r in s["filtered_resps"]]  # JSONL keeps str(bool)
        assert len(got) == 4
        for (a, ga), (b, gb) in zip(got, want):
            assert abs(a - b) <= 1e-4 and ga == gb


@pytest.mark.slow  # slow tier: ~8 s of lm-eval CLI runs
def test_logprobe_eval_cli_errors_are_one_line(capsys):
    assert main(["eval", "--device", "cpu", "--tasks", "no_such_task_xyz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "logprobe: error: lm-eval: ValueError: Tasks not found: no_such_task_xyz"
    assert not any("Traceback" in line for line in err)
    assert main(["eval", "--tasks", "x", "--max-length", "0"]) == 2
    assert "--max-length: must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # other commands still refuse unknown options
        main(["score", "A", "B", "--limit", "3"])
    assert e.value.code == 2
    assert "unrecognized arguments: --limit 3" in capsys.readouterr().err


def test_registering_logprobe_keeps_lm_evals_own_models():
    """lm-eval imports its built-in models only while its registry is empty: our registration must
    not hide them (a run that imported the integration first once lost ``local-completions``)."""
    code = ("import logprobe.integrations.lm_eval\n"
            "from lm_eval.api.registry import get_model\n"
            "print(get_model('local-completions').__name__, get_model('logprobe').__name__)")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["LocalCompletionsAPI", "LogprobeLM"]
