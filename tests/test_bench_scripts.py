"""The benchmark scripts still start, on a machine with no GPU: they run on the GPU machine, which CI
never sees, so this catches a renamed import or option before a device session does.

* every ``bench/*.py`` with an argument parser answers ``--help`` (imports resolve, options parse);
* every command written down for them (``bench/gpu_round.sh``, ``bench/README.md``, the scripts'
  own docstrings) parses with the script's real parser (nothing else of the script runs);
* ``bench/`` imports nothing private from logprobe and no bench script imports another: shared
  code lives in ``bench/common.py``;
* the workloads W1-W4 and the FLOP counts of ``common.py`` are pinned (the numbers in docs/perf.md
  were taken on these exact requests);
* the CPU-capable parts of ``common.py`` (a saved tiny model, the transformers baseline) agree with
  logprobe; ``slow``: the scripts that have a tiny CPU run do it (gpu_first_call.py,
  gpu_moe_parallel.py over gloo, gpu_families.py, gpu_hybrid.py, gpu_weight_sync.py, gpu_vlm.py).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "argparse" in p.read_text(encoding="utf-8"))
MODULES = {p.stem for p in BENCH.glob("*.py")}


def run(args, timeout=180, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=BENCH, **kw)


def test_scripts_found():
    names = {p.name for p in SCRIPTS}
    assert "common.py" not in names
    assert {"gpu_first_call.py", "gpu_workloads.py", "gpu_tp.py", "gpu_families.py", "gpu_hybrid.py",
            "gpu_moe_parallel.py", "gpu_weight_sync.py", "cpu_perplexity.py", "server_load.py"} <= names


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_imports_are_public_and_only_common(script):
    """No ``_private`` name of logprobe, no module of logprobe reached by a private path, and of
    bench/ only ``common``."""
    bad = []
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [a.name for a in node.names]
            if node.module.split(".")[0] == "logprobe":
                bad += [f"{node.module}.{n}" for n in names if n.startswith("_")]
                bad += [node.module] if any(p.startswith("_") for p in node.module.split(".")) else []
            elif node.module in MODULES and node.module != "common":
                bad.append(f"bench/{node.module}.py")
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "logprobe" and any(p.startswith("_") for p in parts):
                    bad.append(a.name)
                elif parts[0] in MODULES and parts[0] != "common":
                    bad.append(f"bench/{parts[0]}.py")
    assert not bad, f"{script.name} imports {bad}"


def documented_commands() -> dict[str, list[tuple[str, list[str]]]]:
    """Per script: (where, arguments) of every ``bench/X.py ...`` command in gpu_round.sh,
    README.md and the scripts' docstrings (usage synopses with ``[--flag N]`` left out)."""
    cmds: dict[str, list[tuple[str, list[str]]]] = {}
    round_sh = (BENCH / "gpu_round.sh").read_text(encoding="utf-8").replace("\\\n", " ")
    found = []
    for m in re.finditer(r'"\$py" bench/(\w+\.py)([^;\n]*);;', round_sh):
        args = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", m.group(2))  # ${MOE_ARGS:---sections ...}: the default
        found.append(("gpu_round.sh", m.group(1), args))
    texts = [("README.md", (BENCH / "README.md").read_text(encoding="utf-8"))]
    for p in SCRIPTS:
        texts.append((p.name, ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or ""))
    for where, text in texts:
        for m in re.finditer(r"python3? bench/(\w+\.py)([^\n`#]*)", text.replace("\\\n", " ")):
            if "[" not in m.group(2):
                found.append((where, m.group(1), m.group(2)))
    for where, script, args in found:
        cmds.setdefault(script, []).append((where, shlex.split(args)))
    return cmds


# In one process: each script's --help, then each documented command through the script's own
# parser with parse_args stopped right after parsing (nothing else of the script runs).
CHECK = """
import argparse, contextlib, io, json, runpy, sys, traceback
jobs, results = json.loads(sys.argv[1]), {}
parse = argparse.ArgumentParser.parse_args
def parse_only(self, args=None, namespace=None):
    parse(self, args, namespace)
    sys.exit(0)
for script, arg_lists in jobs.items():
    out = []
    for i, args in enumerate(arg_lists):
        argparse.ArgumentParser.parse_args = parse if i == 0 else parse_only
        sys.argv, so, se = [script, *args], io.StringIO(), io.StringIO()
        code = 3  # the script ended without parsing its arguments
        try:
            with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
                runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            se.write(traceback.format_exc())
            code = 4
        out.append([code, so.getvalue()[:2000], se.getvalue()[-3000:]])
    results[script] = out
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def parsed():
    """{script: [(exit code, stdout, stderr) of --help, then of each documented command]}."""
    cmds = documented_commands()
    jobs = {p.name: [["--help"]] + [args for _, args in cmds.get(p.name, [])] for p in SCRIPTS}
    out = run(["-c", CHECK, json.dumps(jobs)], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help(parsed, script):
    code, stdout, stderr = parsed[script.name][0]
    assert code == 0, stderr
    assert "usage:" in stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_documented_commands_parse(parsed, script):
    cmds = documented_commands()
    assert all((BENCH / s).exists() for s in cmds), f"commands name missing scripts: {set(cmds) - set(parsed)}"
    for (where, args), (code, _, stderr) in zip(cmds.get(script.name, []), parsed[script.name][1:]):
        assert code == 0, f"{where}: {script.name} {shlex.join(args)}\n{stderr}"


def test_round_script_is_valid_shell():
    out = subprocess.run(["bash", "-n", str(BENCH / "gpu_round.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------------------------- common.py


@pytest.fixture(scope="module")
def common():
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    return common


# (requests, input tokens, scored tokens, sha256 of [(tokens, score_begin)] at vocab 128,256)
PINNED = {"W1": (256, 480120, 173640, "fc90bcc930b8e4a8"), "W2": (2048, 1294293, 32569, "ffd051f882dec5ae"),
          "W3": (509, 1041923, 262143, "37b5356d9bd695fa"), "W4": (2, 163840, 163840, "5a2fb704df25b99d")}
# (all needed tokens, unique tokens) FLOPs of W1 and W3 per model shape
FLOPS = {("llama-8b", "W1"): (7189350782599168.0, 3347800007376896.0),
         ("llama-8b", "W3"): (1.5378363561803776e16, 1.5378363561803776e16),
         ("llama-1b", "W1"): (1101880338153472.0, 555759822569472.0),
         ("smollm2-135m", "W3"): (309791913437952.0, 309791913437952.0)}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_workloads_are_pinned(common, name):
    reqs = common.workload(name, 128256)
    digest = hashlib.sha256(repr([(r.tokens, r.score_begin) for r in reqs]).encode()).hexdigest()[:16]
    assert (len(reqs), sum(r.num_inputs for r in reqs), sum(r.num_scored for r in reqs), digest) == PINNED[name]


def test_flops_are_pinned(common):
    import transformers as tf

    from logprobe.loading.hf import native_config

    for (model, name), want in FLOPS.items():
        lc, _ = native_config(tf.LlamaConfig(**common.MODELS[model]).to_dict())
        reqs = common.workload(name, lc.vocab_size)
        got = (common.flops(lc, [(r.num_inputs, r.num_scored) for r in reqs]), common.unique_flops(lc, reqs))
        assert got == want, (model, name)


def test_tiny_model_and_baseline_on_cpu(common, tmp_path):
    """save_model's tiny Llama read back by ``Scorer`` scores W2's first requests as the transformers
    baseline (run_transformers) does on the same weights."""
    import torch

    from logprobe import Scorer

    hf = common.save_model("tiny", str(tmp_path), "cpu").float()
    reqs = common.workload("W2", common.SAVED_SHAPES["tiny"]["vocab_size"])[:6]
    with torch.inference_mode():
        base = common.run_transformers(hf, reqs, 4096, dev="cpu")
        ours = Scorer(str(tmp_path), device="cpu", dtype="float32", progress=False).engine.run(reqs)
    for a, b in zip(ours, base):
        assert a.logprobs.shape == b.shape and float((a.logprobs - b).abs().max()) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("args", [["gpu_first_call.py", "--models", "tiny", "--device", "cpu"],
                                  ["gpu_moe_parallel.py", "--shape", "tiny", "--device", "cpu", "--limit", "24",
                                   "--sizes", "1x1,2x2", "--skew", "0.5", "--redundant", "1"],
                                  ["gpu_families.py", "--tiny", "--requests", "2"]],
                         ids=lambda a: a[0])
def test_tiny_cpu_run(args):
    """The scripts with a CPU smoke run still finish it (gpu_first_call: about 80 s on 2 threads;
    gpu_moe_parallel: two gloo ranks against one, without and with replicas of hot experts; gpu_families: every family's tiny shape)."""
    out = run(args, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "failed" not in out.stdout, out.stdout[-3000:]


@pytest.mark.slow
def test_hybrid_tiny_cpu_run(tmp_path):
    """gpu_hybrid.py's CPU run (12-20 s on 2 idle threads): both tiny Qwen3.5 checkpoints are written
    with transformers' classes and every row a CPU can run gives numbers; logprobe (whichever
    backend ``Scorer`` picks) and transformers' PyTorch path agree in float32. Row 3 (fla) is
    skipped on a CPU; row 2 is timed, or refused by a backend without deterministic kernels."""
    out = run(["gpu_hybrid.py", "--tiny", "--requests", "2", "--warmup", "2", "--hf-passes", "1",
               "--dir", str(tmp_path)], timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "failed" not in out.stdout, out.stdout[-3000:]
    for model in ("qwen35-9b", "qwen35-35b-a3b"):
        assert f"## {model} (all 4 layers), W1: 2 requests" in out.stdout
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in out.stdout.splitlines() if re.match(r"\| [1-5] \|", ln)]
    assert len(cells) == 2 * 2 * 5, out.stdout[-3000:]  # each model's table, then again under "all models"
    for c in cells:
        row = int(c[0])
        if row == 3:
            assert c[4].startswith("skipped: fla"), c
        elif row == 2 and c[4].startswith("refused"):
            continue
        else:
            assert float(c[4].split()[0]) > 0 and float(c[9]) < 1e-4 and float(c[10]) < 1e-5, c


@pytest.mark.slow  # ~15 s: a tiny VL checkpoint written, both scorers run twice
def test_vlm_tiny_cpu_run(tmp_path):
    """gpu_vlm.py's CPU run: a tiny Qwen3.5 VL checkpoint with its processor, groups sharing small
    images; logprobe (both modes) and transformers' padded batches agree in float32."""
    out = run(["gpu_vlm.py", "--text", "tiny", "--device", "cpu", "--groups", "2", "--group-size", "2", "--small",
               "--passes", "1", "--dir", str(tmp_path)], timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    cells = {c[0]: c for c in ([x.strip() for x in ln.split("|")[1:-1]] for ln in out.stdout.splitlines()
                               if ln.startswith("| ") and not ln.startswith("| row") and "---" not in ln)}
    assert set(cells) == {"default", "deterministic", "transformers"}, out.stdout[-2000:]
    for c in cells.values():
        assert float(c[1]) > 0 and float(c[4].split(" / ")[0]) < 1e-5, c


@pytest.mark.slow  # a server with two gloo workers and a trainer, ~12 s
@pytest.mark.parametrize("in_place", [False, True])
def test_weight_sync_random_fp8_cpu_run(in_place, tmp_path):
    """``--random``: a DeepSeek-V3-shaped model made at random by a TP = EP = 2 server
    (``--load-format dummy``, seed 0, FP8 blocks) takes seed 1's weights from the trainer over gloo
    (FP8 codes broadcast as bytes, scales, experts one by one; the driver hands each rank its rows)
    and scores as a fresh seed-1 scorer at TP = 2, bitwise, under each update's weight_version;
    ``--in-place --stream``: each bucket written as it comes, the trainer's tensors made one at a
    time during each update, the same bits."""
    out = run(["gpu_weight_sync.py", "--random", "tiny-v3", "--fp8", "--tp", "2", "--tiny", "--repeats", "2",
               "--dir", str(tmp_path)] + ["--in-place", "--stream"] * in_place, timeout=600,
              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    updates = re.findall(r"^\| (\d) \| ([\d.]+) \| [\d.]+ \| (step-\d) \|$", out.stdout, re.M)
    assert [(u[0], u[2]) for u in updates] == [("1", "step-1"), ("2", "step-2")], out.stdout
    assert "bitwise: yes; they differ from the ones before: yes" in out.stdout, out.stdout[-3000:]
    assert ("making the tensors" in out.stdout) == in_place, out.stdout[-3000:]


@pytest.mark.slow  # two processes and a server, ~11 s
def test_weight_sync_tiny_cpu_run(tmp_path):
    """gpu_weight_sync.py's CPU run (about 20 s): the real ``logprobe serve`` in a subprocess, this
    script as the trainer over gloo (buckets of 50 KiB, three full updates), then its table: every
    update timed under its own weight_version, every request's scores bitwise a fresh Scorer's on
    the new weights and different from the old ones."""
    out = run(["gpu_weight_sync.py", "--tiny", "--dir", str(tmp_path)], timeout=600,
              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "failed" not in out.stdout, out.stdout[-3000:]
    updates = re.findall(r"^\| (\d) \| ([\d.]+) \| [\d.]+ \| (step-\d) \|$", out.stdout, re.M)
    assert [(u[0], u[2]) for u in updates] == [("1", "step-1"), ("2", "step-2"), ("3", "step-3")], out.stdout
    rows = re.findall(r"^\| \d \| \d+ \| yes \| 0 \| ([\d.e+-]+) \|$", out.stdout, re.M)
    assert len(rows) == 4 and all(float(d) > 0 for d in rows), out.stdout
    assert "bitwise: yes; they differ from the ones before: yes" in out.stdout
