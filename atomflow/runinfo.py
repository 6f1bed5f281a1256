"""What a measurement ran on, for bench and profile reports: the commit, package versions, GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from atomflow import __version__

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """$ATOMFLOW_COMMIT when set (a copy of the tree whose .git is absent or not the tree's own says
    what it is), else git rev-parse of the source tree (+ "-dirty"), else "unknown"."""
    if os.environ.get("ATOMFLOW_COMMIT"):
        return os.environ["ATOMFLOW_COMMIT"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        if sha:
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def versions(with_torch: bool = False) -> dict:
    """atomflow, Python, the CUDA runtime the core was built with; torch, transformers and vllm only
    when a baseline used them (importing torch is not free, and the engine never does)."""
    out = dict(atomflow=__version__, python=sys.version.split()[0])
    try:
        from atomflow import _core  # type: ignore[attr-defined]

        v = _core.build_info()["cuda_runtime_version"]
        out["cuda_runtime"] = f"{v // 1000}.{v % 1000 // 10}"
    except ImportError:
        out["cuda_runtime"] = None
    if with_torch:
        for name in ("torch", "transformers", "vllm"):
            mod = sys.modules.get(name)
            out[name] = getattr(mod, "__version__", None) if mod else None
    return out


def device() -> dict:
    """_core.device_info() with the capability as "9.0"; {} where there is no GPU."""
    try:
        from atomflow import _core  # type: ignore[attr-defined]

        info = dict(_core.device_info())
    except (ImportError, RuntimeError):
        return {}
    info["capability"] = ".".join(map(str, info["capability"]))
    return info


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
