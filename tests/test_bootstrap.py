"""scripts/bootstrap.sh and tools/verify_download.py without a GPU: --help, bad options, the
toolchain check failing cleanly (no nvcc, an old GPU, a broken driver, no usable GPU), shellcheck,
and the sha256 check of a download against (fake) Hub metadata."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, load_tool

from atomflow.device import cuda_status

BASH = shutil.which("bash") or "/bin/bash"
SCRIPT = ROOT / "scripts" / "bootstrap.sh"
TOOLS = ("dirname", "basename", "mkdir", "head", "tail", "tr", "sed", "cat", "touch", "tee", "date")


def bootstrap(*args, path: str | None = None, tmp_path: Path):
    env = {**os.environ, "PYTHON": sys.executable}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [BASH, str(SCRIPT), "--workdir", str(tmp_path / "work"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )


def fake_path(tmp_path: Path, with_nvcc: bool, smi: str | None) -> str:
    """A PATH with the basic tools, optionally a fake nvcc, and a fake nvidia-smi printing `smi`
    (a line starting with 'FAIL' makes it fail like a missing driver)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in TOOLS:
        found = shutil.which(tool)
        if found and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(found)
    if with_nvcc:  # and cmake: the toolchain is complete but for the GPU
        for tool, line in (("nvcc", "Cuda compilation tools, release 13.0"), ("cmake", "cmake version 4.4.0")):
            (bin_dir / tool).write_text(f"#!/bin/sh\necho '{line}'\n")
            (bin_dir / tool).chmod(0o755)
    if smi is not None:
        body = f"echo '{smi[4:]}' >&2; exit 9" if smi.startswith("FAIL") else f"echo '{smi}'"
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    return str(bin_dir)


def failure(r, step: str) -> str:
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"FAILED in step [{step}]" in r.stderr, r.stderr
    return r.stderr


def test_help(tmp_path):
    r = bootstrap("--help", tmp_path=tmp_path)
    assert r.returncode == 0
    for flag in ("--model", "--hf-dir", "--synthetic", "--preset", "--workdir", "--skip-build", "--skip-fetch"):
        assert flag in r.stdout


def test_bad_options(tmp_path):
    r = bootstrap("--frobnicate", tmp_path=tmp_path)
    assert r.returncode == 1 and "unknown option --frobnicate" in r.stderr
    r = bootstrap("--synthetic", "--model", "org/x", tmp_path=tmp_path)
    assert r.returncode == 1 and "alternatives" in r.stderr


def test_no_nvcc(tmp_path):
    err = failure(bootstrap(path=fake_path(tmp_path, with_nvcc=False, smi=None), tmp_path=tmp_path), "toolchain")
    assert "nvcc not found" in err


def test_gpu_too_old(tmp_path):
    path = fake_path(tmp_path, with_nvcc=True, smi="NVIDIA A100-SXM4-80GB, 8.0")
    err = failure(bootstrap(path=path, tmp_path=tmp_path), "toolchain")
    assert "compute capability 8.0; atomflow needs >= 8.9" in err


def test_driver_broken(tmp_path):
    path = fake_path(tmp_path, with_nvcc=True, smi="FAILNVIDIA-SMI has failed: couldn't communicate with the driver")
    err = failure(bootstrap(path=path, tmp_path=tmp_path), "toolchain")
    assert "nvidia-smi failed" in err and "driver" in err


@pytest.mark.skipif(cuda_status()[0], reason="a usable GPU is present")
def test_no_usable_gpu(tmp_path):
    """This machine: the build is skipped, the installed core finds no usable GPU."""
    path = fake_path(tmp_path, with_nvcc=False, smi=None)
    r = bootstrap("--skip-build", path=path, tmp_path=tmp_path)
    err = failure(r, "gpu check")
    assert "no usable GPU" in err and "== [toolchain]" in r.stdout and "== [build]" in r.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("script", ["bootstrap.sh", "profile.sh"])
def test_shellcheck(script):
    r = subprocess.run(["shellcheck", str(ROOT / "scripts" / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


# ----------------------------------------------------------------------------- verify_download


def test_verify_download(tmp_path):
    vd = load_tool("verify_download")
    (tmp_path / "model.safetensors").write_bytes(b"weights" * 1000)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / ".atomflow-source.json").write_text("{}")
    good = hashlib.sha256(b"weights" * 1000).hexdigest()
    assert vd.verify(tmp_path, {"model.safetensors": good, "original/consolidated.pth": "0" * 64}) == ([], 1)
    assert vd.verify(tmp_path, {"model.safetensors": "f" * 64}) == (["model.safetensors"], 1)
    sums = vd.write_sums(tmp_path).read_text().splitlines()
    assert f"{good}  model.safetensors" in sums and len(sums) == 2  # hidden files and SHA256SUMS left out


def test_verify_download_offline(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "verify_download.py"), str(tmp_path), "org/model"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "sha256 check skipped" in r.stdout and (tmp_path / "SHA256SUMS").is_file()
