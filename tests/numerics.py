"""16-bit bit patterns as the kernel harnesses take and return them (uint16 arrays), shared by
the GPU kernel tests."""

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def bf16_bits(a) -> np.ndarray:
    """float -> bf16 (round to nearest even) as uint16 bit patterns."""
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32).astype(BF16).view(np.uint16))


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return bits.view(BF16).astype(np.float64)


def f16_bits(a) -> np.ndarray:
    """float -> fp16 (round to nearest even) as uint16 bit patterns: the RMSNorm output's type."""
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32).astype(np.float16).view(np.uint16))


def from_f16(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float16).astype(np.float64)


def load_ops(*needs: str):
    """(atomflow._core.ops, "") where the CUDA core and a GPU are here (and ops has every function in
    `needs`), else (None, why): the kernel tests' skip reason."""
    try:
        from atomflow import _core
    except ImportError as e:
        return None, f"atomflow._core is not importable ({e})"
    ok, why = _core.cuda_available()
    if not ok:
        return None, why
    if not hasattr(_core, "ops"):
        return None, "atomflow._core was built without the ops submodule"
    missing = [n for n in needs if not hasattr(_core.ops, n)]
    if missing:
        return None, "atomflow._core was built without ops." + ", ops.".join(missing)
    return _core.ops, ""
