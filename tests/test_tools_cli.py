"""The GPU tools' command lines, on any machine: their arguments are checked before they touch the GPU,
so a typo fails in a second with a one-line error instead of after a model load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / tool), *args], capture_output=True, text=True, timeout=60)


def test_bench_kernels_refuses_an_unknown_section():
    r = run("bench_kernels.py", "--sections", "gemm_sm90,bogus")
    assert r.returncode == 2
    assert "unknown section(s) bogus" in r.stderr and "gemm_sm90" in r.stderr


@pytest.mark.parametrize("tool", ["prefill_profile.py", "verify_cost.py", "prefill_recipe_quality.py"])
def test_gpu_tools_need_a_model(tool):
    r = run(tool)
    assert r.returncode == 2 and "model" in r.stderr
    assert run(tool, "--help").returncode == 0


def test_prefill_profile_refuses_an_unknown_recipe():
    r = run("prefill_profile.py", "model.atomflow", "--recipe", "w8a16,w4a4")
    assert r.returncode == 2 and "--recipe" in r.stderr


def test_prefill_recipe_quality_checks_its_window():
    r = run("prefill_recipe_quality.py", "model.atomflow", "--text", "t.txt", "--ctx", "2048")
    assert r.returncode == 2 and "--ctx" in r.stderr
