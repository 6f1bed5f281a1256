"""The skinny W8A16 GEMM (gemm_w8a16_skinny.cu, _core.ops.gemm_skinny: prompt chunks of 1..64 rows)
against a float64 numpy reference, on fresh random inputs with every output poisoned (NaN) before the
launch: awkward M (token tiles of 8, the 4 / 8 tile switch at 32), tail row groups and a 64-column tail
scale group (K % 128 == 64), every linear layer of the target models, every split of the scale groups
over a cluster, and the same bits on a second run. Skipped cleanly without the CUDA core or a GPU.

Precision (kernels.h): gemm_w8a16's recipe. The weights enter the tensor cores exactly (fp8 e4m3 is
exact in bf16 and fp16) and each group scale multiplies an fp32 partial sum, so against the exact
dequantized weights the error is fp32 accumulation's: rel-L2 < 1e-5, whatever the split (a split only
reorders fp32 sums). SwiGLU's output is rounded once to bf16 (4e-3, as tests/test_kernels_gpu.py).
An AddResidual error is relative to the terms of the sum, not to a sum that may nearly cancel."""

from __future__ import annotations

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")
from numerics import (  # noqa: E402
    ADD,
    MODEL_SHAPES,
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

ops, WHY_NOT = load_ops("gemm_skinny", "gemm_skinny_rope", "gemm_skinny_norm_out", "gemm_skinny_plan", "time_gemm_skinny")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(ops is None, reason=f"gpu: {WHY_NOT}")]

EPILOGUES = {STORE: "Store", ADD: "AddResidual", SWIGLU: "SwiGLU"}
FP32_REL, BF16_REL = 1e-5, 4e-3
BF16_TINY = 2.0**-126
MAX_ROWS, MAX_SPLITS, MAX_GROUPS = 64, 8, 24  # kernels.h: kSkinnyMaxRows, kSkinnyMaxSplits, kSkinnyMaxGroups
MAX_SMEM = 227 * 1024  # an sm_90 block's dynamic shared memory

M_AWKWARD = [1, 2, 7, 8, 9, 16, 17, 24, 31, 32, 33, 48, 63, 64]

# Every linear layer of the target models (the heads left out: the decode GEMV serves them), with the
# epilogue and input type the engine gives each; SmolLM2's K = 576 ends in a 64-column scale group.
MODELS = ("llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b", "smollm2-135m")
X_DTYPE = {"qkv": "f16", "o": "bf16", "gate_up": "f16", "down": "bf16"}


def model_shapes():
    """(N, K, epilogue, x_dtype) of each product."""
    for name in MODELS:
        marks = [pytest.mark.slow] if MODEL_SHAPES[name]["d"] >= 3584 else []
        for product, N, K, ep in linear_layers(name):
            yield pytest.param(N, K, ep, X_DTYPE[product], id=f"{name}-{product}", marks=marks)


# ----------------------------------------------------------------------------- helpers


def assert_close(got, want, tol, what, scale=None) -> float:
    """rel-L2 of got against want below tol (relative to `scale` when given); names the unwritten
    (poisoned) outputs where there are any."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    bad = ~np.isfinite(got)
    if bad.any():
        rows, cols = np.nonzero(bad)
        pytest.fail(
            f"{what}: {int(bad.sum())} non-finite outputs (unwritten: poisoned NaN), rows {rows.min()}..{rows.max()}, "
            f"columns {cols.min()}..{cols.max()}, first at {(int(rows[0]), int(cols[0]))}"
        )
    den = np.linalg.norm(want) if scale is None else scale
    err = float(np.linalg.norm(got - want) / max(den, 1e-300))
    if err >= tol:
        e = np.abs(got - want)
        i = np.unravel_index(int(np.argmax(e)), e.shape)
        pytest.fail(f"{what}: rel-L2 {err:.3e} >= {tol:.0e}; worst at (m={i[0]}, n={i[1]}): got {got[i]:.6g}, want {want[i]:.6g}")
    return err


class Case:
    """One random product: w u8 [N, K], scales, x [M, K] (x_dtype bits), its float64 reference y and
    an AddResidual starting value of the reference's magnitude."""

    def __init__(self, rng, M, N, K, x_dtype):
        self.M, self.N, self.K, self.x_dtype = M, N, K, x_dtype
        self.w, self.s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
        to_bits, from_bits = (bf16_bits, from_bf16) if x_dtype == "bf16" else (f16_bits, from_f16)
        self.x = to_bits(rng.standard_normal((M, K)))
        self.y = reference_linear(self.w, self.s, from_bits(self.x))
        self.init = (rng.standard_normal((M, N)) * (np.sqrt(np.mean(self.y**2)) + 1.0)).astype(np.float32)

    def run(self, ep, splits=0):
        return ops.gemm_skinny(self.w, self.s, self.x, ep, self.init if ep == ADD else None, self.x_dtype, splits)

    def check(self, got, ep, what) -> float:
        """got (the result of run(ep)) against the reference, at the epilogue's tolerance."""
        what = f"{what} {EPILOGUES[ep]}"
        if ep == STORE:
            return assert_close(got, self.y, FP32_REL, what)
        if ep == ADD:
            scale = float(np.linalg.norm(self.init.astype(np.float64)) + np.linalg.norm(self.y))
            return assert_close(got, self.init + self.y, FP32_REL, what, scale=scale)
        F = self.N // 2
        want = silu_mul(self.y[:, :F], self.y[:, F:])
        assert got.dtype == np.uint16, f"{what}: SwiGLU returns bf16 bits, got {got.dtype}"
        return assert_close(from_bf16(got), want, BF16_REL, what, scale=max(float(np.linalg.norm(want)), BF16_TINY))


def ceil_div(a, b):
    return -(-a // b)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("x_dtype", ["bf16", "f16"])
@pytest.mark.parametrize("M", M_AWKWARD)
@pytest.mark.parametrize("N,K", [(384, 640), (384, 576), (416, 640), (416, 576)])
def test_gemm_skinny_awkward_rows(rng, M, N, K, x_dtype):
    """Every epilogue on M around the token tiles of 8 and the 4 / 8 tile switch at 32; N = 416 ends in a
    partial 128-row group (SwiGLU: a partial 64-row gate group), K = 576 in a 64-column scale group."""
    c = Case(rng, M, N, K, x_dtype)
    for ep in (STORE, ADD, SWIGLU):
        c.check(c.run(ep), ep, f"gemm_skinny M={M} N={N} K={K} x {x_dtype}")


@pytest.mark.parametrize("M", [17, 32, 64])
@pytest.mark.parametrize("N,K,ep,x_dtype", list(model_shapes()))
def test_gemm_skinny_model_shapes(rng, M, N, K, ep, x_dtype):
    """Each product of the four models with its epilogue, on the plan's split; a second run gives the
    same bits (the cluster's partial sums are added in rank order)."""
    c = Case(rng, M, N, K, x_dtype)
    plan = ops.gemm_skinny_plan(M, N, K, ep, x_dtype)
    what = f"gemm_skinny M={M} N={N} K={K} x {x_dtype} (splits {plan['splits']})"
    got = c.run(ep)
    c.check(got, ep, what)
    np.testing.assert_array_equal(got, c.run(ep), err_msg=f"{what}: a second run gave other bits")


@pytest.mark.parametrize("M,N,K", [(33, 512, 1088), (5, 2 * 208, 576), (64, 1024, 2048)])
def test_gemm_skinny_every_split(rng, M, N, K):
    """Every split of the scale groups over a cluster asked for (1..8, at most the groups; K = 1088 has 9
    groups, the last 64 wide): each within fp32 accumulation of the reference, every epilogue, and each
    the same bits on a second run."""
    splits = range(1, min(MAX_SPLITS, ceil_div(K, 128)) + 1)
    for x_dtype in ("bf16", "f16"):
        c = Case(rng, M, N, K, x_dtype)
        for s in splits:
            plan = ops.gemm_skinny_plan(M, N, K, STORE, x_dtype, s)
            for ep in (STORE, ADD, SWIGLU):
                what = f"gemm_skinny M={M} N={N} K={K} x {x_dtype} splits={s} ({plan['splits']} x {plan['kg']} groups)"
                got = c.run(ep, s)
                c.check(got, ep, what)
                np.testing.assert_array_equal(got, c.run(ep, s), err_msg=f"{what} {EPILOGUES[ep]}: a second run gave other bits")


PLAN_SHAPES = [(N, K, ep) for N, K, ep, _ in (p.values for p in model_shapes())] + [(416, 576, SWIGLU), (384, 640, STORE)]


@pytest.mark.parametrize("N,K,ep", PLAN_SHAPES)
def test_gemm_skinny_plan(N, K, ep):
    """The plan's fields: token tiles 4 up to 32 rows and 8 past; its splits cover every scale group
    with none left empty (splits x kg >= groups > (splits - 1) x kg, kg within the kernel's limit); one
    block per 128 rows (SwiGLU: per 64 gate rows); 256 threads; shared memory within an SM's. An override
    of splits (the fewest that cover K, the most) sets kg = ceil(groups / splits), and never more splits."""
    groups = ceil_div(K, 128)
    rows = ceil_div(N // 2, 64) if ep == SWIGLU else ceil_div(N, 128)
    for M in (1, 8, 17, 32, 33, 64):
        for x_dtype in ("bf16", "f16"):
            for want_splits in (0, ceil_div(groups, MAX_GROUPS), min(MAX_SPLITS, groups)):
                p = ops.gemm_skinny_plan(M, N, K, ep, x_dtype, want_splits)
                what = f"plan M={M} N={N} K={K} {EPILOGUES[ep]} x {x_dtype} splits={want_splits}: {p}"
                assert p["nt"] == (4 if M <= 32 else 8), what
                assert 1 <= p["splits"] <= min(MAX_SPLITS, groups), what
                assert want_splits == 0 or (p["splits"] <= want_splits and p["kg"] == ceil_div(groups, want_splits)), what
                assert 1 <= p["kg"] <= MAX_GROUPS and p["splits"] * p["kg"] >= groups > (p["splits"] - 1) * p["kg"], what
                assert p["row_groups"] == rows, what
                assert p["threads"] == 256, what
                assert 0 < p["smem"] <= MAX_SMEM, what


# Splits measured fastest on an H100 (every split of every product timed at 8 / 16 / 32 rows: `python
# tools/bench_kernels.py --sections gemm_skinny_splits`, docs/design/gemm_w8a16_skinny.md): down needs the
# clusters the device really holds at once (a cluster sits in one GPC), not the SMs' block slots: 3B 8 splits
# (15.4-17.9 us against 7's 17.6-19.6), 8B 7 (28.7-31.6 against 5's 33.0-35.5; 8 splits do not fit at once,
# 35.7). 3B o 8, both gate_ups 2.
MEASURED_SPLITS = [
    ("3B down", 3072, 8192, ADD, "bf16", 8),
    ("8B down", 4096, 14336, ADD, "bf16", 7),
    ("3B o", 3072, 3072, ADD, "bf16", 8),
    ("3B gate_up", 16384, 3072, SWIGLU, "f16", 2),
    ("8B gate_up", 28672, 4096, SWIGLU, "f16", 2),
]


@pytest.mark.parametrize("what,N,K,ep,x_dtype,splits", MEASURED_SPLITS, ids=[m[0] for m in MEASURED_SPLITS])
def test_gemm_skinny_plan_takes_the_measured_splits(what, N, K, ep, x_dtype, splits):
    """On a 132-SM Hopper part (H100 SXM, H200) the plan's split of each product is the one measured
    fastest, at every row count the prompt path gives it."""
    from atomflow import _core

    if _core.device_info()["sm_count"] != 132:
        pytest.skip("the splits were measured on 132-SM parts")
    for M in (5, 8, 16, 32):
        assert ops.gemm_skinny_plan(M, N, K, ep, x_dtype)["splits"] == splits, f"{what} at {M} rows"


def test_gemm_skinny_timer():
    """The timer runs the plan's launch on a model shape and returns a time per launch."""
    us = ops.time_gemm_skinny(32, 3072, 3072, iters=3, epilogue=ADD)
    assert np.isfinite(us) and us > 0


def test_gemm_skinny_rejects_bad_arguments():
    def args(M, N, K):
        return np.zeros((N, K), np.uint8), np.ones((N, ceil_div(K, 128)), np.float32), np.zeros((M, K), np.uint16)

    with pytest.raises(ValueError, match="unsupported shape"):
        ops.gemm_skinny(*args(MAX_ROWS + 1, 128, 128))  # M = 65
    with pytest.raises(ValueError, match="unsupported shape"):
        ops.gemm_skinny(*args(0, 128, 128))  # no rows
    with pytest.raises(ValueError, match="unsupported shape"):
        ops.gemm_skinny(*args(4, 24, 128))  # N % 16
    with pytest.raises(ValueError, match="unsupported shape"):
        ops.gemm_skinny(*args(4, 128, 96))  # K % 64
    with pytest.raises(ValueError, match="unsupported shape"):
        ops.gemm_skinny(*args(4, 48, 128), SWIGLU)  # SwiGLU: N % 32
    with pytest.raises(ValueError, match="unsupported shape"):
        ops.gemm_skinny_plan(MAX_ROWS + 1, 128, 128)
    with pytest.raises(ValueError, match="unsupported shape"):
        ops.time_gemm_skinny(4, 128, 96, iters=1)
    with pytest.raises(ValueError, match="splits"):
        ops.gemm_skinny(*args(4, 128, 256), splits=3)  # 2 scale groups
    with pytest.raises(ValueError, match="splits"):
        ops.gemm_skinny_plan(4, 128, 2048, splits=MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="splits"):
        ops.gemm_skinny_plan(4, 128, 128 * (MAX_GROUPS + 1), splits=1)  # more groups than one split takes
    w, s, x = args(4, 128, 256)
    with pytest.raises(ValueError):
        ops.gemm_skinny(w, s, x, ADD)  # AddResidual without out_init
    with pytest.raises(ValueError):
        ops.gemm_skinny(w, s, x, STORE, np.zeros((4, 128), np.float32))  # out_init without AddResidual
    with pytest.raises(ValueError):
        ops.gemm_skinny(w, s, x, ADD, np.zeros((4, 64), np.float32))  # out_init's shape
    with pytest.raises(ValueError):
        ops.gemm_skinny(w, s, x, STORE, None, "f32")
    with pytest.raises(ValueError):
        ops.gemm_skinny(w, s, x.astype(np.float32))  # x must be 16-bit bits
    with pytest.raises(ValueError):
        ops.gemm_skinny(w, s[:, :1].copy(), x)  # scales [N, ceil(K / 128)]


@pytest.mark.parametrize(
    "H,Hkv,D,K,bias",
    [
        (24, 8, 128, 3072, False),  # Llama-3.2-3B
        (32, 8, 128, 4096, False),  # Llama-3.1-8B
        (9, 3, 64, 576, False),  # SmolLM2-135M: two heads a block, a 64-column tail scale group, a half last block
        (28, 4, 128, 3584, True),  # Qwen2.5-7B: q/k/v biases
        (4, 2, 32, 256, True),  # four heads a block
    ],
)
@pytest.mark.parametrize("M,splits", [(1, 0), (9, 0), (17, 0), (32, 0), (33, 0), (64, 0), (17, 1), (32, 2)])
@pytest.mark.parametrize("pos,C", [(0, 80), (4093, 4100)])  # the second: the last rows past the cache
def test_gemm_skinny_rope_equals_store_then_rope(rng, H, Hkv, D, K, bias, M, splits, pos, C):
    """The QKV product with RoPE + KV append in its epilogue writes exactly what the Store product followed by
    rope_kv_append writes, bit for bit: q of every row, the K / V rows of the positions inside the cache, and
    nothing else of the caches."""
    N = (H + 2 * Hkv) * D
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = f16_bits(rng.standard_normal((M, K)))
    b = (rng.standard_normal(N) * 0.5).astype(np.float32) if bias else None
    inv_freq = llama_inv_freq(D)
    kc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))  # random rows everywhere, so a stray write shows
    vc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    groups = -(-K // 128)
    sp = 0 if splits == 0 else min(max(splits, -(-groups // MAX_GROUPS)), groups)  # a split the shape takes
    got = ops.gemm_skinny_rope(w, s, x, inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy(), b, "f16", sp)
    qkv = ops.gemm_skinny(w, s, x, STORE, None, "f16", sp)
    want = ops.rope_kv_append(qkv, inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy(), bias=b)
    assert_rope_writes(got, want, kc0, vc0, pos, M)


def test_gemm_skinny_rope_rejects_bad_arguments(rng):
    K = 256
    x = f16_bits(np.ones((4, K)))
    for H, Hkv, D in ((2, 1, 256), (2, 1, 48), (3, 1, 12)):  # head_dim must divide 128 and be a multiple of 8
        N = (H + 2 * Hkv) * D
        kc = bf16_bits(np.zeros((8, Hkv, D)))
        w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
        with pytest.raises(ValueError, match="head_dim"):
            ops.gemm_skinny_rope(w, s, x, llama_inv_freq(D), 0, H, Hkv, D, kc, kc.copy(), None, "f16")
    H, Hkv, D = 2, 1, 64
    w, s = random_fp8(rng, (4 * D, K)), random_scales(rng, 4 * D, K)
    kc = bf16_bits(np.zeros((8, Hkv, D)))
    with pytest.raises(ValueError):  # w's rows are not (H + 2 Hkv) D
        ops.gemm_skinny_rope(w[: 3 * D], s[: 3 * D], x, llama_inv_freq(D), 0, H, Hkv, D, kc, kc.copy(), None, "f16")
    with pytest.raises(ValueError):  # the caches' head_dim
        ops.gemm_skinny_rope(w, s, x, llama_inv_freq(D), 0, H, Hkv, D, kc[:, :, :32].copy(), kc.copy(), None, "f16")
    with pytest.raises(ValueError):  # epilogue 3 (RopeKV) is gemm_skinny_rope's, not gemm_skinny's
        ops.gemm_skinny(w, s, x, 3)


# ------------------------------------------------------------------------------ the split RMSNorm
NORM_OUT_SHAPES = [
    pytest.param(3072, 3072, id="3b-o"),
    pytest.param(3072, 8192, id="3b-down"),
    pytest.param(576, 1536, id="smollm2-down"),  # N = 576: a row group half past the end
    pytest.param(4096, 14336, id="8b-down", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("N,K", NORM_OUT_SHAPES)
@pytest.mark.parametrize("M", [1, 5, 17, 32, 64])
def test_gemm_skinny_norm_out(rng, N, K, M):
    """The AddResidual product with a split RMSNorm's first half: out is the plain product's, bit for bit;
    xw = bf16(out * norm_w) (fp32 product, rounded to nearest even); ss holds, per row, the sum of squares of
    each row group's 128 columns (the cluster's blocks added in split order)."""
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = bf16_bits(rng.standard_normal((M, K)))
    out0 = (rng.standard_normal((M, N)) * 4).astype(np.float32)
    nw = bf16_bits(rng.uniform(0.2, 2.0, N))
    out, xw, ss = ops.gemm_skinny_norm_out(w, s, x, out0, nw, "bf16")
    np.testing.assert_array_equal(out, ops.gemm_skinny(w, s, x, ADD, out0, "bf16"))
    np.testing.assert_array_equal(xw, bf16_bits(out * from_bf16(nw).astype(np.float32)[None, :]))
    plan = ops.gemm_skinny_plan(M, N, K, ADD, "bf16")
    assert ss.shape == (M, plan["row_groups"]) == (M, -(-N // 128))
    sq = out.astype(np.float64) ** 2
    for rg in range(ss.shape[1]):
        want = sq[:, rg * 128 : (rg + 1) * 128].sum(axis=1)
        np.testing.assert_allclose(ss[:, rg], want, rtol=FP32_REL, atol=0, err_msg=f"row group {rg}")


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_gemm_skinny_norm_out_any_split(rng, splits):
    """Whatever the cluster's split, a row group's sum of squares covers its 128 columns once."""
    N, K, M = 640, 3072, 9
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = bf16_bits(rng.standard_normal((M, K)))
    out0 = np.zeros((M, N), np.float32)
    out, _, ss = ops.gemm_skinny_norm_out(w, s, x, out0, bf16_bits(np.ones(N)), "bf16", splits)
    want = (out.astype(np.float64) ** 2).reshape(M, N // 128, 128).sum(axis=2)
    np.testing.assert_allclose(ss, want, rtol=FP32_REL, atol=0)


NORM_IN_SHAPES = [
    pytest.param(5120, 3072, STORE, id="3b-qkv-store"),
    pytest.param(16384, 3072, SWIGLU, id="3b-gate_up"),
    pytest.param(3072, 576, SWIGLU, id="smollm2-gate_up"),
]


@pytest.mark.parametrize("N,K,ep", NORM_IN_SHAPES)
@pytest.mark.parametrize("M", [1, 5, 17, 32])
def test_gemm_skinny_norm_in(rng, N, K, ep, M):
    """A split RMSNorm's second half: each row's sums times rsqrt(sum of its P sums of squares / d + eps),
    before the epilogue (SwiGLU's gate and up both), against the plain product scaled in float64."""
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = bf16_bits(rng.standard_normal((M, K)))
    d, eps, P = K, 1e-5, 24 if M % 2 else 72  # 72: past the 64 sums a warp's lanes load at once
    ss = (rng.uniform(0.0, 2.0, (M, P)) * d / P).astype(np.float32)
    r = 1.0 / np.sqrt(ss.astype(np.float64).sum(axis=1) / d + eps)
    got = ops.gemm_skinny(w, s, x, ep, None, "bf16", norm_ss=ss, norm_d=d, norm_eps=eps)
    y = reference_linear(w, s, from_bf16(x)) * r[:, None]
    if ep == SWIGLU:
        assert_close(from_bf16(got), silu_mul(y[:, : N // 2], y[:, N // 2 :]), BF16_REL, "norm_in SwiGLU")
    else:
        plain = ops.gemm_skinny(w, s, x, ep, None, "bf16")
        np.testing.assert_allclose(got, plain * r[:, None].astype(np.float32), rtol=FP32_REL, atol=0)
        assert_close(got, y, FP32_REL, "norm_in Store")


@pytest.mark.parametrize("M", [5, 32])
def test_gemm_skinny_rope_norm_in(rng, M):
    """The QKV product with RoPE + KV append normalizes its sums first: q and the cache rows are r times the
    plain product's, up to bf16's rounding (the rotation is linear; no bias)."""
    H, Hkv, D, K, pos, C = 4, 2, 64, 1024, 3, 64
    N = (H + 2 * Hkv) * D
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = bf16_bits(rng.standard_normal((M, K)))
    ss = rng.uniform(0.5, 4.0, (M, 40)).astype(np.float32)
    r = 1.0 / np.sqrt(ss.astype(np.float64).sum(axis=1) / K + 1e-5)
    kc0 = bf16_bits(np.zeros((C, Hkv, D)))
    got = ops.gemm_skinny_rope(
        w, s, x, llama_inv_freq(D), pos, H, Hkv, D, kc0.copy(), kc0.copy(), None, "bf16", norm_ss=ss, norm_d=K, norm_eps=1e-5
    )
    plain = ops.gemm_skinny_rope(w, s, x, llama_inv_freq(D), pos, H, Hkv, D, kc0.copy(), kc0.copy(), None, "bf16")
    scale = r[:, None, None]
    assert_close(from_bf16(got[0]), from_bf16(plain[0]) * scale, 2 * BF16_REL, "norm_in q")
    rows = slice(pos, pos + M)
    for name, c_got, c_plain in zip(("k", "v"), got[1:], plain[1:]):
        assert_close(from_bf16(c_got[rows]), from_bf16(c_plain[rows]) * scale, 2 * BF16_REL, f"norm_in {name} cache")
        np.testing.assert_array_equal(c_got[:pos], c_plain[:pos])  # no other row written


def test_gemm_skinny_norm_in_needs_bf16_x(rng):
    N, K, M = 256, 256, 4
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    ss = np.ones((M, 8), np.float32)
    with pytest.raises((ValueError, RuntimeError), match="norm_in"):
        ops.gemm_skinny(w, s, f16_bits(np.ones((M, K))), STORE, None, "f16", norm_ss=ss, norm_d=K)
    with pytest.raises((ValueError, RuntimeError), match="norm_in"):  # AddResidual leaves a norm, not takes one
        ops.gemm_skinny(w, s, bf16_bits(np.ones((M, K))), ADD, np.zeros((M, N), np.float32), "bf16", norm_ss=ss, norm_d=K)
