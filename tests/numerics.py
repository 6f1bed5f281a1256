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
