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


@pytest.mark.parametrize("tool", ["prefill_profile.py", "verify_cost.py"])
def test_gpu_tools_need_a_model(tool):
    r = run(tool)
    assert r.returncode == 2 and "model" in r.stderr
    assert run(tool, "--help").returncode == 0
