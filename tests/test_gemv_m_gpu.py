"""The small-M W8A16 GEMV (gemv_w8a16_m.cu, _core.ops.gemv_m) against a float64 numpy reference on
awkward sizes (M = 1..17, 63, 64; every linear layer of the target models, tail scale groups where
K % 128 == 64), outputs poisoned before the launch (the harness fills them with 0xFF: NaN), and row m
against the M = 1 decode GEMV on x[m]: bit-identical (same products, k order, per-class chains and
reduction tree), for every epilogue, both 16-bit inputs and the fused RMSNorm. Skipped cleanly
without the CUDA core or a GPU."""

from __future__ import annotations

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")
from numerics import (  # noqa: E402
    ADD,
    STORE,
    SWIGLU,
    assert_rope_writes,
    bf16_bits,
    f16_bits,
    from_bf16,
    from_f16,
    linear_layers,
    llama_inv_freq,
    load_ops,
    random_fp8,
    random_scales,
    reference_linear,
    silu_mul,
)

ops, WHY_NOT = load_ops("gemv_m")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(ops is None, reason=f"gpu: {WHY_NOT}")]

FP32_REL, BF16_REL = 1e-5, 4e-3
BF16_TINY = 2.0**-126

# Every linear layer of the models the engine runs (the heads left out: the decode GEMV serves them).
MODELS = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "smollm2-135m", "smollm2-360m", "qwen2.5-7b")


def model_shapes():
    for name in MODELS:
        for product, N, K, ep in linear_layers(name):
            yield pytest.param(N, K, ep, id=f"{name}-{product}")


# ----------------------------------------------------------------------------- helpers


def assert_close(got, want, tol, what, scale=None):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    bad = ~np.isfinite(got)
    assert not bad.any(), f"{what}: {int(bad.sum())} non-finite outputs (unwritten?), first at {np.argwhere(bad)[0]}"
    den = np.linalg.norm(want) if scale is None else scale
    err = float(np.linalg.norm(got - want) / max(den, 1e-300))
    assert err < tol, f"{what}: rel-L2 {err:.3e} >= {tol:.0e}"


def decode_gemv(w, s, x_row, ep, out_init, x_dtype):
    """The M = 1 decode GEMV on one row, or None where it does not take this K (K % 128 != 0 before
    its tail groups land)."""
    try:
        return ops.gemv(w, s, x_row, ep, out_init, x_dtype)
    except ValueError:
        return None


def check(rng, M, N, K, ep, x_dtype="bf16", nc=0, slab=0, exact_rows=None, kernel="auto"):
    """One product against the numpy reference, and rows against the decode GEMV to the bit."""
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    to_bits, from_bits = (bf16_bits, from_bf16) if x_dtype == "bf16" else (f16_bits, from_f16)
    x = to_bits(rng.standard_normal((M, K)))
    y = reference_linear(w, s, from_bits(x))
    what = f"gemv_m M={M} N={N} K={K} ep={ep} x {x_dtype} nc={nc} slab={slab} kernel={kernel}"
    out_init = None
    if ep == ADD:
        out_init = (rng.standard_normal((M, N)) * (np.sqrt(np.mean(y**2)) + 1.0)).astype(np.float32)
    got = ops.gemv_m(w, s, x, ep, out_init, x_dtype, nc=nc, slab=slab, kernel=kernel)
    if ep == STORE:
        assert_close(got, y, FP32_REL, what)
    elif ep == ADD:
        scale = np.linalg.norm(out_init.astype(np.float64)) + np.linalg.norm(y)
        assert_close(got, out_init + y, FP32_REL, what, scale=scale)
    else:
        F = N // 2
        want = silu_mul(y[:, :F], y[:, F:])
        assert_close(from_bf16(got), want, BF16_REL, what, scale=max(float(np.linalg.norm(want)), BF16_TINY))
    rows = range(M) if exact_rows is None else exact_rows(M)
    for m in rows:
        one = decode_gemv(w, s, x[m], ep, None if out_init is None else out_init[m], x_dtype)
        if one is None:
            return
        np.testing.assert_array_equal(got[m], one, err_msg=f"{what}: row {m} differs from the decode GEMV")


def some_rows(M):
    return sorted({0, M // 2, M - 1})


# ----------------------------------------------------------------------------- tests

M_SMALL = list(range(1, 18)) + [63, 64]


@pytest.mark.parametrize("M", M_SMALL)
@pytest.mark.parametrize("ep", [STORE, ADD, SWIGLU])
def test_gemv_m_every_m(rng, M, ep):
    """Every M up to 17 and the last two of the range, on a shape with a partial tile and a partial
    512-column stripe (N = 2 x 75, K = 1152 + 64: a tail scale group)."""
    check(rng, M, 150, 1216, ep, exact_rows=None)
    check(rng, M, 150, 1024, ep, "f16", exact_rows=None)


@pytest.mark.parametrize("M", [1, 2, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("N,K,ep", list(model_shapes()))
def test_gemv_m_model_shapes(rng, M, N, K, ep):
    check(rng, M, N, K, ep, exact_rows=some_rows)


# The decode GEMV with token columns (gemv_w8a16_cols.cu) against the tile kernel on the rows the
# table may give either: whole rows (K % 512 == 0), ragged rows, ragged rows with a tail scale group.
@pytest.mark.parametrize("M", range(1, 5))
@pytest.mark.parametrize("kernel", ["cols", "tiles"])
@pytest.mark.parametrize("ep", [STORE, ADD, SWIGLU])
def test_gemv_m_cols_and_tiles_every_row_same_bits(rng, M, kernel, ep):
    """Every row of M = 1..4 equals the decode GEMV's to the bit on either kernel, bf16 and f16 x, for
    rows of 0.75 to 4.5 iterations of the columns (several row pairs a warp on the small N)."""
    for N, K, x_dtype in ((2 * 136, 3072, "f16"), (150, 1216, "bf16"), (2 * 520, 1024, "bf16"), (2 * 40, 9216, "f16")):
        check(rng, M, N, K, ep, x_dtype, exact_rows=range, kernel=kernel)


@pytest.mark.parametrize("M", [2, 3, 4])
@pytest.mark.parametrize("N,K,ep", list(model_shapes()))
def test_gemv_m_cols_model_shapes(rng, M, N, K, ep):
    """Every model shape on the token columns where they fit (the table takes only some of them)."""
    if M * (-(-K // 512) * 512) * 2 > 114 * 1024:  # x's fp16 rows past half an SM's 228 KB (Qwen2.5-7B's down, 4 rows)
        with pytest.raises(ValueError, match="no token-column plan"):
            ops.gemv_m_plan(M, N, K, ep, "f16", kernel="cols")
        return
    plan = ops.gemv_m_plan(M, N, K, ep, "f16", kernel="cols")
    assert plan["cols"] and plan["variant"].startswith("gemv_cols<")
    check(rng, M, N, K, ep, "f16", exact_rows=some_rows, kernel="cols")


# Every kernel instance: (M, nc) over the token tiles 1, 2, 4, 8 and their classes per warp.
INSTANCES = [(M, nc) for M in (5, 16) for nc in (1, 2, 4)] + [(M, nc) for M in (31,) for nc in (2, 4)] + [(64, 2)]


@pytest.mark.parametrize("M,nc", INSTANCES)
@pytest.mark.parametrize("ep", [STORE, ADD, SWIGLU])
def test_gemv_m_every_instance_same_bits(rng, M, nc, ep):
    """Each instance's rows equal the decode GEMV's to the bit, with x resident and in slabs (slab =
    one iteration's columns: many restagings per block tile)."""
    for slab in (0, 512):
        check(rng, M, 2 * 136, 3072, ep, "f16", nc=nc, slab=slab, exact_rows=some_rows)


@pytest.mark.parametrize(
    "M,K,kernel",
    [(M, K, "tiles") for M in (1, 3, 16, 40) for K in (576, 3072)]
    + [(M, K, "cols") for M in (1, 3, 4) for K in (576, 3072, 8192)],
)
def test_gemv_m_rmsnorm_same_bits(rng, M, K, kernel):
    """The fused RMSNorm: row m equals rmsnorm() + gemv_m(f16) and, where it takes K, the decode
    GEMV's fused prologue on x[m], to the bit; all against the reference of the normalized input.
    At K = 8192 the token columns stage the raw fp32 rows one at a time (their shared memory)."""
    if kernel == "cols" and K == 8192 and M > 1:
        assert ops.gemv_m_plan(M, 400, K, STORE, "norm", kernel="cols")["cols_raw_rows"] < M
    N = 2 * 200
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = (rng.standard_normal((M, K)) * rng.uniform(0.1, 10, size=(M, 1))).astype(np.float32)
    nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
    xn = ops.rmsnorm(x, nw, 1e-5)  # fp16 bits [M, K]
    for ep in (STORE, ADD, SWIGLU):
        init = rng.standard_normal((M, N)).astype(np.float32) if ep == ADD else None
        got = ops.gemv_m(w, s, x, ep, init, norm_w=nw, eps=1e-5, kernel=kernel)
        np.testing.assert_array_equal(got, ops.gemv_m(w, s, xn, ep, init, "f16", kernel="tiles"))
        if K % 128 == 0:
            for m in some_rows(M):
                one = ops.gemv_rmsnorm(w, s, x[m], nw, 1e-5, ep, None if init is None else init[m])
                np.testing.assert_array_equal(got[m], one, err_msg=f"rmsnorm M={M} K={K} ep={ep} row {m}")
    ref = reference_linear(w, s, from_f16(xn))
    assert_close(ops.gemv_m(w, s, x, STORE, norm_w=nw, eps=1e-5), ref, FP32_REL, f"gemv_m rmsnorm M={M} K={K}")


@pytest.mark.parametrize("mag", ["1e6", "1e-20", "wide"])
def test_gemv_m_bf16_beyond_fp16_range(rng, mag):
    """bf16 rows far outside fp16's range, each with its own power-of-two factor: fp32 results, and
    the decode GEMV's bits row by row."""
    M, N, K = 6, 258, 3072
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    scale = 10.0 ** rng.uniform(-20, 20, (M, K)) if mag == "wide" else float(mag) * 10.0 ** np.arange(M)[:, None]
    x = bf16_bits(rng.standard_normal((M, K)) * scale)
    got = ops.gemv_m(w, s, x, STORE, None, "bf16")
    assert_close(got, reference_linear(w, s, from_bf16(x)), FP32_REL, f"gemv_m bf16 x ~ {mag}")
    for m in range(M):
        np.testing.assert_array_equal(got[m], ops.gemv(w, s, x[m], STORE, None, "bf16"))


def test_gemv_m_swiglu_f16_output(rng):
    """SwiGLU's fp16 output: the decode GEMV's bits, and the overflow flag raised past fp16's range."""
    M, N, K = 9, 2 * 96, 1024
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = f16_bits(rng.standard_normal((M, K)))
    out, flag = ops.gemv_m(w, s, x, SWIGLU, None, "f16", out_dtype="f16")
    assert flag == 0
    for m in range(M):
        one, _ = ops.gemv(w, s, x[m], SWIGLU, None, "f16", "f16")
        np.testing.assert_array_equal(out[m], one)
    big = np.full_like(s, 2.0**20)
    _, flag = ops.gemv_m(w, big, x, SWIGLU, None, "f16", out_dtype="f16")
    assert flag == 1


@pytest.mark.parametrize(
    "H,Hkv,D,K,bias",
    [
        (24, 8, 128, 3072, False),  # Llama-3.2-3B
        (9, 3, 64, 576, False),  # SmolLM2-135M: a 64-column tail scale group
        (28, 4, 128, 3584, True),  # Qwen2.5-7B: q/k/v biases
        (8, 2, 80, 256, False),  # the head dims past 64 and 128: 5 and 6 tiles a head
        (8, 1, 96, 256, True),
        (4, 1, 256, 256, False),
    ],
)
@pytest.mark.parametrize(
    "M,nc,kernel", [(2, 0, "cols"), (4, 0, "cols"), (2, 0, "tiles"), (5, 1, "auto"), (9, 0, "auto"), (16, 4, "auto")]
)
@pytest.mark.parametrize("pos,C", [(0, 20), (4093, 4100), (70000, 70010)])  # middle: the last rows past the cache
def test_gemv_m_rmsnorm_rope_equals_the_three_kernels(rng, H, Hkv, D, K, bias, M, nc, kernel, pos, C):
    """A chunk's QKV launch with RoPE + KV append in its epilogue writes exactly what the small-M
    product (Store) followed by rope_kv_append writes, bit for bit: q of every row, the K / V rows of the
    positions inside the cache, and nothing else of the caches."""
    N = (H + 2 * Hkv) * D
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = (rng.standard_normal((M, K)) * rng.uniform(0.1, 10)).astype(np.float32)
    nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
    b = (rng.standard_normal(N) * 0.5).astype(np.float32) if bias else None
    inv_freq = llama_inv_freq(D)
    kc0, vc0 = np.zeros((C, Hkv, D), np.uint16), np.zeros((C, Hkv, D), np.uint16)
    lo = max(0, pos - 4)  # random rows around the chunk, so a stray write shows
    kc0[lo:] = bf16_bits(rng.standard_normal((C - lo, Hkv, D)))
    vc0[lo:] = bf16_bits(rng.standard_normal((C - lo, Hkv, D)))
    got = ops.gemv_m_rmsnorm_rope(w, s, x, nw, 1e-5, inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy(), b, nc=nc, kernel=kernel)
    qkv = ops.gemv_m(w, s, x, STORE, None, norm_w=nw, eps=1e-5, nc=nc, kernel="auto" if nc else "tiles")
    want = ops.rope_kv_append(qkv, inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy(), bias=b)
    assert_rope_writes(got, want, kc0, vc0, pos, M)


def test_gemv_m_rmsnorm_rope_rejects_bad_arguments(rng):
    H, Hkv, K = 2, 1, 256
    kc = bf16_bits(np.zeros((8, 1, 72)))
    w, s = random_fp8(rng, (4 * 72, K)), random_scales(rng, 4 * 72, K)
    x, nw = np.ones((2, K), np.float32), bf16_bits(np.ones(K))
    with pytest.raises(ValueError, match="multiple of 16"):  # head_dim 72: rotation pairs do not fill a tile
        ops.gemv_m_rmsnorm_rope(w, s, x, nw, 1e-5, llama_inv_freq(72), 0, H, Hkv, 72, kc, kc.copy())
    with pytest.raises(ValueError):  # w's rows are not (H + 2 Hkv) D
        ops.gemv_m_rmsnorm_rope(w, s, x, nw, 1e-5, llama_inv_freq(64), 0, H, Hkv, 64, kc, kc.copy())
    with pytest.raises(ValueError):  # epilogue 3 (RopeKV) is not ops.gemv_m's (the binding refuses it)
        ops.gemv_m(w, s, bf16_bits(np.zeros((2, K))), 3)


def test_gemv_m_plan_table():
    """The table's choices for the 3B shapes at M = 16 (docs/design/gemv_w8a16_m.md): few classes per
    warp where N is small (enough block tiles to fill the GPU), x resident where it fits."""
    o = ops.gemv_m_plan(16, 3072, 3072, ADD)
    gate_up = ops.gemv_m_plan(16, 16384, 3072, SWIGLU)
    down = ops.gemv_m_plan(16, 3072, 8192, ADD)
    assert o["nt"] == 2 and o["nc"] == 2 and o["slab"] >= 3072
    assert gate_up["nc"] == 4
    assert down["slab"] < 8192 and down["slab"] % 512 == 0
    assert ops.gemv_m_plan(64, 3072, 3072)["nt"] == 8
    # x resident: the factor scan keeps its raw rows for the staging (bf16 in x's area, NORM beside it);
    # not with x in slabs
    assert o["keep"] and not down["keep"]
    assert ops.gemv_m_plan(5, 5120, 3072, STORE, "norm")["keep"] and ops.gemv_m_plan(5, 3072, 8192, ADD)["keep"]
    assert not ops.gemv_m_plan(5, 5120, 3072, STORE, "f16")["keep"]
    # 2 and 3 rows of the long products on the decode GEMV with token columns (both blocks of an SM
    # hold x's rows); the rest, and anything the tile kernel's knobs name, on tiles
    gu3 = ops.gemv_m_plan(3, 16384, 3072, SWIGLU, "norm")
    assert gu3["cols"] and gu3["cols_mt"] == 4 and gu3["cols_raw_rows"] == 3 and gu3["variant"].startswith("gemv_cols<")
    assert ops.gemv_m_plan(2, 3072, 8192, ADD, "f16")["cols"]  # 3B down
    assert ops.gemv_m_plan(2, 6144, 4096, STORE, "norm")["cols"]  # 8B qkv
    assert not ops.gemv_m_plan(2, 4096, 4096, ADD, "f16")["cols"]  # 8B o: too short a stream
    assert not ops.gemv_m_plan(2, 49152, 576, STORE, "norm")["cols"]  # SmolLM2's head: too short a row
    assert ops.gemv_m_plan(4, 16384, 3072, SWIGLU, "norm")["cols"]
    assert not ops.gemv_m_plan(5, 16384, 3072, SWIGLU, "norm")["cols"]  # past the rows' crossover
    assert not ops.gemv_m_plan(1, 16384, 3072, SWIGLU, "norm")["cols"]
    assert not ops.gemv_m_plan(3, 16384, 3072, SWIGLU, "norm", nc=2)["cols"]  # the tile kernel's knobs
    assert not ops.gemv_m_plan(3, 16384, 3072, SWIGLU, "norm", kernel="tiles")["cols"]
    assert ops.gemv_m_plan(4, 3072, 3072, ADD, "f16", kernel="cols")["cols"]
    with pytest.raises(ValueError, match="no token-column plan"):
        ops.gemv_m_plan(4, 4096, 28672, ADD, "f16", kernel="cols")  # 4 rows of 28672: 229 KB
    with pytest.raises(ValueError, match="no token-column plan"):
        ops.gemv_m_plan(5, 3072, 3072, ADD, "f16", kernel="cols")  # 4 columns at most


def test_gemv_m_rejects_bad_arguments(rng):
    w, s = random_fp8(rng, (64, 256)), random_scales(rng, 64, 256)
    with pytest.raises(ValueError):
        ops.gemv_m(w, s, bf16_bits(np.zeros((65, 256))), STORE)  # M > 64
    with pytest.raises(ValueError):
        ops.gemv_m(random_fp8(rng, (64, 96)), random_scales(rng, 64, 96), bf16_bits(np.zeros((2, 96))), STORE)
    with pytest.raises(ValueError):
        ops.gemv_m(w, s, bf16_bits(np.zeros((2, 256))), STORE, nc=8 * 3)  # no such instance
    with pytest.raises(ValueError):
        ops.gemv_m(w, s, bf16_bits(np.zeros((2, 256))), STORE, nc=8)  # a tile's classes span two warps or more
