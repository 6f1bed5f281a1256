"""16-bit bit patterns as the kernel harnesses take and return them (uint16 arrays), and the FP8
linear layers' random operands and float64 reference, shared by the GPU kernel tests."""

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
STORE, ADD, SWIGLU = 0, 1, 2  # kernels.h's Epilogue

# The models whose linear layers the kernel tests run: hidden d, ffn, heads H, kv heads Hkv, head dim D.
# d = 576 and 960 end in a 64-column scale group.
MODEL_SHAPES = {
    "llama-3.2-1b": dict(d=2048, ffn=8192, H=32, Hkv=8, D=64),
    "llama-3.2-3b": dict(d=3072, ffn=8192, H=24, Hkv=8, D=128),
    "llama-3.1-8b": dict(d=4096, ffn=14336, H=32, Hkv=8, D=128),
    "smollm2-135m": dict(d=576, ffn=1536, H=9, Hkv=3, D=64),
    "smollm2-360m": dict(d=960, ffn=2560, H=15, Hkv=5, D=64),
    "qwen2.5-7b": dict(d=3584, ffn=18944, H=28, Hkv=4, D=128),
}


def linear_layers(model: str) -> list[tuple[str, int, int, int]]:
    """(product, N, K, epilogue) of a model's four linear layers as a layer runs them (the head left out)."""
    m = MODEL_SHAPES[model]
    d, ffn, qkv = m["d"], m["ffn"], (m["H"] + 2 * m["Hkv"]) * m["D"]
    return [("qkv", qkv, d, STORE), ("o", d, m["H"] * m["D"], ADD), ("gate_up", 2 * ffn, d, SWIGLU), ("down", d, ffn, ADD)]


FP8_TO_F64 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)  # e4m3 code -> value


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


def llama_inv_freq(D, theta=500000.0) -> np.ndarray:
    """RoPE's inverse frequencies [D / 2] (float32), Llama 3's base."""
    return (1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)).astype(np.float32)


def assert_rope_writes(got, want, k_cache0, v_cache0, pos: int, rows: int) -> None:
    """A fused QKV launch's (q, k_cache, v_cache) equal the Store product + rope_kv_append's `want` bit for bit,
    the rows of the chunk's positions inside the cache were written, and no other cache row was touched."""
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    kc, vc = got[1], got[2]
    inside = max(0, min(rows, len(k_cache0) - pos))
    for c, c0 in ((kc, k_cache0), (vc, v_cache0)):
        assert np.array_equal(c[:pos], c0[:pos]) and np.array_equal(c[pos + inside :], c0[pos + inside :])
    assert inside == 0 or not np.array_equal(kc[pos : pos + inside], k_cache0[pos : pos + inside])


def random_fp8(rng, shape) -> np.ndarray:
    """Uniformly random e4m3 codes (zeros, subnormals and +-448 included), NaN codes excluded."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] ^= 1  # 0x7F / 0xFF (NaN) -> +-448
    return b


def random_scales(rng, n, k) -> np.ndarray:
    """[n, ceil(k / 128)], spread over 8 binades so a scale applied to the wrong group or row shows."""
    return (2.0 ** rng.uniform(-12, -4, size=(n, -(-k // 128)))).astype(np.float32)


def reference_linear(w: np.ndarray, scales: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 x [M, K] @ (fp8 w [N, K] * scale).T, dequantized exactly, the last scale group possibly
    64 wide; in row chunks, so the dequantized weights of a large product never sit in memory at once."""
    n, k = w.shape
    col_scale = np.repeat(np.arange(scales.shape[1]), 128)[:k]
    y = np.empty((x.shape[0], n))
    step = max(1, (1 << 24) // k)
    for r in range(0, n, step):
        wd = FP8_TO_F64[w[r : r + step]] * scales[r : r + step][:, col_scale]
        y[:, r : r + step] = x @ wd.T
    return y


def silu_mul(gate, up):
    """SwiGLU's silu(gate) * up as the kernels write it, gate / (1 + exp(-gate)) * up."""
    with np.errstate(over="ignore"):
        return gate / (1.0 + np.exp(-gate)) * up
