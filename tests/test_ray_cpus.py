"""``logprobe.ray.map_batches``: actors that would take every CPU of the cluster are refused before
anything starts (Ray Data starts the actors first; its read tasks would wait behind them forever),
with the fix on one line; with room left the same call runs and gives the library's numbers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from logprobe.errors import LogprobeError
from logprobe.integrations.ray import check_cpus


@pytest.mark.parametrize("cpus, replicas, per, fix", [
    (2, 2, 1, "use num_cpus=0.5 (a reservation only: the Scorer's threads do not change) or concurrency=1"),
    (2, 1, 2, "use num_cpus=1 (a reservation only: the Scorer's threads do not change)"),
    (8, 3, 3, "num_cpus=2.33 (a reservation only: the Scorer's threads do not change) or concurrency=2"),
    (1, 1, 1, "give the cluster more than 1 CPU"),
    (2, 3, 0.5, "num_cpus=0.33"),  # 1.5 of 2 leaves half a CPU: still not a read task's whole one
])
def test_actors_that_take_every_cpu_are_refused(cpus, replicas, per, fix):
    with pytest.raises(LogprobeError) as e:
        check_cpus(cpus, replicas, per)
    msg = str(e.value)
    assert e.value.field == "num_cpus" and "\n" not in msg and fix in msg, msg
    assert msg.startswith(f"num_cpus: concurrency × num_cpus = {replicas} × {per:g} = {replicas * per:g} of the "
                          f"cluster's {cpus:g} CPUs leaves")


@pytest.mark.parametrize("cpus, replicas, per", [(2, 2, 0.5), (2, 1, 1), (16, 8, 1), (2, 4, 0.25)])
def test_actors_that_leave_a_cpu_pass(cpus, replicas, per):
    check_cpus(cpus, replicas, per)


SCRIPT = textwrap.dedent("""
    import json, sys, time
    import ray
    import logprobe.ray
    from logprobe import Scorer
    from logprobe.errors import LogprobeError

    model, src = sys.argv[1], sys.argv[2]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    kw = {"fn_constructor_kwargs": {"model": model, "device": "cpu", "dtype": "float32", "deterministic": True},
          "batch_size": 2}
    t = time.perf_counter()
    try:  # the documented call that used to sit at "ListFiles 0/1" forever
        logprobe.ray.map_batches(ray.data.read_json(src), logprobe.ray.Logprobs, concurrency=2, num_cpus=1, **kw)
        refused = None
    except LogprobeError as e:
        refused = str(e)
    refused_s = time.perf_counter() - t
    out = logprobe.ray.map_batches(ray.data.read_json(src), logprobe.ray.Logprobs, concurrency=2, num_cpus=0.5, **kw)
    rows = sorted(out.take_all(), key=lambda r: r["id"])
    want = Scorer(model, device="cpu", dtype="float32", progress=False, deterministic=True).logprobs(
        [{k: r[k] for k in ("prompt_token_ids", "completion_token_ids")} for r in rows])
    same = all(list(r["logprobs"]) == w.logprobs.tolist() and r["error"] is None for r, w in zip(rows, want))
    print(json.dumps({"refused": refused, "refused_s": refused_s, "rows": len(rows), "same": same}))
""")


@pytest.mark.slow
def test_two_cpu_cluster_refuses_then_runs(tmp_path):
    """A real ``ray.init(num_cpus=2)`` and a JSONL file read by Ray Data (its ListFiles and read
    tasks need a CPU): concurrency=2 × num_cpus=1 is refused at once; num_cpus=0.5 runs to the end
    with the library's bits. A separate process, so that a hang fails the test."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'logprobe[ray]')")
    from helpers import make_hf_dir, random_sequences

    make_hf_dir(tmp_path / "tiny", "llama", seed=3)
    rows = [dict(s, id=f"s{i}") for i, s in enumerate(random_sequences(6, seed=8))]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "tiny"), str(src)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["refused"] is not None and "leaves 0 for reading" in got["refused"], got
    assert "use num_cpus=0.5" in got["refused"] and got["refused_s"] < 30, got
    assert got["rows"] == 6 and got["same"], got
