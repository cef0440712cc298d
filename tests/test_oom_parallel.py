"""Out of memory across the ranks of a replica (``Engine._preflight``, ``executor.workers.FitsAgreement``):
gloo worker processes on CPU, the fault put on one rank only through the workers' test seam
``LOGPROBE_TEST_OOM=RANK:WHERE:ROWS`` (``executor.workers._test_fault``, read by the worker alone).

* "before": rank 1's pre-flight says no to passes of more than ROWS rows. The ranks agree before
  every pass, so both split and retry the same way: the results are the bits of a run without the
  fault (deterministic mode), and the driver's ``oom_count`` counts the agreed errors. Without the
  agreement rank 1 alone re-plans while rank 0 goes into the pass's collectives: gloo aborts on
  the mismatched sizes, or the run hangs (each test here runs under a deadline, and fails instead).
  Under torchrun the engines are in-process and the test sets rank 1's ``fault_hook`` itself.
* "inside": rank 1 runs out mid-pass (at the final norm), after the ranks agreed. That cannot be
  agreed: the run fails within seconds with an error naming the rank and ``max_batch_tokens``,
  the replica is stopped (no process left behind) and the Scorer is closed for scoring (a
  further call says a worker died and to create a new Scorer).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from helpers import make_hf_dir, random_sequences

from logprobe import LogprobeError, Scorer
from logprobe.executor.workers import TEST_OOM_ENV

FIELDS = ("logprobs", "ranks", "entropy", "topk_ids", "topk_logprobs")
OPTS = dict(top_k=3, entropy=True)
DEADLINE_S = 120.0  # a run that desynchronised waits for gloo's 30-minute timeout: fail long before


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("oom_tp") / "llama"
    make_hf_dir(path, "llama")
    return str(path)


def _seqs() -> list[dict]:
    """Short sequences, two sharing a 40-token prompt, and a long one (chunked at budget 256)."""
    shared = list(range(3, 43))
    return random_sequences(8, seed=5) + [
        {"prompt_token_ids": shared, "completion_token_ids": [9, 10, 11]},
        {"prompt_token_ids": shared, "completion_token_ids": [12, 13]},
        {"prompt_token_ids": list(range(2, 300)), "completion_token_ids": list(range(40, 120))}]


def _bits_equal(a, b) -> bool:
    def eq(u, v):
        return (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))

    return len(a) == len(b) and all(eq(getattr(x, f), getattr(y, f)) for x, y in zip(a, b) for f in FIELDS)


def _children() -> set[int]:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return {int(x) for x in f.read().split()}


def _within(scorer: Scorer, seconds: float, fn):
    """``fn()``'s value or exception, or a failure once ``seconds`` have passed (the scorer is then
    closed, which ends its workers and the call blocked on them)."""
    box: dict = {}

    def call():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        scorer.close()
        t.join(30)
        pytest.fail(f"no answer within {seconds:.0f} s: the ranks desynchronised")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _scored(path: str, fault: str | None, monkeypatch, **kw) -> tuple[list, int, int]:
    """(results, oom_count, passes) of ``_seqs()`` on a TP = 2 Scorer whose rank 1 has ``fault``."""
    if fault is None:
        monkeypatch.delenv(TEST_OOM_ENV, raising=False)
    else:
        monkeypatch.setenv(TEST_OOM_ENV, fault)  # read by the workers as they start
    with Scorer(path, device="cpu", dtype="float32", tensor_parallel_size=2, deterministic=True,
                progress=False, **kw) as s:
        assert s.attention_parallel == kw.get("attention_parallel", s.attention_parallel)
        got = _within(s, DEADLINE_S, lambda: s.logprobs(_seqs(), **OPTS))
        return got, s.engine.oom_count, s.engine.passes


def _engine(llama, agree=None, deterministic: bool = True):
    from logprobe.config import EngineConfig
    from logprobe.engine.runner import Engine
    from logprobe.loading import load_model

    engine = Engine(load_model(llama, "cpu", "float32").model,
                    EngineConfig(max_batch_tokens=256, deterministic=deterministic), torch.device("cpu"))
    engine.agree_fits = agree
    return engine


def _requests():
    from logprobe.engine.request import ScoreRequest

    return [ScoreRequest(q["prompt_token_ids"] + q["completion_token_ids"], len(q["prompt_token_ids"]), top_k=3,
                         entropy=True) for q in _seqs()]


def test_engine_splits_when_another_rank_says_no(llama):
    """The engine's side of the agreement, in one process: ``agree_fits`` answers no for the first
    three passes (another rank had no room): the engine splits and retries as for its own
    out-of-memory (``oom_count`` 3, more passes), the same bits as a run that never ran out."""
    want = _engine(llama).run(_requests())
    answers, asked = iter([False, False, False]), []

    def agree(fits: bool) -> bool:
        asked.append(fits)
        return fits and next(answers, True)

    engine = _engine(llama, agree)
    got = engine.run(_requests())
    assert engine.oom_count == 3 and all(asked)  # this rank always fit: the others said no
    assert len(asked) == engine.passes + 3  # asked before every pass, the refused ones included
    assert _bits_equal(got, want)


@pytest.mark.slow  # slow tier (pytest -m slow): ~3.5 s
def test_engine_raises_an_out_of_memory_inside_a_pass_it_cannot_agree(llama):
    """With ``agree_fits`` set (a replica), an out-of-memory inside a pass (the final norm here),
    after the ranks agreed, is raised, not split around: the other ranks are inside the pass's
    collectives. In one process (no agreement) the same fault is split around, as before."""
    def norm_fault(module, args):
        if args[0].shape[0] > 100:
            raise torch.OutOfMemoryError("inside")

    alone = _engine(llama)
    alone.model.norm.register_forward_pre_hook(norm_fault)
    assert all(r is not None for r in alone.run(_requests())) and alone.oom_count > 0
    replica = _engine(llama, agree=lambda fits: fits)
    replica.model.norm.register_forward_pre_hook(norm_fault)
    with pytest.raises(torch.OutOfMemoryError, match="inside"):
        replica.run(_requests())
    assert replica.oom_count == 0


@pytest.mark.slow  # slow tier (pytest -m slow): two gloo workers twice, ~7 s
def test_oom_on_one_rank_splits_every_rank_the_same_way(llama, monkeypatch):
    """Rank 1 has no room for passes over 100 rows, rank 0 has: both split and retry, the bits of
    a TP = 2 run without the fault, the agreed errors counted once by the driver."""
    want, ooms, passes = _scored(llama, None, monkeypatch, max_batch_tokens=256)
    assert ooms == 0
    got, ooms_fault, passes_fault = _scored(llama, "1:before:100", monkeypatch, max_batch_tokens=256)
    assert ooms_fault > 0 and passes_fault > passes  # split: more, smaller passes
    assert _bits_equal(got, want)


@pytest.mark.slow  # slow tier (pytest -m slow): a MoE Scorer of two gloo workers (~15 s)
def test_oom_on_one_rank_under_data_parallel_attention(monkeypatch, tmp_path_factory):
    """A Qwen3-MoE at TP = EP = 2 with data-parallel attention (the ranks run different rows of
    each pass): rank 1 has no room for passes over 64 rows; both ranks split, and the bits are
    one process's (which a TP = 2 run without the fault gives: test_data_attention)."""
    import transformers
    from test_data_attention import _qwen3_moe_config, _save

    path = tmp_path_factory.mktemp("oom_moe") / "qwen3_moe"
    torch.manual_seed(0)
    _save(transformers.AutoModelForCausalLM.from_config(_qwen3_moe_config(), attn_implementation="eager",
                                                        experts_implementation="eager"), path, seed=7)
    want = Scorer(str(path), device="cpu", dtype="float32", deterministic=True, progress=False,
                  max_batch_tokens=512).logprobs(_seqs(), **OPTS)
    got, ooms, _ = _scored(str(path), "1:before:64", monkeypatch, max_batch_tokens=512, attention_parallel="data")
    assert ooms > 0
    assert _bits_equal(got, want)


TORCHRUN_SCRIPT = """
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
from logprobe import Scorer
s = Scorer(sys.argv[1], device="cpu", dtype="float32", deterministic=True, tensor_parallel_size=2,
           max_batch_tokens=256, progress=False)
def fault(rows, tokens):  # rank 1 has no room for passes over 100 rows
    if rows > 100:
        raise torch.OutOfMemoryError(f"injected: {rows} rows")
if dist.get_rank() == 1:
    s.engine.fault_hook = fault
out = s.logprobs(json.loads(open(sys.argv[2]).read()), top_k=3, entropy=True)
torch.save(dict(out=out, ooms=s.engine.oom_count), sys.argv[3] + f"/rank{dist.get_rank()}.pt")
s.close()  # before the group goes
dist.destroy_process_group()
# skip C++ teardown, as tests/test_tensor_parallel.py's scripts do: under load a thread destroyed at
# interpreter exit (after this point, the numbers saved) aborted a rank ("terminate called without
# an active exception")
os._exit(0)
"""


@pytest.mark.slow  # slow tier (pytest -m slow): torchrun
def test_oom_on_one_rank_under_torchrun(llama, tmp_path):
    """Under torchrun (each process one rank, its engine in-process) the ranks agree as the
    workers do: rank 1 alone has no room for passes over 100 rows, both split, every rank returns
    one process's bits and counts the same out-of-memory errors."""
    import json
    import subprocess
    import sys

    from server_util import free_port

    (tmp_path / "seqs.json").write_text(json.dumps(_seqs()))
    (tmp_path / "run.py").write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != TEST_OOM_ENV}
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), str(tmp_path / "run.py"), llama,
                        str(tmp_path / "seqs.json"), str(tmp_path)],
                       capture_output=True, text=True, timeout=DEADLINE_S, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    want = Scorer(llama, device="cpu", dtype="float32", deterministic=True, progress=False).logprobs(_seqs(), **OPTS)
    got = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert got[0]["ooms"] == got[1]["ooms"] > 0
    assert _bits_equal(got[0]["out"], want) and _bits_equal(got[1]["out"], want)


@pytest.mark.slow  # slow tier (pytest -m slow): stops a replica
def test_oom_inside_a_pass_stops_the_replica_naming_the_rank(llama, monkeypatch):
    """Rank 1 runs out mid-pass: an error naming rank 1 and max_batch_tokens within seconds, both
    workers gone, and the Scorer closed for scoring (a further call says so)."""
    before = _children()
    monkeypatch.setenv(TEST_OOM_ENV, "1:inside:50")
    s = Scorer(llama, device="cpu", dtype="float32", tensor_parallel_size=2, progress=False, max_batch_tokens=256)
    workers = {p.pid for p in s.engine.groups[0].procs}
    t0 = time.monotonic()
    with pytest.raises(LogprobeError, match=r"max_batch_tokens: rank 1 ran out of memory inside a forward pass"
                                            r".*replica 0 was stopped; lower max_batch_tokens") as e:
        _within(s, DEADLINE_S, lambda: s.logprobs(_seqs()))
    took = time.monotonic() - t0
    assert took < 10, took
    assert "rows)" in str(e.value)  # the injected error's own line is quoted
    assert not workers & _children()  # stopped and reaped: no process left behind
    with pytest.raises(LogprobeError, match="has died.*create a new Scorer"):
        s.logprobs(_seqs()[:1])
    s.close()
    assert _children() <= before
