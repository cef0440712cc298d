"""Autotuned kernels' choices kept in tables (``kernels.tuning``): the table format pinned by a
literal example, the cache file read, written atomically and ignored when stale or corrupt (a
warning and a re-tune, never a crash), and, through Triton's own ``Autotuner.run`` on its CPU
interpreter, a second process that finds the first one's choice and does not tune again."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from helpers import run_interpreted

from logprobe.kernels.tuning import (
    TuningTable,
    cache_file,
    key_from_text,
    key_text,
    read_table,
    shipped_table,
    write_table,
)

pytest.importorskip("triton")
ID = {"device": "NVIDIA H200", "triton": "3.6.0", "fla": "0.6.0"}
REC = {"kwargs": {"BV": 64}, "num_warps": 4, "num_stages": 2, "num_ctas": 1}


@pytest.mark.parametrize("key,text", [
    ((4, 128, 128, 64, True, "torch.bfloat16"), '[4, 128, 128, 64, true, "torch.bfloat16"]'),
    ((None, 1.5, (2, 3)), "[null, 1.5, [2, 3]]"),
    ((), "[]"),
])
def test_key_text_gold(key, text):
    assert key_text(key) == text and key_from_text(text) == key


def test_key_text_refuses_what_json_cannot_give_back():
    assert key_text((4, object())) is None and key_text(([1],)) is None


def test_cache_file_name_gold(tmp_path):
    assert cache_file(tmp_path, ID).name == "NVIDIA_H200-triton3.6.0-fla0.6.0.json"
    assert cache_file(tmp_path, {**ID, "fla": None}).name == "NVIDIA_H200-triton3.6.0-flaNone.json"


def test_table_file_round_trip_and_atomic_write(tmp_path):
    t = TuningTable(ID)
    assert t.put("fla.k", "[1]", REC) and not t.put("fla.k", "[1]", {"kwargs": {}})
    path = tmp_path / "sub" / "t.json"
    write_table(path, t)
    assert read_table(path, ID).kernels == {"fla.k": {"[1]": REC}}
    assert os.listdir(path.parent) == ["t.json"]  # no temporary file left
    bad = TuningTable(ID, {"fla.k": {"[2]": {"kwargs": {"x": object()}}}})  # cannot be written
    with pytest.raises(TypeError):
        write_table(path, bad)
    assert read_table(path, ID).kernels == {"fla.k": {"[1]": REC}}  # the old file, whole
    assert os.listdir(path.parent) == ["t.json"]


def test_stale_tables_are_ignored_quietly(tmp_path, recwarn):
    path = tmp_path / "t.json"
    write_table(path, TuningTable(ID, {"fla.k": {"[1]": REC}}))
    for other in ({**ID, "device": "NVIDIA H100 80GB HBM3"}, {**ID, "triton": "3.7.0"}, {**ID, "fla": "0.7.0"}):
        assert read_table(path, other) is None
    assert read_table(tmp_path / "missing.json", ID) is None
    assert not recwarn.list


@pytest.mark.parametrize("text", [
    "", "{", "not json", "[]", json.dumps({"format": 99, "identity": ID, "kernels": {}}),
    json.dumps({"format": 1, "identity": ID}), json.dumps({"format": 1, "identity": ID, "kernels": {"k": []}}),
    json.dumps({"format": 1, "identity": ID, "kernels": {"k": {"not json": REC}}}),
    json.dumps({"format": 1, "identity": ID, "kernels": {"k": {"[1]": {"num_warps": 4}}}}),
])
def test_corrupt_cache_is_a_warning(tmp_path, text):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.warns(UserWarning, match="corrupt.*tuned again"):
        assert read_table(path, ID) is None


def test_shipped_tables_of_this_identity_only(tmp_path):
    write_table(tmp_path / "a.json", TuningTable(ID, {"fla.k": {"[1]": REC}}))
    write_table(tmp_path / "b.json", TuningTable({**ID, "device": "other"}, {"fla.k": {"[2]": REC}}))
    assert shipped_table(ID, tmp_path).kernels == {"fla.k": {"[1]": REC}}
    assert len(shipped_table(ID, tmp_path / "none")) == 0


def test_every_shipped_table_is_readable():
    """The tables in the package parse, and each is of one identity."""
    from logprobe.kernels.tuning import SHIPPED

    for path in SHIPPED.glob("*.json"):
        data = json.loads(path.read_text())
        assert read_table(path, data["identity"]) is not None, path.name


KERNEL = '''
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"B": 16}, num_warps=1), triton.Config({"B": 32}, num_warps=2),
                          triton.Config({"B": 64}, num_warps=4)], key=["n"])
@triton.jit
def double(x_ptr, y_ptr, n, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)
'''

# One process: binds the tables (cache in argv[1]), runs the kernel at two sizes through Triton's
# Autotuner (its timing replaced by a fixed one preferring B = 32: there is no GPU to time), and
# prints how many configurations it timed and which it chose.
CHILD = '''
import json, sys, warnings
warnings.simplefilter("always")
import torch, triton
import tunedk
from logprobe.kernels.tuning import KernelTuning
t = KernelTuning("Test GPU", __import__("pathlib").Path(sys.argv[1]), packages=("tunedk",), shipped=__import__("pathlib").Path(sys.argv[2])).start()
timed = []
def bench(*args, config, **kwargs):
    timed.append(config.kwargs["B"])
    return [1.0 if config.kwargs["B"] == 32 else 2.0]
tunedk.double._bench = bench
for n in (100, 1000):
    x = torch.arange(n, dtype=torch.float32); y = torch.empty_like(x)
    tunedk.double[lambda m: (triton.cdiv(n, m["B"]),)](x, y, n)
    assert torch.equal(y, 2 * x)
added = t.after_run()
print(json.dumps({"timed": timed, "chosen": tunedk.double.best_config.kwargs["B"], "seeded": t.seeded,
                  "added": added, "cached": t.cached, "shipped": t.shipped}))
'''


def _run(tmp_path, cache, shipped):
    (tmp_path / "tunedk.py").write_text(KERNEL)
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); sys.argv = ['x', {str(cache)!r}, {str(shipped)!r}]\n"
    proc = run_interpreted(code + textwrap.dedent(CHILD))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.slow  # three interpreted processes (the slow tier: pytest -m slow)
def test_second_process_does_not_tune_again(tmp_path):
    cache, shipped = tmp_path / "cache", tmp_path / "shipped"
    first, _ = _run(tmp_path, cache, shipped)
    assert first["timed"] == [16, 32, 64, 16, 32, 64] and first["chosen"] == 32  # two keys, each timed
    assert first["added"] == 2 and first["seeded"] == 0
    (path,) = cache.glob("*.json")
    entries = json.loads(path.read_text())["kernels"]["tunedk.double"]
    assert sorted(entries) == ["[100, \"torch.float32\", \"torch.float32\"]",
                               "[1000, \"torch.float32\", \"torch.float32\"]"]
    second, _ = _run(tmp_path, cache, shipped)
    assert second == {"timed": [], "chosen": 32, "seeded": 2, "added": 0, "cached": 2, "shipped": 0}
    # a corrupt cache: a warning, the kernel tuned again, the file rewritten whole
    path.write_text(path.read_text()[:40])
    third, err = _run(tmp_path, cache, shipped)
    assert "corrupt" in err and third["timed"] == [16, 32, 64, 16, 32, 64] and third["added"] == 2
    assert len(json.loads(path.read_text())["kernels"]["tunedk.double"]) == 2


@pytest.mark.slow  # two interpreted processes (the slow tier: pytest -m slow)
def test_shipped_table_spares_the_first_process(tmp_path):
    """A shipped table of the process's identity seeds it; a choice whose configuration the kernel
    no longer offers (B = 128) is ignored and that key is tuned."""
    cache, shipped = tmp_path / "cache", tmp_path / "shipped"
    first, _ = _run(tmp_path, cache, shipped)  # makes the cache: move it to be the shipped table
    shipped.mkdir()
    (path,) = cache.glob("*.json")
    data = json.loads(path.read_text())
    data["kernels"]["tunedk.double"]["[1000, \"torch.float32\", \"torch.float32\"]"] = {
        "kwargs": {"B": 128}, "num_warps": 4, "num_stages": 3, "num_ctas": 1}
    (shipped / "t.json").write_text(json.dumps(data))
    path.unlink()
    got, _ = _run(tmp_path, cache, shipped)
    assert got["timed"] == [16, 32, 64] and got["seeded"] == 1 and got["shipped"] == 2
    assert got["added"] == 1  # the re-tuned key (the seeded one was already in the table)
