"""End to end: the real ``logprobe serve`` process on a loopback port, driven by
lm-evaluation-harness's ``local-completions`` client (offline, remote tokenizer endpoints), on
two small local tasks; the reported numbers must equal the library's own (|Δ| <= 1e-4)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from server_util import free_port, wait_http

lm_eval = pytest.importorskip("lm_eval")

DATA = REPO / "tests" / "data" / "lm_eval"
MAX_LENGTH = 40  # lm-eval's max_length: small so each rolling document needs several windows
TOL = 1e-4


@pytest.fixture(scope="module")
def server_url():
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "logprobe.cli.main", "serve", "--port", str(port),
                             "--device", "cpu", "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url)
    except RuntimeError:
        proc.kill()
        raise RuntimeError("server did not start:\n" + proc.communicate()[0]) from None
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def evaluation(server_url, tmp_path_factory):
    tasks = tmp_path_factory.mktemp("tasks")
    for name in ("mc", "rolling"):
        text = (DATA / f"{name}.yaml.in").read_text().replace("@DATA@", str(DATA))
        (tasks / f"{name}.yaml").write_text(text)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf_datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model="local-completions",
        model_args=f"model=smollm2-135m,base_url={server_url}/v1/completions,num_concurrent=2,"
                   f"max_retries=3,max_length={MAX_LENGTH}",
        tasks=["logprobe_mc", "logprobe_rolling"], task_manager=TaskManager(include_path=str(tasks)),
        batch_size=4, log_samples=True)


def _args(sample) -> tuple:
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": ..., "arg_1": ...}}
        args = [tuple(v[k] for k in sorted(v)) for _, v in sorted(args.items())]
    return args


def test_multiple_choice_equals_library(evaluation, default_scorer):
    samples = evaluation["samples"]["logprobe_mc"]
    assert len(samples) == 8
    correct = correct_norm = 0
    for s in samples:
        pairs = [tuple(a) for a in _args(s)]
        lib = default_scorer.loglikelihood(pairs)
        theirs = s["filtered_resps"]  # [(log-likelihood, is_greedy)] per choice
        assert len(theirs) == len(pairs) == 4
        for (ll, greedy), got in zip(lib, theirs):
            assert abs(float(got[0]) - ll) <= TOL, (pairs, got, ll)
            assert bool(got[1]) == greedy
        lls = [ll for ll, _ in lib]
        correct += max(range(len(lls)), key=lls.__getitem__) == s["target"]
        norm = [ll / len(c) for ll, (_, c) in zip(lls, pairs)]
        correct_norm += max(range(len(norm)), key=norm.__getitem__) == s["target"]
    res = evaluation["results"]["logprobe_mc"]
    assert res["acc,none"] == correct / len(samples)
    assert res["acc_norm,none"] == correct_norm / len(samples)


def test_rolling_perplexity_equals_library(evaluation, default_scorer):
    samples = evaluation["samples"]["logprobe_rolling"]
    texts = [_args(s)[0][0] for s in samples]
    # lm-eval's rolling windows with max_length L = logprobe's "rolling" policy with context L - 1
    lib = default_scorer.perplexity(texts, policy="rolling", context_length=MAX_LENGTH - 1, return_token_nlls=True)
    n_tokens = [len(default_scorer.tokenizer.encode(t)) for t in texts]
    assert max(n_tokens) > 2 * MAX_LENGTH  # several windows per document
    for s, nlls in zip(samples, lib.token_nlls):
        got = s["filtered_resps"][0]
        got = float(got[0] if isinstance(got, (list, tuple)) else got)
        assert abs(got + math.fsum(nlls)) <= TOL
    res = evaluation["results"]["logprobe_rolling"]
    assert math.isclose(res["word_perplexity,none"], lib.word_perplexity, rel_tol=1e-5)
    assert math.isclose(res["byte_perplexity,none"], lib.byte_perplexity, rel_tol=1e-5)
    assert math.isclose(res["bits_per_byte,none"], lib.bits_per_byte, rel_tol=1e-5)


def test_tokenizer_was_remote(server_url):
    """lm-eval used the server's tokenizer endpoints (no local tokenizer, no network)."""
    import requests

    metrics = requests.get(server_url + "/metrics").text
    assert 'logprobe_http_requests_total{endpoint="/tokenize",status="200"}' in metrics
    assert 'logprobe_http_requests_total{endpoint="/tokenizer_info",status="200"}' in metrics
    bad = [line for line in metrics.splitlines()
           if line.startswith("logprobe_http_requests_total") and 'status="5' in line]
    assert not bad, bad


def test_data_is_local():
    assert Path(DATA / "mc.jsonl").exists() and Path(DATA / "rolling.jsonl").exists()
