"""gemm_w8a16_sm90 (the Hopper prefill GEMM, CUTLASS TMA + wgmma) against float64 references, on fresh
random inputs with every output poisoned (NaN) before the launch.

Precision (kernels.h): each weight enters the tensor cores as type(float32(fp8) * scale), one rounding
of the exact dequantized weight to the activation's 16-bit type (unit roundoff u = 2^-9 for bf16, 2^-11
for fp16), then fp32 accumulation. gemm_w8a16 keeps w * s exact (scales on fp32 partial sums), so its
error is fp32's (< 1e-5). Two references tell the two apart:
  - exact: x @ (fp8 * s)^T in float64. The new kernel's rel-L2 against it is the weight rounding's,
    ~u / sqrt(3) (random relative errors over a dot product): bounded by ROUND_REL = 2 u / sqrt(3).
    Printed next to gemm_w8a16's error on the same inputs.
  - recipe: x @ type(float32(fp8) * s)^T in float64, the rounding emulated in numpy. The kernel must
    match it to fp32 accumulation (RECIPE_REL); a miss there means the kernel does something else than
    the recipe (a scale rounded to 16 bits first, a scale of the wrong group or row, a transposed tile).
SwiGLU's output is bf16: its bound adds bf16's rounding (4e-3, as tests/test_kernels_gpu.py).
A failure message names where the error sits (rows past a 128-row tile, columns past a 128-column tile,
unwritten NaNs) so it says what is wrong without a rerun."""

from __future__ import annotations

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")
from numerics import (  # noqa: E402
    ADD,
    BF16,
    FP8_TO_F64,
    MODEL_SHAPES,
    STORE,
    SWIGLU,
    bf16_bits,
    f16_bits,
    from_bf16,
    from_f16,
    linear_layers,
    load_ops,
    random_fp8,
    random_scales,
    silu_mul,
)

ops, WHY_NOT = load_ops()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(ops is None, reason=f"gpu: {WHY_NOT}")]

UNIT = {"bf16": 2.0**-9, "f16": 2.0**-11}
ROUND_REL = {t: 2 * u / np.sqrt(3) for t, u in UNIT.items()}  # bf16 2.3e-3, fp16 5.6e-4
RECIPE_REL = 1e-4  # fp32 accumulation of K products, any order (the recipe's rounding is emulated exactly)
FP32_REL = 1e-5  # gemm_w8a16's own bound (tests/test_kernels_gpu.py)
BF16_OUT_REL = 4e-3  # an output rounded once to bf16
BF16_TINY = 2.0**-126
FP8_TO_F32 = FP8_TO_F64.astype(np.float32)

M_SWEEP = [1, 2, 17, 63, 64, 65, 100, 255, 256, 511, 512]

# Every linear layer of the prefill shapes the engine runs (SmolLM2's K = 576: a 64-column tail group).
MODELS = ("llama-3.2-3b", "llama-3.1-8b", "smollm2-135m", "qwen2.5-7b")


def model_shapes():
    for name in MODELS:
        marks = [pytest.mark.slow] if MODEL_SHAPES[name]["d"] >= 3584 else []
        for product, N, K, ep in linear_layers(name):
            yield pytest.param(N, K, ep, id=f"{name}-{product}", marks=marks)


# ----------------------------------------------------------------------------- helpers


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def where_wrong(got: np.ndarray, want: np.ndarray) -> str:
    """Where the error of a [M, N] result sits: unwritten outputs, the worst element, and the row and
    column tiles (128 x 128, the kernel's) whose error stands out."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bad = ~np.isfinite(got)
    if bad.any():
        rows, cols = np.nonzero(bad)
        return (
            f"{int(bad.sum())} non-finite outputs (unwritten: poisoned NaN), rows {rows.min()}..{rows.max()}, "
            f"columns {cols.min()}..{cols.max()}, first at {(int(rows[0]), int(cols[0]))}"
        )
    err = np.abs(got - want)
    i = np.unravel_index(int(np.argmax(err)), err.shape)
    scale = max(float(np.sqrt(np.mean(want**2))), 1e-300)
    M, N = got.shape
    row_tiles = [float(np.sqrt(np.mean(err[r : r + 128] ** 2))) / scale for r in range(0, M, 128)]
    col_tiles = [float(np.sqrt(np.mean(err[:, c : c + 128] ** 2))) / scale for c in range(0, N, 128)]
    worst_c = int(np.argmax(col_tiles))
    return (
        f"worst at (m={i[0]}, n={i[1]}): got {got[i]:.6g}, want {want[i]:.6g}; "
        f"rms error / rms want by 128-row tile {[f'{e:.1e}' for e in row_tiles]}; "
        f"worst 128-column tile {worst_c} (columns {128 * worst_c}..) {col_tiles[worst_c]:.1e}, median {np.median(col_tiles):.1e}"
    )


def check(got, want, tol: float, what: str, scale: float | None = None) -> float:
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    if not np.isfinite(got).all():
        pytest.fail(f"{what}: {where_wrong(got, want)}")
    err = rel_l2(got, want) if scale is None else float(np.linalg.norm(got - want) / max(scale, 1e-300))
    assert err < tol, f"{what}: rel-L2 {err:.3e} >= {tol:.1e}; {where_wrong(got, want)}"
    return err


def dequant(w: np.ndarray, s: np.ndarray, x_dtype: str | None) -> np.ndarray:
    """fp8 * scale per 128-column group (the last one 64 wide when K % 128 == 64): exact in float64
    (x_dtype None), or the kernel's recipe, type(float32(fp8) * float32(scale))."""
    n, k = w.shape
    s_cols = np.repeat(s, 128, axis=1)[:, :k]
    if x_dtype is None:
        return FP8_TO_F64[w] * s_cols.astype(np.float64)
    prod = FP8_TO_F32[w] * s_cols  # float32 product, rounded once
    return prod.astype(BF16 if x_dtype == "bf16" else np.float16).astype(np.float64)


def inputs(rng, M, N, K, x_dtype):
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    to_bits, from_bits = (bf16_bits, from_bf16) if x_dtype == "bf16" else (f16_bits, from_f16)
    x = to_bits(rng.standard_normal((M, K)))
    return w, s, x, from_bits(x)


def check_epilogue(rng, w, s, x, y, ep, x_dtype, tol, what) -> float:
    """One epilogue of gemm_sm90 against y (the product's reference); returns the rel-L2."""
    if ep == STORE:
        return check(ops.gemm_sm90(w, s, x, STORE, None, x_dtype), y, tol, f"{what} Store")
    if ep == ADD:
        residual = (rng.standard_normal(y.shape) * (np.sqrt(np.mean(y**2)) + 1.0)).astype(np.float32)
        got = ops.gemm_sm90(w, s, x, ADD, residual, x_dtype)
        # relative to the terms of the sum (a sum near zero would make a result-relative bound fail)
        scale = float(np.linalg.norm(residual.astype(np.float64)) + np.linalg.norm(y))
        return check(got, residual + y, tol, f"{what} AddResidual", scale=scale)
    F = y.shape[1] // 2
    want = silu_mul(y[:, :F], y[:, F:])
    got = from_bf16(ops.gemm_sm90(w, s, x, SWIGLU, None, x_dtype))
    return check(got, want, tol + BF16_OUT_REL, f"{what} SwiGLU", scale=max(float(np.linalg.norm(want)), BF16_TINY))


# ----------------------------------------------------------------------------- tests


def test_sm90_gemm_is_built():
    """A GPU build without it would silently keep gemm_w8a16: nvidia-cutlass (a build requirement) was
    missing, e.g. pip install --no-build-isolation without it; set ATOMFLOW_CUTLASS_DIR or install it."""
    assert ops.gemm_sm90_built(), "built without gemm_w8a16_sm90: nvidia-cutlass headers not found at build time"


@pytest.mark.parametrize("x_dtype", ["bf16", "f16"])
@pytest.mark.parametrize("M", M_SWEEP)
@pytest.mark.parametrize("N,K", [(3072, 3072), (576, 1536), (960, 576)], ids=["3b-o", "smollm2-down", "smollm2-qkv"])
def test_gemm_sm90_follows_its_recipe(rng, M, N, K, x_dtype):
    """Every M (tile tails on the token side), three shapes (a 64-column tail group with K = 576, N not
    a multiple of 128 with 576 and 960): the recipe reference to fp32 accumulation, every epilogue."""
    if not ops.gemm_sm90_built():
        pytest.skip("built without gemm_w8a16_sm90 (test_sm90_gemm_is_built says why)")
    w, s, x, xf = inputs(rng, M, N, K, x_dtype)
    y = xf @ dequant(w, s, x_dtype).T
    what = f"gemm_sm90 M={M} N={N} K={K} x {x_dtype} (recipe reference)"
    for ep in (STORE, ADD, SWIGLU):
        check_epilogue(rng, w, s, x, y, ep, x_dtype, RECIPE_REL, what)


@pytest.mark.parametrize("x_dtype", ["bf16", "f16"])
@pytest.mark.parametrize("M", [100, 256])
@pytest.mark.parametrize("N,K,ep", list(model_shapes()))
def test_gemm_sm90_model_shapes(rng, M, N, K, ep, x_dtype):
    """Every product of the four models at a full chunk (256) and a ragged one (100), against the exact
    float64 reference: the weight rounding's bound, next to gemm_w8a16's error on the same inputs."""
    if not ops.gemm_sm90_built():
        pytest.skip("built without gemm_w8a16_sm90 (test_sm90_gemm_is_built says why)")
    w, s, x, xf = inputs(rng, M, N, K, x_dtype)
    y = xf @ dequant(w, s, None).T
    what = f"gemm_sm90 M={M} N={N} K={K} x {x_dtype}"
    err_old = rel_l2(ops.gemm(w, s, x, STORE, None, x_dtype), y)
    err_new = check(ops.gemm_sm90(w, s, x, STORE, None, x_dtype), y, ROUND_REL[x_dtype], f"{what} Store")
    print(f"{what}: rel-L2 vs exact {err_new:.2e} (bound {ROUND_REL[x_dtype]:.1e}), gemm_w8a16 {err_old:.2e}")
    assert err_old < FP32_REL, f"{what}: gemm_w8a16's own error {err_old:.2e} (the comparison needs it exact)"
    if ep != STORE:
        check_epilogue(rng, w, s, x, y, ep, x_dtype, ROUND_REL[x_dtype], what)


TILES = ["xwide", "wide", "narrow", "wide-streamk", "narrow-streamk"]


@pytest.mark.parametrize("x_dtype", ["bf16", "f16"])
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("M,N,K", [(1, 3072, 8192), (17, 960, 576), (64, 3072, 3072), (300, 5120, 3072)])
def test_gemm_sm90_every_tile_kind(rng, tile, M, N, K, x_dtype):
    """Each tile kind (xwide / wide / narrow tokens per tile, with and without stream-K's split k-loops) on
    few tiles and many, a deep K (o and down of a short chunk: stream-K splits them), every epilogue:
    the recipe reference, and the same bits on a second run (the split tiles' reduction is fixed)."""
    if not ops.gemm_sm90_built():
        pytest.skip("built without gemm_w8a16_sm90 (test_sm90_gemm_is_built says why)")
    w, s, x, xf = inputs(rng, M, N, K, x_dtype)
    y = xf @ dequant(w, s, x_dtype).T
    what = f"gemm_sm90 tile={tile} M={M} N={N} K={K} x {x_dtype}"
    check(ops.gemm_sm90(w, s, x, STORE, None, x_dtype, tile), y, RECIPE_REL, f"{what} Store")
    residual = rng.standard_normal(y.shape).astype(np.float32)
    a = ops.gemm_sm90(w, s, x, ADD, residual, x_dtype, tile)
    np.testing.assert_array_equal(a, ops.gemm_sm90(w, s, x, ADD, residual, x_dtype, tile))
    scale = float(np.linalg.norm(residual.astype(np.float64)) + np.linalg.norm(y))
    check(a, residual + y, RECIPE_REL, f"{what} AddResidual", scale=scale)
    if N % 16 == 0:
        F = N // 2
        want = silu_mul(y[:, :F], y[:, F:])
        got = from_bf16(ops.gemm_sm90(w, s, x, SWIGLU, None, x_dtype, tile))
        check(got, want, RECIPE_REL + BF16_OUT_REL, f"{what} SwiGLU", scale=max(float(np.linalg.norm(want)), BF16_TINY))


@pytest.mark.parametrize("swiglu", ["halves", "one"])
@pytest.mark.parametrize("x_dtype", ["bf16", "f16"])
@pytest.mark.parametrize("tile", ["xwide", "wide", "narrow"])
@pytest.mark.parametrize("M,N,K", [(1, 1040, 576), (100, 3072, 3072), (300, 16384, 3072)])
def test_gemm_sm90_swiglu_is_its_product_stored(rng, tile, M, N, K, x_dtype, swiglu):
    """SwiGLU either way (two launches of F rows, the up half's epilogue taking the gate half's fp32 y; or one
    launch of 2F rows and swiglu_rows): bf16(silu(gate) * up) of the very fp32 values Store gives for the whole
    [2F, K] weight on the same tile kind (a data-parallel kind sums each output in the same order whatever N).
    Host float32 arithmetic of the formula may differ from the device's expf by an ulp of fp32, so a rare
    output may round to the neighbouring bf16; anything more (a half paired with the wrong weight rows, scales
    of the wrong columns, the gate read from the wrong place) moves most outputs."""
    if not ops.gemm_sm90_built():
        pytest.skip("built without gemm_w8a16_sm90 (test_sm90_gemm_is_built says why)")
    w, s, x, _ = inputs(rng, M, N, K, x_dtype)
    y = ops.gemm_sm90(w, s, x, STORE, None, x_dtype, tile)
    F = N // 2
    gate, up = y[:, :F], y[:, F:]
    with np.errstate(over="ignore"):
        want = bf16_bits(gate / (np.float32(1) + np.exp(-gate)) * up).astype(np.int32)
    got = ops.gemm_sm90(w, s, x, SWIGLU, None, x_dtype, tile, swiglu=swiglu).astype(np.int32)
    ulps = np.abs(got - want)
    what = f"gemm_sm90 SwiGLU ({swiglu}) tile={tile} M={M} N={N} K={K} x {x_dtype}"
    assert ulps.max() <= 1, f"{what}: {int((ulps > 1).sum())} outputs off by more than one bf16 ulp (max {ulps.max()})"
    assert (ulps > 0).mean() < 1e-3, f"{what}: {int((ulps > 0).sum())} of {ulps.size} outputs differ by an ulp"


@pytest.mark.parametrize("M,N,K", [(17, 960, 576), (300, 3072, 8192)])
def test_gemm_sm90_pretransposed_scales_same_bits(rng, M, N, K):
    """The engine passes the scales transposed at load: the same bits as the launcher's own transpose."""
    if not ops.gemm_sm90_built():
        pytest.skip("built without gemm_w8a16_sm90 (test_sm90_gemm_is_built says why)")
    w, s, x, _ = inputs(rng, M, N, K, "bf16")
    for ep, init in ((STORE, None), (ADD, rng.standard_normal((M, N)).astype(np.float32)), (SWIGLU, None)):
        a = ops.gemm_sm90(w, s, x, ep, init, "bf16")
        b = ops.gemm_sm90(w, s, x, ep, init, "bf16", pretransposed=True)
        np.testing.assert_array_equal(a, b)


def test_gemm_sm90_rounding_is_the_weights_only(rng):
    """The quantified cost of the recipe: against the exact reference, the new kernel's error is the
    16-bit weight rounding (within a factor 2 of u / sqrt(3) both ways: not fp32-exact, and not twice
    rounded, e.g. a 16-bit scale first), and the recipe reference explains all of it."""
    if not ops.gemm_sm90_built():
        pytest.skip("built without gemm_w8a16_sm90 (test_sm90_gemm_is_built says why)")
    M, N, K = 256, 3072, 3072
    for x_dtype in ("bf16", "f16"):
        w, s, x, xf = inputs(rng, M, N, K, x_dtype)
        exact = xf @ dequant(w, s, None).T
        err = rel_l2(ops.gemm_sm90(w, s, x, STORE, None, x_dtype), exact)
        model = rel_l2(xf @ dequant(w, s, x_dtype).T, exact)  # the recipe's own distance to exact
        print(f"{x_dtype}: kernel vs exact {err:.2e}, recipe vs exact {model:.2e}, u/sqrt(3) {UNIT[x_dtype] / np.sqrt(3):.2e}")
        assert 0.5 * model < err < 1.5 * model, f"{x_dtype}: kernel error {err:.2e}, the recipe predicts {model:.2e}"


def test_gemm_sm90_rejects_bad_arguments():
    if not ops.gemm_sm90_built():
        pytest.skip("built without gemm_w8a16_sm90")
    w, s, x = np.zeros((16, 128), np.uint8), np.ones((16, 1), np.float32), np.zeros((4, 128), np.uint16)
    with pytest.raises(ValueError):
        ops.gemm_sm90(np.zeros((12, 128), np.uint8), np.ones((12, 1), np.float32), x)  # N % 8
    with pytest.raises(ValueError):
        ops.gemm_sm90(np.zeros((16, 96), np.uint8), np.ones((16, 1), np.float32), np.zeros((4, 96), np.uint16))  # K % 64
    with pytest.raises(ValueError):
        ops.gemm_sm90(w, s, x, ADD)  # AddResidual without out_init
    with pytest.raises(ValueError):
        ops.gemm_sm90(w, s, x, STORE, None, "f32")
    with pytest.raises(ValueError, match="tile"):
        ops.gemm_sm90(w, s, x, STORE, None, "bf16", "square")
