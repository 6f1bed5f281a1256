"""tools/sass_compare.py on two tiny cubins: the same source compiles to `same`, a changed kernel is
`DIFF`, a renamed one `NOMATCH` unless --map renames it back (needs nvcc and readelf)."""

import shutil
import subprocess

import pytest
from conftest import load_tool

pytestmark = pytest.mark.skipif(not (shutil.which("nvcc") and shutil.which("readelf")), reason="needs nvcc and readelf")

SRC = """
extern "C" __global__ void a(float* x) { x[threadIdx.x] += 1.0f; }
extern "C" __global__ void NAME(float* x) { x[threadIdx.x] *= FACTOR; }
"""


def cubin(tmp_path, tag: str, name: str, factor: str) -> str:
    src = tmp_path / f"{tag}.cu"
    src.write_text(SRC.replace("NAME", name).replace("FACTOR", factor))
    out = tmp_path / f"{tag}.cubin"
    subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(out), str(src)], check=True)
    return str(out)


def test_sass_compare(tmp_path, capsys):
    tool = load_tool("sass_compare")
    old = cubin(tmp_path, "old", "b", "2.0f")
    assert tool.main([old, cubin(tmp_path, "same", "b", "2.0f")]) == 0
    assert tool.main([old, cubin(tmp_path, "diff", "b", "3.0f")]) == 1
    assert "DIFF" in capsys.readouterr().out
    renamed = cubin(tmp_path, "renamed", "b2", "2.0f")
    assert tool.main([old, renamed]) == 1
    assert "NOMATCH" in capsys.readouterr().out
    assert tool.main([old, renamed, "--map", ".text.b=.text.b2"]) == 0
