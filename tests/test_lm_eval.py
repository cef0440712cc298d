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

pytestmark = pytest.mark.slow  # slow tier (pytest -m slow): lm-eval against a real server

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


# -- in process (--model logprobe, integrations/lm_eval.py) against the server path ---------------


@pytest.fixture(scope="module")
def in_process(evaluation, default_scorer, tmp_path_factory):
    """The same tasks through ``LogprobeLM`` on the session's scorer, no server: lm-eval's
    ``local-completions`` with max_length L rolls the windows the ``logprobe`` model draws with L - 2."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from logprobe.integrations.lm_eval import LogprobeLM

    tasks = tmp_path_factory.mktemp("tasks_in_process")
    for name in ("mc", "rolling"):
        (tasks / f"{name}.yaml").write_text((DATA / f"{name}.yaml.in").read_text().replace("@DATA@", str(DATA)))
    lm = LogprobeLM(scorer=default_scorer, max_length=MAX_LENGTH - 2)
    return simple_evaluate(model=lm, tasks=["logprobe_mc", "logprobe_rolling"],
                           task_manager=TaskManager(include_path=str(tasks)), batch_size=4, log_samples=True)


def _resp(r) -> tuple[float, bool | None]:
    return (float(r[0]), bool(r[1])) if isinstance(r, (list, tuple)) else (float(r), None)


@pytest.mark.parametrize("task", ["logprobe_mc", "logprobe_rolling"])
def test_in_process_equals_server(evaluation, in_process, task):
    server = {s["doc_id"]: s for s in evaluation["samples"][task]}
    ours = {s["doc_id"]: s for s in in_process["samples"][task]}
    assert sorted(server) == sorted(ours) and len(ours) >= 3
    for doc_id, s in ours.items():
        assert _args(s) == _args(server[doc_id])
        got = [_resp(r) for r in s["filtered_resps"]]
        want = [_resp(r) for r in server[doc_id]["filtered_resps"]]
        assert len(got) == len(want) > 0
        for (a, ga), (b, gb) in zip(got, want):
            assert abs(a - b) <= TOL, (doc_id, a, b)
            assert ga == gb
    for metric, value in evaluation["results"][task].items():
        if isinstance(value, float) and not metric.endswith("_stderr,none"):
            assert math.isclose(in_process["results"][task][metric], value, rel_tol=1e-5, abs_tol=1e-9), metric


def test_truncated_and_empty_contexts_equal_server(server_url, default_scorer):
    """``loglikelihood`` requests lm-eval truncates (context longer than max_length), an empty context
    and a rolling document, sent straight to both LMs' request methods."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from logprobe.integrations.lm_eval import LogprobeLM

    server = LocalCompletionsAPI(model="smollm2-135m", base_url=f"{server_url}/v1/completions",
                                 max_length=MAX_LENGTH, num_concurrent=1, max_retries=3)
    ours = LogprobeLM(scorer=default_scorer, max_length=MAX_LENGTH - 2)
    long_ctx = " ".join(f"Sentence number {i} says something about the weather." for i in range(8))
    assert len(default_scorer.tokenizer.encode(long_ctx)) > 2 * MAX_LENGTH
    pairs = [(long_ctx, " The end."), ("", " Paris"), ("The capital of France is ", "Paris"),
             (long_ctx, " and then it rained for " + "many, " * 6 + "many days.")]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    got, want = ours.loglikelihood(reqs), server.loglikelihood(reqs)
    assert len(got) == len(want) == len(pairs)
    for (a, ga), (b, gb) in zip(got, want):
        assert abs(a - b) <= TOL and ga == gb
    # truncation was real: the whole long context would give another number
    full = default_scorer.loglikelihood([pairs[0]])[0][0]
    assert abs(full - got[0][0]) > 1e-3
    docs = [Instance("loglikelihood_rolling", {}, (long_ctx,), 0), Instance("loglikelihood_rolling", {}, ("Hi",), 1)]
    got, want = ours.loglikelihood_rolling(docs), server.loglikelihood_rolling(docs)
    for a, b in zip(got, want, strict=True):
        assert abs(float(a) - float(b)) <= TOL
