"""Whether the CUDA core is built and a usable GPU is present; imports nothing heavy."""

from __future__ import annotations


def cuda_status() -> tuple[bool, str]:
    """(usable, reason): the CUDA core was built and a GPU of compute capability >= 8.9 is present."""
    try:
        from atomflow import _core  # type: ignore[attr-defined]
    except ImportError as e:
        return False, f"the CUDA core was not built ({e}); reinstall with nvcc on the PATH"
    return _core.cuda_available()
