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


# --- deterministic mode: one pinned configuration per kernel, never a timed one -----------------

def _configs():
    import triton

    return [triton.Config({"BK": 128, "BV": 128}, num_warps=8, num_stages=3),
            triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=3),
            triton.Config({"BK": 32, "BV": 32}, num_warps=2, num_stages=3)]


OUT_KERNEL = "fla.ops.common.chunk_o.chunk_fwd_kernel_o"
KEY = (16, 32, 128, 128, 64, False, "torch.bfloat16")


@pytest.mark.parametrize("kernel,offered,pinned", [
    (OUT_KERNEL, [0, 1, 2], {"kwargs": {"BK": 64, "BV": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1}),  # PINS
    (OUT_KERNEL, [2, 0], {"kwargs": {"BK": 32, "BV": 32}, "num_warps": 2, "num_stages": 3, "num_ctas": 1}),  # not offered: first
    ("fla.ops.other.kernel", [1, 2], {"kwargs": {"BK": 64, "BV": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1}),
])
def test_pinned_config_gold(kernel, offered, pinned):
    """The pure rule: the kernel's PINS record where offered, else its first configuration; and the
    cache of a bound autotuner answers it for any key while pinned, whatever it holds."""
    from types import SimpleNamespace

    from logprobe.kernels.tuning import bind_pins, config_record, pinned_config
    from logprobe.kernels.tuning import pinned as pinned_mode

    configs = [_configs()[i] for i in offered]
    assert config_record(pinned_config(kernel, configs)) == pinned
    tuner = SimpleNamespace(configs=configs, cache={KEY: configs[-1]})  # a table's or a timing's choice
    assert bind_pins({kernel: tuner}) == 1 and bind_pins({kernel: tuner}) == 0
    with pinned_mode():
        assert KEY in tuner.cache and (1, "other key") in tuner.cache
        assert config_record(tuner.cache[KEY]) == pinned and config_record(tuner.cache[(1,)]) == pinned
        with pinned_mode(False):  # default mode inside: the entries as they are
            assert tuner.cache[KEY] is configs[-1] and (1,) not in tuner.cache
    assert tuner.cache[KEY] is configs[-1] and (1,) not in tuner.cache and dict(tuner.cache) == {KEY: configs[-1]}


def test_pins_are_the_shipped_h200_choices():
    """PINS is the H200 table's choice for each kernel it holds (so an H200 runs deterministic mode
    at the tuned speed at those shapes), and covers every fla kernel the table holds."""
    from logprobe.kernels.tuning import PINS, SHIPPED

    (path,) = SHIPPED.glob("NVIDIA_H200-*.json")
    kernels = json.loads(path.read_text())["kernels"]
    assert sorted(PINS) == sorted(kernels)
    for name, entries in kernels.items():
        assert list(entries.values()) == [PINS[name]], name


SUM_KERNEL = '''
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BK": 16}, num_warps=1), triton.Config({"BK": 64}, num_warps=1)], key=["n"])
@triton.jit
def total(x_ptr, y_ptr, n, BK: tl.constexpr):
    acc = tl.zeros([BK], dtype=tl.float32)  # BK partial sums: BK splits the reduction
    for i in range(0, n, BK):
        offs = i + tl.arange(0, BK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr, tl.sum(acc, axis=0))
'''

# One process: a table (argv[1]) names BK = 64 for the key; the kernel's timing is replaced by one
# preferring ``prefer``. Each case empties the autotuner's cache first (a fresh process) or not.
SUM_CHILD = '''
import json, sys
from pathlib import Path
import torch
import sumk
from logprobe.kernels.tuning import KernelTuning
t = KernelTuning("Test GPU", None, packages=("sumk",), shipped=Path(sys.argv[1])).start()
x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1000
prefer, timed = [0], []
def bench(*args, config, **kwargs):
    timed.append(config.kwargs["BK"])
    return [1.0 if config.kwargs["BK"] == prefer[0] else 2.0]
sumk.total._bench = bench
def bits(fn, **kw):
    y = torch.zeros(1)
    fn[(1,)](x, y, 1000, **kw)
    return y.view(torch.int32).item()
def case(deterministic, fresh, best):
    if fresh:
        dict.clear(sumk.total.cache)
    prefer[0] = best
    timed.clear()
    with t.mode(deterministic):
        out = bits(sumk.total)
    return {"bits": out, "timed": list(timed)}
out = {"bk16": bits(sumk.total.fn, BK=16), "bk64": bits(sumk.total.fn, BK=64), "seeded": t.seeded}
out["det_table"] = case(True, False, 64)
out["default_table"] = case(False, False, 64)
out["det_fresh64"] = case(True, True, 64)
out["det_fresh16"] = case(True, True, 16)
out["added_det"] = t.after_run()
out["default_fresh64"] = case(False, True, 64)
out["det_after_tuning"] = case(True, False, 16)
out["default_fresh16"] = case(False, True, 16)
out["added_default"] = t.after_run()
print(json.dumps(out))
'''


def test_deterministic_mode_pins_a_reduction_split(tmp_path):
    """A kernel whose two configurations split a sum differently (other bits): in deterministic mode
    it gives the pinned configuration's bits (the first: not in PINS), times nothing and records
    nothing, whether a table names the other, the timing prefers either, or a default-mode run tuned
    the key; in default mode the table and the timing choose as before."""
    (tmp_path / "sumk.py").write_text(SUM_KERNEL)
    shipped = tmp_path / "shipped"
    write_table(shipped / "t.json", TuningTable({"device": "Test GPU", "triton": __import__("triton").__version__,
                                                 "fla": _fla_version()},
                                                {"sumk.total": {'[1000, "torch.float32", "torch.float32"]': {
                                                    "kwargs": {"BK": 64}, "num_warps": 1, "num_stages": 3,
                                                    "num_ctas": 1}}}))
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); sys.argv = ['x', {str(shipped)!r}]\n"
    proc = run_interpreted(code + textwrap.dedent(SUM_CHILD))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    bk16, bk64 = got["bk16"], got["bk64"]
    assert bk16 != bk64 and got["seeded"] == 1  # the split changes the bits
    for name in ("det_table", "det_fresh64", "det_fresh16", "det_after_tuning"):
        assert got[name] == {"bits": bk16, "timed": []}, name
    assert got["added_det"] == 0  # the pin is never recorded as a choice
    assert got["default_table"] == {"bits": bk64, "timed": []}  # the table's choice
    assert got["default_fresh64"] == {"bits": bk64, "timed": [16, 64]}
    assert got["default_fresh16"] == {"bits": bk16, "timed": [16, 64]}
    assert got["added_default"] == 1  # the key re-tuned to BK = 16 (the table said 64)


def _fla_version():
    from logprobe.kernels.tuning import identity_of

    return identity_of("x")["fla"]
