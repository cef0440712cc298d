"""The benchmark scripts still start: each ``bench/*.py`` with an argument parser answers ``--help``
(imports resolve, options parse), and ``bench/gpu_round.sh`` is valid shell. They run on the GPU
machine, which CI never sees: this catches a renamed import or option before a device session does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "argparse" in p.read_text(encoding="utf-8"))


def test_scripts_found():
    assert len(SCRIPTS) >= 15 and BENCH / "gpu_scoring.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help(script):
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                         cwd=BENCH)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


def test_round_script_is_valid_shell():
    out = subprocess.run(["bash", "-n", str(BENCH / "gpu_round.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
