"""The persistent result cache (``executor.cached``): ``Scorer(cache=DIR)``, ``--cache DIR`` and
``logprobe cache stats|clear``.

A hit gives bitwise the numbers the miss stored and runs no forward pass (the engine's
``fault_hook`` counts passes); new weights (load_weights) and other options (temperature, top_k,
deterministic) miss; two processes write one cache at once; a writer SIGKILLed mid-loop leaves a
database whose every entry is complete and correct.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from helpers import make_hf_dir, random_sequences

from logprobe import Scorer
from logprobe.cli.main import main
from logprobe.config import Deterministic
from logprobe.engine.request import CaptureAt, RequestResult, ScoreRequest
from logprobe.executor.cached import ResultCache, decode_result, encode_result, request_key
from logprobe.loading import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two tiny llama checkpoints (A, B: other random weights) and A loaded."""
    a, b = tmp_path_factory.mktemp("cache-a"), tmp_path_factory.mktemp("cache-b")
    make_hf_dir(a, "llama", seed=0)
    make_hf_dir(b, "llama", seed=1)
    return a, b, load_model(str(a), "cpu", "float32")


def counted(scorer: Scorer) -> list[int]:
    passes = [0]
    scorer.engine.fault_hook = lambda rows, tokens: passes.__setitem__(0, passes[0] + 1)  # the inner engine's
    return passes


def same(x, y) -> None:
    for name in ("logprobs", "ranks", "entropy", "topk_ids", "topk_logprobs"):
        a, b = getattr(x, name), getattr(y, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
            assert a.view(-1).view(torch.uint8 if a.element_size() == 1 else torch.int32 if a.element_size() == 4
                                   else torch.int64).tolist() == b.view(-1).view(
                torch.uint8 if b.element_size() == 1 else torch.int32 if b.element_size() == 4
                else torch.int64).tolist(), name  # bitwise


def test_a_hit_is_bitwise_the_miss_and_runs_no_forward(tiny, tmp_path):
    _, _, loaded = tiny
    seqs = random_sequences(6, seed=3)
    plain = Scorer(loaded, progress=False).logprobs(seqs, top_k=3, entropy=True)
    s = Scorer(loaded, progress=False, cache=str(tmp_path))
    passes = counted(s)
    miss = s.logprobs(seqs, top_k=3, entropy=True)
    assert passes[0] > 0
    passes[0] = 0
    hit = s.logprobs(seqs, top_k=3, entropy=True)
    assert passes[0] == 0  # every request answered from the cache
    for m, h, p in zip(miss, hit, plain):
        same(m, h)
        same(m, p)  # and the same numbers as a scorer without a cache
    # a fresh scorer (another process would do the same) reads what this one stored
    s2 = Scorer(loaded, progress=False, cache=str(tmp_path))
    p2 = counted(s2)
    for m, h in zip(miss, s2.logprobs(seqs, top_k=3, entropy=True)):
        same(m, h)
    assert p2[0] == 0
    # one new sequence among cached ones: only it runs
    more = s2.logprobs(seqs + random_sequences(1, seed=99), top_k=3, entropy=True)
    assert p2[0] > 0 and len(more) == 7
    st = s2.engine.cache.stats()
    assert st["entries"] == 7 and st["hits"] == 6 + 6 + 6 and st["misses"] == 7


def test_options_and_deterministic_mode_miss(tiny, tmp_path):
    _, _, loaded = tiny
    seqs = random_sequences(3, seed=4)
    s = Scorer(loaded, progress=False, cache=str(tmp_path))
    passes = counted(s)
    base = s.logprobs(seqs)
    for kw in ({"temperature": 0.5}, {"top_k": 2}, {"entropy": True}):
        passes[0] = 0
        other = s.logprobs(seqs, **kw)
        assert passes[0] > 0, kw
        passes[0] = 0
        again = s.logprobs(seqs, **kw)
        assert passes[0] == 0, kw
        for a, b in zip(other, again):
            same(a, b)
    assert not torch.equal(s.logprobs(seqs, temperature=0.5)[0].logprobs, base[0].logprobs)
    s.config = replace(s.config, deterministic=Deterministic())
    passes[0] = 0
    s.logprobs(seqs)
    assert passes[0] > 0  # deterministic mode is part of the key
    s.config = replace(s.config, deterministic=None)
    passes[0] = 0
    for a, b in zip(base, s.logprobs(seqs)):
        same(a, b)
    assert passes[0] == 0
    assert len({m["deterministic"] for m in s.engine.cache.stats()["models"]}) == 2


def test_new_weights_miss_and_old_ones_hit_again(tiny, tmp_path):
    a, b, _ = tiny
    seqs = random_sequences(3, seed=5)
    s = Scorer(load_model(str(a), "cpu", "float32"), progress=False, cache=str(tmp_path))
    passes = counted(s)
    on_a = s.logprobs(seqs)
    s.load_weights(str(b))
    passes[0] = 0
    on_b = s.logprobs(seqs)
    assert passes[0] > 0  # new weights: a new fingerprint, nothing stale served
    assert not torch.equal(on_a[0].logprobs, on_b[0].logprobs)
    fresh_b = Scorer(load_model(str(b), "cpu", "float32"), progress=False).logprobs(seqs)
    for x, y in zip(on_b, fresh_b):
        same(x, y)
    s.load_weights(str(a))  # back to A: the same bytes, the same fingerprint, hits
    passes[0] = 0
    for x, y in zip(on_a, s.logprobs(seqs)):
        same(x, y)
    assert passes[0] == 0
    assert len(s.engine.cache.stats()["models"]) == 2


def test_steer_and_capture_are_never_cached_and_results_round_trip():
    r = ScoreRequest([5, 6, 7, 8], 1, temperature=0.7, top_k=2, entropy=True)
    k = request_key("m", r)
    assert k is not None and k != request_key("n", r)
    assert k != request_key("m", ScoreRequest([5, 6, 7, 8], 2, temperature=0.7, top_k=2, entropy=True))
    assert request_key("m", ScoreRequest([5, 6, 7, 8], 1, capture=(CaptureAt("blocks.0.resid_post", (1,), "rows"),))) is None
    g = torch.Generator().manual_seed(0)
    res = RequestResult(torch.randn(3, generator=g), torch.tensor([0, 5, 2**40]), torch.randn(3, generator=g),
                        torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.randn(3, 2, generator=g))
    back = decode_result(*encode_result(res))
    same(res, back)
    assert back.ranks.dtype == torch.int64 and back.captures is None


# -- several processes --------------------------------------------------------------------------

WRITER = r"""
import hashlib, sys, torch
from logprobe.engine.request import RequestResult
from logprobe.executor.cached import ResultCache, encode_result
def entry(i):
    g = torch.Generator().manual_seed(i)
    n = 1 + i % 97
    res = RequestResult(torch.randn(n, generator=g), torch.randint(0, 50000, (n,), generator=g),
                        torch.randn(n, generator=g), torch.randint(0, 50000, (n, 4), generator=g),
                        torch.randn(n, 4, generator=g))
    return (hashlib.sha256(str(i).encode()).digest(), *encode_result(res))
cache = ResultCache(sys.argv[1])
start, stop, step = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
print("ready", flush=True)
i = start
while stop < 0 or i < stop:
    cache.put("model-x", {"name": "x"}, [entry(j) for j in range(i, i + step)], misses=step)
    i += step
"""


def expected(i: int) -> RequestResult:
    g = torch.Generator().manual_seed(i)
    n = 1 + i % 97
    return RequestResult(torch.randn(n, generator=g), torch.randint(0, 50000, (n,), generator=g),
                         torch.randn(n, generator=g), torch.randint(0, 50000, (n, 4), generator=g),
                         torch.randn(n, 4, generator=g))


def check_all(directory, ids: range) -> int:
    """Every entry present decodes to its expected numbers; returns how many are present."""
    cache = ResultCache(directory, create=False)
    try:
        assert cache._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        keys = {hashlib.sha256(str(i).encode()).digest(): i for i in ids}
        rows = cache._db.execute("SELECT key, meta, data FROM results").fetchall()
        for key, meta, data in rows:
            same(decode_result(meta, data), expected(keys[bytes(key)]))
        return len(rows)
    finally:
        cache.close()


@pytest.mark.slow  # slow tier (pytest -m slow): two fresh interpreters import torch (~8 s on 2 cores)
def test_two_processes_write_one_cache(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(start), str(start + 400), "20"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for start in (0, 200)]  # overlap 200..399
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    assert check_all(tmp_path, range(600)) == 600
    assert ResultCache(tmp_path).stats()["misses"] == 800


@pytest.mark.slow  # slow tier (pytest -m slow): a child interpreter killed mid-loop, then another (~12 s)
def test_a_writer_killed_mid_write_leaves_only_whole_entries(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "0", "-1", "50"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"ready"
    deadline = time.time() + 60
    db = tmp_path / "results.sqlite"
    while time.time() < deadline:  # let it commit a few transactions, then kill it inside its loop
        time.sleep(0.3)
        probe = ResultCache(tmp_path, create=False)
        n = probe._db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
        probe.close()
        if n >= 150:
            break
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL and db.exists()
    n = check_all(tmp_path, range(1_000_000))
    assert n >= 150 and n % 50 == 0  # whole transactions only
    # and the cache goes on working: another writer adds to it
    subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), str(n), str(n + 50), "50"], check=True,
                   capture_output=True, timeout=120)
    assert check_all(tmp_path, range(1_000_000)) == n + 50


# -- the command line ---------------------------------------------------------------------------

def test_cli_cache_flag_stats_and_clear(tiny, tmp_path, capsys):
    a, _, _ = tiny
    d = str(tmp_path / "c")
    args = ["score", "hello there", "world", "friend", "--model", str(a), "--device", "cpu", "--cache", d, "--json", "-q"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first  # the same numbers from the cache
    assert main(["cache", "stats", "--cache", d, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["entries"] == 2 and st["hits"] == 2 and st["misses"] == 2
    assert st["models"][0]["name"] and st["models"][0]["entries"] == 2
    assert main(["cache", "stats", "--cache", d]) == 0
    assert "2 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "--cache", d, "--model", "no-such-model"]) == 0
    assert "deleted 0 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "--cache", d, "--model", st["models"][0]["model"]]) == 0
    assert "deleted 2 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "--cache", d]) == 0
    capsys.readouterr()
    assert main(["cache", "stats", "--cache", d, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 0
    assert main(["cache", "stats", "--cache", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no logprobe cache" in err


@pytest.mark.slow  # slow tier (pytest -m slow): two fresh interpreters import torch (~10 s)
def test_cli_cache_through_a_subprocess(tmp_path):
    """The installed entry point: `python -m logprobe.cli.main cache stats` on a cache another process wrote."""
    subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), "0", "10", "10"], check=True, capture_output=True,
                   timeout=120)
    out = subprocess.run([sys.executable, "-m", "logprobe.cli.main", "cache", "stats", "--cache", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "10 entries" in out.stdout, out.stderr


def test_lm_eval_use_cache_beside_logprobe_cache(tiny, tmp_path):
    """lm-eval's CachingLM (its --use_cache, a sqlite of answers by request text) over a LogprobeLM
    whose scorer has logprobe's cache: both fill, both answer, the numbers agree."""
    pytest.importorskip("sqlitedict")
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import CachingLM

    from logprobe.integrations.lm_eval import LogprobeLM

    _, _, loaded = tiny
    reqs = [Instance("loglikelihood", {}, ("hello", " world"), i) for i in range(1)]
    reqs.append(Instance("loglikelihood", {}, ("good", " day"), 1))
    lm = LogprobeLM(scorer=Scorer(loaded, progress=False, cache=str(tmp_path / "lp")))
    first = CachingLM(lm, str(tmp_path / "lm-eval.db")).loglikelihood(reqs)
    assert lm.scorer.engine.cache.stats()["entries"] == 2
    passes = counted(lm.scorer)
    again = CachingLM(LogprobeLM(scorer=lm.scorer), str(tmp_path / "lm-eval.db")).loglikelihood(reqs)
    assert again == first and passes[0] == 0  # lm-eval's cache answered
    lm2 = LogprobeLM(scorer=Scorer(loaded, progress=False, cache=str(tmp_path / "lp")))
    p2 = counted(lm2.scorer)
    assert lm2.loglikelihood(reqs) == first and p2[0] == 0  # logprobe's cache answered


def test_the_server_answers_from_the_cache(tiny, tmp_path):
    """`logprobe serve --cache DIR`: the batcher's engine thread runs the cached executor; a repeat
    runs no forward pass, /metrics still reads the engine through it."""
    import requests
    from server_util import serve

    from logprobe.server import ServerConfig, create_app

    _, _, loaded = tiny
    s = Scorer(loaded, progress=False, cache=str(tmp_path))
    passes = counted(s)
    seqs = random_sequences(3, seed=7)
    body = {"sequences": [{"prompt_token_ids": q["prompt_token_ids"], "completion_token_ids": q["completion_token_ids"]}
                          for q in seqs], "top_k": 2}
    with serve(create_app(s, ServerConfig())) as url:
        first = requests.post(url + "/v1/logprobs", json=body, timeout=60)
        assert first.status_code == 200, first.text
        n = passes[0]
        again = requests.post(url + "/v1/logprobs", json=body, timeout=60)
        assert again.status_code == 200 and passes[0] == n > 0
        assert again.json()["results"] == first.json()["results"]
        assert requests.get(url + "/metrics", timeout=60).status_code == 200


def test_capture_runs_every_time_and_stores_nothing(tiny, tmp_path):
    _, _, loaded = tiny
    s = Scorer(loaded, progress=False, cache=str(tmp_path))
    passes = counted(s)
    spec = [{"at": "blocks.0.resid_post", "positions": "last"}]
    a = s.score("hello", [" world"], capture=spec)
    n = passes[0]
    b = s.score("hello", [" world"], capture=spec)
    assert n > 0 and passes[0] == 2 * n and a[0].log_prob == b[0].log_prob
    assert s.engine.cache.stats()["entries"] == 0


def test_worker_held_weights_key_by_files_and_stop_caching_after_an_update(tiny):
    """A parallel scorer's weights live in worker processes: the key comes from the checkpoint's
    files; after an update (nothing here to hash) no key, so every request runs."""
    from logprobe.config import EngineConfig
    from logprobe.executor.cached import ModelIdentity

    a, b, loaded = tiny
    version = [0]
    ident = ModelIdentity(loaded, False, lambda: version[0], tensor_parallel_size=2)
    key, desc = ident.key(EngineConfig())
    assert desc["weights"].startswith("f:") and desc["tensor_parallel_size"] == 2
    assert ident.key(EngineConfig()) == (key, desc)
    version[0] = 1
    assert ident.key(EngineConfig()) is None
    in_proc = ModelIdentity(loaded, True, lambda: 0)
    assert in_proc.key(EngineConfig())[1]["weights"].startswith("w:")
