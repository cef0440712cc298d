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
  logprobe; ``slow``: the scripts that have a tiny CPU run do it (gpu_first_call.py, gpu_moe.py,
  gpu_hybrid.py, gpu_profile.py's llama and hybrid scenarios);
* gpu_profile.py's prefix scenario runs on the CPU, and its kernel families and tables hold on
  literal kernel names and a profiler's answer.
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
    assert len(SCRIPTS) >= 25 and "common.py" not in names
    assert {"gpu_head.py", "gpu_workloads.py", "gpu_long.py", "gpu_engine.py", "gpu_tp.py", "gpu_moe.py",
            "gpu_moe_kernel.py"} <= names


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
@pytest.mark.parametrize("args", [["gpu_first_call.py", "--model", "tiny", "--device", "cpu"],
                                  ["gpu_moe.py", "--device", "cpu", "--tiny", "--baseline-limit", "4", "--tune"]],
                         ids=lambda a: a[0])
def test_tiny_cpu_run(args):
    """The scripts with a CPU smoke run still finish it (gpu_first_call: about 80 s on 2 threads;
    gpu_moe, its kernel section under Triton's interpreter included: 20 s to 2 min)."""
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


# ------------------------------------------------------------------------------ gpu_profile.py


def test_kernel_families(common):
    """Kernel names as torch.profiler prints them fall in the families the profile groups by; the
    doctests of common.py (kernel_family, family_times, busy_union, pass_flops) hold."""
    import doctest

    assert doctest.testmod(common).failed == 0
    names = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "matmul",
             "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN": "matmul",
             "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x3_tn_align8>": "matmul",
             "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "matmul",
             "_matmul": "matmul",
             "flash_fwd_kernel": "attention",
             "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>": "attention",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "attention",
             "chunk_gated_delta_rule_fwd_kernel_h": "gated-delta",
             "chunk_fwd_kernel_o": "gated-delta",
             "chunk_scaled_dot_kkt_fwd_kernel": "gated-delta",
             "merge_16x16_to_64x64_inverse_kernel": "gated-delta",
             "recompute_w_u_fwd_kernel": "gated-delta",
             "l2norm_fwd_kernel": "gated-delta",
             "causal_conv1d_fwd_kernel": "conv",
             "_conv_kernel": "conv",
             "_gate_up_kernel": "moe",
             "_down_kernel": "moe",
             "_combine_rows_kernel": "moe",
             "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": "routing",
             "void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long>": "routing",
             "void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>": "routing",
             "_head_partials": "head",
             "_target_logit": "head",
             "ncclDevKernel_AllGather_RING_LL": "nccl",
             "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<MulFunctor>>": "elementwise",
             "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "elementwise",
             "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>":
                 "elementwise",
             "_rmsnorm": "elementwise", "_rotary": "elementwise", "_silu_mul": "elementwise",
             "void at::native::elementwise_kernel<128, 4, gpu_kernel_impl_nocast<direct_copy_kernel_cuda>>": "copy",
             "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 1, 128, 1>": "copy",
             "void at::native::index_elementwise_kernel<128, 4>": "copy",
             "Memcpy HtoD (Pinned -> Device)": "copy", "Memset (Device)": "copy",
             "some_kernel_nobody_knows": "other"}
    got = {n: common.kernel_family(n) for n in names}
    assert got == names
    assert set(names.values()) == set(common.FAMILIES)


def test_kernel_tables_of_a_profile(common, capsys):
    """kernel_tables on a profiler's answer (two kernels overlapping, one alone, a CPU op): the
    top table, the family sums, kernel time / wall and the union of the kernel intervals."""
    from types import SimpleNamespace as N

    cuda, cpu = N(name="CUDA"), N(name="CPU")
    avg = [N(key="nvjet_tst_a", count=4, self_device_time_total=6000.0, device_type=cuda),
           N(key="flash_fwd_kernel", count=2, self_device_time_total=2000.0, device_type=cuda),
           N(key="aten::mm", count=4, self_device_time_total=0.0, device_type=cpu)]
    evs = [N(device_type=cuda, time_range=N(start=0.0, end=6000.0)),  # the GEMMs
           N(device_type=cuda, time_range=N(start=5000.0, end=7000.0)),  # the attention, overlapping 1 ms
           N(device_type=cpu, time_range=N(start=0.0, end=10000.0))]
    prof = N(key_averages=lambda: avg, events=lambda: evs)
    out = common.kernel_tables(prof, 0.020, top=5, grouped=True, calls=2)
    assert out == dict(kernel_ms=8.0, busy_ms=7.0, wall_ms=20.0, families={"matmul": 6.0, "attention": 2.0})
    text = capsys.readouterr().out
    assert "| nvjet_tst_a | 2 | 3.00 | 75.0% | matmul |" in text
    assert "| matmul / GEMM (cuBLAS, CUTLASS, Triton matmuls, weight expansion) | 3.00 | 75.0% |" in text
    assert "kernel time 4.00 ms / wall 10.00 ms = 40.0%" in text
    assert "union of kernel intervals 3.50 ms = 35.0%; GPU idle 6.50 ms per call" in text


def profile_run(*args):
    out = run(["gpu_profile.py", "--tiny", *args], timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_profile_prefix_tiny_cpu_run():
    """gpu_profile.py --scenario prefix on the CPU (about 8 s): the per-call table (a call resumed
    from the cache computes fewer tokens than the first of its group) and the CPU table, per call."""
    text = profile_run("--scenario", "prefix", "--calls", "2", "--prompt", "256", "--response", "64")
    assert "## Profile: prefix cache, one request per call" in text
    rows = {m[0]: (int(m[1]), float(m[2])) for m in
            re.findall(r"^\| (all|first of a group[^|]*|resumed[^|]*) \| (\d+) \| [\d.]+ \| ([\d.]+) /", text, re.M)}
    assert len(rows) == 3, text[-3000:]
    first, resumed = rows["first of a group (prompt computed)"], rows["resumed from the cache"]
    assert first[0] > resumed[0] > 0 and first[1] > 0, rows
    assert "| CPU op / function | count per call | self ms per call | share |" in text
    assert re.search(r"^CPU self time, all ops and functions: [\d.]+ ms per call \(2 calls\)$", text, re.M), text


@pytest.mark.slow  # ~15 s on 2 threads
def test_profile_llama_hybrid_tiny_cpu_run(tmp_path):
    """gpu_profile.py's llama and hybrid scenarios on the CPU in one process: a CPU op table for
    the tiny Llama and for the tiny Qwen3.5 in both modes."""
    text = profile_run("--scenario", "llama,hybrid", "--profile-requests", "1", "--models", "qwen35-9b",
                       "--dir", str(tmp_path))
    for head in ("## Profile: tiny Llama W1, first 1 requests, default",
                 "## Profile: qwen35-9b (all 4 layers) W1, first 1 requests, default",
                 "## Profile: qwen35-9b (all 4 layers) W1, first 1 requests, deterministic"):
        assert head in text, text[-3000:]
    assert text.count("| CPU op / function | count per call | self ms per call | share |") == 3
    assert text.count("### Time by module: ") == 3
    assert "| mlp: MoeBlock / experts: Experts |" not in text  # qwen35-9b is dense
    assert re.search(r"^\| linear_attn: GatedDeltaMixer \| 3 \| [\d.]+ \| [\d.]+ \| [\d.]+% \|$", text, re.M), text[-3000:]


def test_profile_verdict(capsys):
    """gpu_profile.py's one-line answer for the prefix scenario (a GPU run's only line the CPU run
    does not print): 32 calls of 27 ms, 12.8 ms of kernels of which 11.2 ms busy, 10 ms of FLOPs."""
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_profile
    finally:
        sys.path.remove(str(BENCH))
    gpu_profile.verdict(27.0, 10.0, dict(kernel_ms=32 * 12.8, busy_ms=32 * 11.2, wall_ms=0.0, families={}), 32)
    assert ("wall 27.00 ms (no profiler); kernels 12.80 ms, union 11.20 ms; GPU idle ~15.80 ms = 59% of the wall "
            "(host-bound time); the FLOPs at the bf16 ceiling 10.00 ms: kernels take 1.3x that"
            ) in capsys.readouterr().out


def test_module_clock(capsys):
    """gpu_profile.ModuleClock on a toy model (host time on the CPU): each decoder layer's children
    and their children summed over the layers, the model's other children, own time = time less
    the timed children's, and the rest of the wall outside them; the hooks go with the block."""
    import time

    import torch
    from torch import nn

    sys.path.insert(0, str(BENCH))
    try:
        import gpu_profile
    finally:
        sys.path.remove(str(BENCH))

    class Sleep(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.s = s

        def forward(self, x):
            time.sleep(self.s)
            return x

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Sleep(0.02)

        def forward(self, x):
            time.sleep(0.01)
            return self.inner(x)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix, self.norm = Block(), Sleep(0.0)

        def forward(self, x):
            return self.norm(self.mix(x))

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.layers = Sleep(0.0), nn.ModuleList([Layer(), Layer()])

        def forward(self, x):
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return x

    model = Toy()
    with gpu_profile.ModuleClock(model, cuda=False, depth=2) as clock:
        t = time.perf_counter()
        model(torch.zeros(1))
        time.sleep(0.03)
        wall = (time.perf_counter() - t) * 1e3
    tot = clock.totals()
    assert {k: n for k, (n, _) in tot.items()} == {"embed: Sleep": 1, "mix: Block / inner: Sleep": 2, "mix: Block": 2,
                                                   "norm: Sleep": 2}
    assert 60 <= tot["mix: Block"][1] < 200 and 40 <= tot["mix: Block / inner: Sleep"][1] < tot["mix: Block"][1]
    clock.table(wall)
    text = capsys.readouterr().out
    own = float(re.search(r"^\| mix: Block \| 2 \| [\d.]+ \| ([\d.]+) \|", text, re.M).group(1))
    assert 15 <= own < 100, text
    outside = float(re.search(r"^\| outside these modules [^|]*\| \| ([\d.]+) \|", text, re.M).group(1))
    assert 25 <= outside < 200, text
    assert not model.layers[0].mix._forward_hooks and not model.embed._forward_pre_hooks
