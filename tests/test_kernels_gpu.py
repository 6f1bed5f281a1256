"""Rung 1 of the correctness ladder: every CUDA kernel (atomflow._core.ops) against a float64 numpy
reference, on fresh random inputs (the seed is printed, so a failure can be replayed with
ATOMFLOW_TEST_SEED=<seed>) and awkward sizes. The harness poisons every output with 0xFF bytes
(NaN, or -1 for ints) before the launch, so an element the kernel forgets to write cannot pass.

Tolerances follow from the input precision: the references use the exact dequantized weights
(fp8 * scale) and the exact bf16 inputs, so fp32 accumulation must match to rel-L2 < 1e-5; an
output rounded once to bf16 is allowed ~4e-3 (its relative rounding error is <= 2^-9).
Skipped cleanly without the CUDA core or a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")
FP8 = ml_dtypes.float8_e4m3fn
from numerics import MODEL_SHAPES, bf16_bits, f16_bits, from_bf16, from_f16, linear_layers, load_ops  # noqa: E402

ops, WHY_NOT = load_ops()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(ops is None, reason=f"gpu: {WHY_NOT}")]

FP32_REL, BF16_REL, F16_REL = 1e-5, 4e-3, 5e-4


# ----------------------------------------------------------------------------- helpers


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def assert_close(got, want, tol: float, what: str, scale: float | None = None) -> None:
    """rel-L2 of got against want below tol; the error is relative to `scale` when given (the
    norm of the terms a result is a sum of), else to the norm of want."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    bad = ~np.isfinite(got)
    assert not bad.any(), f"{what}: {int(bad.sum())} non-finite outputs (unwritten?), first at {np.argwhere(bad)[0]}"
    if scale is None:
        err = rel_l2(got, want)
    else:
        err = float(np.linalg.norm(got - np.asarray(want, np.float64)) / max(scale, 1e-300))
    assert err < tol, f"{what}: rel-L2 {err:.3e} >= {tol:.0e}"


BF16_TINY = 2.0**-126  # bf16's smallest normal (fp32's too)
FP8_TO_F64 = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float64)


def random_fp8(rng, shape) -> np.ndarray:
    """Uniformly random e4m3 codes (zeros, subnormals and +-448 included), NaN codes excluded."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] ^= 1  # 0x7F / 0xFF (NaN) -> +-448
    return b


def random_scales(rng, n, k) -> np.ndarray:
    """Scales spread over 8 binades, so a scale applied to the wrong group shows."""
    return (2.0 ** rng.uniform(-12, -4, size=(n, k // 128))).astype(np.float32)


def reference_linear(w: np.ndarray, scales: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 x [M, K] @ (fp8 w [N, K] * scale).T, dequantized exactly, in row chunks."""
    n, k = w.shape
    y = np.empty((x.shape[0], n))
    step = max(1, (1 << 24) // k)
    for r in range(0, n, step):
        wd = FP8_TO_F64[w[r : r + step]].reshape(-1, k // 128, 128) * scales[r : r + step, :, None]
        y[:, r : r + step] = x @ wd.reshape(-1, k).T
    return y


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return gate / (1.0 + np.exp(-gate)) * up


def check_linear(rng, N: int, K: int, M: int | None, x_dtype: str = "bf16") -> None:
    """All three epilogues of gemv (M None) or gemm (M rows) on one random weight matrix, with a
    bf16 or fp16 activation input."""
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    shape = (K,) if M is None else (M, K)
    to_bits, from_bits = (bf16_bits, from_bf16) if x_dtype == "bf16" else (f16_bits, from_f16)
    x = to_bits(rng.standard_normal(shape))
    y = reference_linear(w, s, from_bits(x).reshape(-1, K))
    y = y[0] if M is None else y
    gemx = ops.gemv if M is None else ops.gemm

    def run(w, s, x, ep, out_init=None):
        return gemx(w, s, x, ep, out_init, x_dtype)

    what = f"{'gemv' if M is None else f'gemm M={M}'} N={N} K={K} x {x_dtype}"

    assert_close(run(w, s, x, 0), y, FP32_REL, f"{what} Store")
    residual = (rng.standard_normal(y.shape) * (np.sqrt(np.mean(y**2)) + 1.0)).astype(np.float32)
    # The error of a sum is relative to its terms, not to the result: where residual + y nearly
    # cancels (one output, N = 1), a relative-to-result bound would fail on a correct kernel.
    got = np.asarray(run(w, s, x, 1, residual), np.float64)
    assert_close(
        got, residual + y, FP32_REL, f"{what} AddResidual", scale=np.linalg.norm(residual.astype(np.float64)) + np.linalg.norm(y)
    )
    if N % 2 == 0:
        F = N // 2
        want = silu_mul(y[..., :F], y[..., F:])
        # Relative to at least bf16's smallest normal: where every gate is far below zero, the exact
        # products (1e-46 and less, seen with N = 6) lie below the range of the bf16 output and of
        # the fp32 arithmetic, and 0 is the right answer there.
        assert_close(
            from_bf16(run(w, s, x, 2)), want, BF16_REL, f"{what} SwiGLU", scale=max(float(np.linalg.norm(want)), BF16_TINY)
        )


# Every linear layer of the three target models: (name, N, K), and their head.
MODELS = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b")
VOCAB = 128256


def model_shapes():
    for name in MODELS:
        for product, N, K, _ in linear_layers(name):
            yield pytest.param(N, K, id=f"{name}-{product}")
        yield pytest.param(VOCAB, MODEL_SHAPES[name]["d"], id=f"{name}-lm_head", marks=pytest.mark.slow)


# (6, 12288): x staged in exactly 48 KB of shared memory, the default limit (static memory on top).
# (9000, 256) and (9000, 4224): several row pairs per warp, with a row's chunks ending inside a warp's
# first 32 (all lanes must still take the same trips through the warp-wide products).
ODD_SHAPES = [
    (1, 128),
    (2, 128),
    (7, 384),
    (14, 256),
    (129, 1024),
    (258, 640),
    (1001, 4096),
    (3, 14336),
    (6, 12288),
    (9000, 256),
    (9000, 4224),
]


# ----------------------------------------------------------------------------- gemv / gemm


@pytest.mark.parametrize("N,K", list(model_shapes()))
def test_gemv_model_shapes(rng, N, K):
    check_linear(rng, N, K, None)


@pytest.mark.parametrize("N,K", ODD_SHAPES)
def test_gemv_odd_shapes(rng, N, K):
    check_linear(rng, N, K, None)


@pytest.mark.parametrize("mag", ["1e6", "1e-20", "wide"])
def test_gemv_bf16_beyond_fp16_range(rng, mag):
    """bf16 activations far outside fp16's range: the GEMV's tensor-core products take fp16, so bf16
    x is scaled by a power of two first; the result must still be the fp32 one (no overflow to
    inf, no flush of small values)."""
    N, K = 258, 3072
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    scale = 10.0 ** rng.uniform(-20, 20, K) if mag == "wide" else float(mag)
    x = bf16_bits(rng.standard_normal(K) * scale)
    y = reference_linear(w, s, from_bf16(x)[None])[0]
    assert_close(ops.gemv(w, s, x, 0, None, "bf16"), y, FP32_REL, f"gemv bf16 x ~ {mag}")


@pytest.mark.parametrize("N,K", [(5120, 3072), (16384, 3072), (129, 1024), (7, 384)])
@pytest.mark.parametrize("M", [None, 37])
def test_linear_f16_input(rng, N, K, M):
    """The RMSNorm output is fp16: gemv and gemm run fp16 activations too (f16 mma in the gemm)."""
    check_linear(rng, N, K, M, "f16")


@pytest.mark.parametrize("N,K", [(5120, 3072), (16384, 3072), (7, 384), (258, 640), (6, 14336)])
def test_gemv_rmsnorm_equals_rmsnorm_then_gemv(rng, N, K):
    """The fused prologue is the rmsnorm kernel's arithmetic: the two paths agree to the bit."""
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = (rng.standard_normal(K) * rng.uniform(0.1, 10)).astype(np.float32)
    nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
    xn = ops.rmsnorm(x[None], nw, 1e-5)[0]  # fp16 bits
    for ep in (0, 2) if N % 2 == 0 else (0,):
        np.testing.assert_array_equal(ops.gemv_rmsnorm(w, s, x, nw, 1e-5, ep), ops.gemv(w, s, xn, ep, None, "f16"))
    residual = rng.standard_normal(N).astype(np.float32)
    np.testing.assert_array_equal(ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 1, residual), ops.gemv(w, s, xn, 1, residual, "f16"))
    # and both against the fp32 reference of the normalized input
    ref = reference_linear(w, s, from_f16(xn).reshape(1, K))[0]
    assert_close(ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 0), ref, FP32_REL, f"gemv_rmsnorm N={N} K={K}")


def order_keys(x: np.ndarray) -> np.ndarray:
    """order_key (order_key.cuh) in numpy: float32 -> uint32, monotone, -0 tied with +0."""
    b = np.asarray(x, np.float32).view(np.uint32).copy()
    b[b == 0x80000000] = 0
    return np.where(b & 0x80000000, ~b, b | 0x80000000).astype(np.uint32)


def argmax_keys(x: np.ndarray) -> np.ndarray:
    rows = np.arange(len(x), dtype=np.uint64)
    return (order_keys(x).astype(np.uint64) << np.uint64(32)) | (~rows & np.uint64(0xFFFFFFFF))


@pytest.mark.parametrize("N,K", [(128256, 3072), (5000, 1024), (2 * 2112 + 3, 384), (7, 384), (1, 128)])
def test_gemv_rmsnorm_argmax_leaves_each_blocks_argmax(rng, N, K):
    """The head's launch: the logits of gemv_rmsnorm (Store) to the bit, and in block_best[b] the
    largest argmax key over the rows block b wrote (row pairs p with p % blocks == b), so their max
    is the argmax of the logits with the lowest index on ties."""
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = (rng.standard_normal(K) * rng.uniform(0.1, 10)).astype(np.float32)
    nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
    tied = []
    if N >= 3:  # three rows tie for the max (a row's sum does not depend on its neighbours)
        top = int(np.argmax(ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 0)))
        tied = [top] + [int(r) for r in rng.choice(np.setdiff1d(np.arange(N), [top]), 2, replace=False)]
        for r in tied[1:]:
            w[r], s[r] = w[top], s[top]
    out, best = ops.gemv_rmsnorm_argmax(w, s, x, nw, 1e-5)
    if tied:
        assert len(set(out[tied].tolist())) == 1 and out[tied[0]] == out.max()
    np.testing.assert_array_equal(out, ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 0))
    blocks = ops.gemv_argmax_blocks(N, K)
    assert best.shape == (blocks,)
    keys = argmax_keys(out)
    row_block = (np.arange(N) // 2) % blocks
    want = np.zeros(blocks, np.uint64)
    np.maximum.at(want, row_block, keys)
    np.testing.assert_array_equal(best, want)
    argmax = int(~np.uint32(best.max() & np.uint64(0xFFFFFFFF)))
    assert argmax == int(np.argmax(out)) == (min(tied) if tied else int(np.argmax(out)))


def resident_warps() -> int:
    from atomflow import _core

    return 16 * _core.device_info()["sm_count"]  # the GEMV: 2 blocks of 8 warps per SM


def assert_same_bits(got: dict, plain: dict, what: str):
    """The outputs of the default schedule (`got`) and of the schedule a plan override gives (`plain`,
    computed in the same process), bit for bit."""
    assert sorted(plain) == sorted(got)
    for name, want in got.items():
        np.testing.assert_array_equal(want, plain[name], err_msg=f"{what}: {name}")


def test_gemv_qkv_staged_warps_plan():
    """Which decode QKV launches copy a warp's second row pair into shared memory early: rows of
    one iteration (K a multiple of 512, at most 4096) with more row pairs than resident warps and at
    most twice as many; the count is the warps of a block that have a second pair. None with the plan's
    staged_pair=False."""
    W = resident_warps()
    blocks = W // 8
    cases = [
        (24, 8, 128, 3072),
        (32, 8, 128, 4096),  # 3B, 8B
        (30, 6, 128, 2560),
        (28, 4, 128, 3584),
        (56, 8, 64, 3072),
        (32, 8, 64, 2048),
        (3, 1, 64, 384),  # 1B: fewer pairs than warps
        (24, 8, 128, 4608),
        (24, 8, 128, 3200),  # K > 4096; K not a multiple of 512
        (60, 8, 128, 3072),  # more than two pairs per warp on up to 150 SMs
        (48, 8, 128, 2048),
    ]  # 4096 pairs: 8 staged warps per block on 132 SMs, 2 of them not early
    for H, Hkv, D, K in cases:
        pairs = (H + 2 * Hkv) * D // 2
        want = 0
        if K % 512 == 0 and K <= 4096 and W < pairs <= 2 * W:
            want = -(-(pairs - W) // blocks)
        assert ops.gemv_qkv_staged_warps(H, Hkv, D, K) == want, (H, Hkv, D, K)
        assert ops.gemv_qkv_staged_warps(H, Hkv, D, K, staged_pair=False) == 0, (H, Hkv, D, K)
    assert ops.gemv_qkv_staged_warps(24, 8, 128, 3072) > 0


def test_gemv_qkv_staged_pair_same_bits(rng):
    """The second row pair summed from shared memory is the register path's arithmetic: the QKV
    launch writes the same q and cache rows as with the copies off (the plan's staged_pair=False, in
    the same process), on shapes that stage."""
    # H, Hkv, D, K, position; the last stages warps that did not load early (kQkvPreWarps) on 132 SMs
    cases = [
        (24, 8, 128, 3072, 77),
        (32, 8, 128, 4096, 5),
        (30, 6, 128, 2560, 1000),
        (28, 4, 128, 3584, 0),
        (56, 8, 64, 3072, 31),
        (48, 8, 128, 2048, 9),
    ]
    inputs, got = {}, {}
    for j, (H, Hkv, D, K, pos) in enumerate(cases):
        N = (H + 2 * Hkv) * D
        if ops.gemv_qkv_staged_warps(H, Hkv, D, K) == 0:
            continue  # a GPU of another size: this shape does not stage there
        w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
        xf = (rng.standard_normal(K) * 3).astype(np.float32)
        nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
        kc = bf16_bits(rng.standard_normal((pos + 3, Hkv, D)))
        vc = bf16_bits(rng.standard_normal((pos + 3, Hkv, D)))
        inputs.update({f"w{j}": w, f"s{j}": s, f"x{j}": xf, f"n{j}": nw, f"k{j}": kc, f"v{j}": vc})
        q, k, v = ops.gemv_rmsnorm_rope(w, s, xf, nw, 1e-5, llama_inv_freq(D), pos, H, Hkv, D, kc.copy(), vc.copy())
        got.update({f"q{j}": q, f"k{j}": k, f"v{j}": v})
    assert "q0" in got, "the 3B QKV shape does not stage on this GPU"
    assert ops.gemv_qkv_staged_warps(24, 8, 128, 3072, staged_pair=False) == 0
    plain = {}
    for j, (H, Hkv, D, _K, pos) in enumerate(cases):
        if f"w{j}" not in inputs:
            continue
        z = {name[0]: inputs[name] for name in (f"w{j}", f"s{j}", f"x{j}", f"n{j}", f"k{j}", f"v{j}")}
        q, k, v = ops.gemv_rmsnorm_rope(
            z["w"],
            z["s"],
            z["x"],
            z["n"],
            1e-5,
            llama_inv_freq(D),
            pos,
            H,
            Hkv,
            D,
            z["k"].copy(),
            z["v"].copy(),
            staged_pair=False,
        )
        plain.update({f"q{j}": q, f"k{j}": k, f"v{j}": v})
    assert_same_bits(got, plain, "staged != register path")


# SwiGLU shapes with more row pairs than resident warps: the gate/up products of 3B, 8B and 1B, a K
# that is not a multiple of 512, a K whose chunks end inside a warp's first 32.
TICKET_SHAPES = [(16384, 3072), (28672, 4096), (16384, 2048), (2 * 9001, 4224), (2 * 9000, 256)]


def test_gemv_swiglu_ticketed_plan():
    """Which SwiGLU launches hand their row pairs past the first round out by ticket: those with more
    row pairs than the grid's warps, with or without the fused RMSNorm; none with the plan's
    tickets=False."""
    W = resident_warps()
    for N, K in TICKET_SHAPES + [(258, 640), (2 * W, 3072), (2 * W + 2, 3072)]:
        for norm in (False, True):
            want = N // 2 > W
            assert ops.gemv_swiglu_ticketed(N, K, norm) == want, (N, K, norm)
            assert not ops.gemv_swiglu_ticketed(N, K, norm, tickets=False), (N, K, norm)
    with pytest.raises(ValueError):
        ops.gemv_swiglu_ticketed(257, 640)


def test_gemv_swiglu_tickets_same_bits(rng):
    """A row pair's sums do not depend on which warp takes it: the ticketed SwiGLU launches write the
    same bits as the fixed schedule (the plan's tickets=False, in the same process), for bf16, fp16 and
    RMSNorm inputs."""
    inputs, got = {}, {}
    for j, (N, K) in enumerate(TICKET_SHAPES):
        assert ops.gemv_swiglu_ticketed(N, K, True) == (N // 2 > resident_warps())
        w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
        xb = bf16_bits(rng.standard_normal(K) * 2)
        xh = f16_bits(rng.standard_normal(K))
        xf = (rng.standard_normal(K) * 3).astype(np.float32)
        nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
        inputs.update({f"w{j}": w, f"s{j}": s, f"xb{j}": xb, f"xh{j}": xh, f"xf{j}": xf, f"n{j}": nw})
        got[f"b{j}"] = ops.gemv(w, s, xb, 2, None, "bf16")
        got[f"h{j}"] = ops.gemv(w, s, xh, 2, None, "f16")
        got[f"r{j}"] = ops.gemv_rmsnorm(w, s, xf, nw, 1e-5, 2)
    assert not ops.gemv_swiglu_ticketed(16384, 3072, True, tickets=False)
    plain = {}
    for j in range(len(TICKET_SHAPES)):
        w, s = inputs[f"w{j}"], inputs[f"s{j}"]
        plain[f"b{j}"] = ops.gemv(w, s, inputs[f"xb{j}"], 2, None, "bf16", tickets=False)
        plain[f"h{j}"] = ops.gemv(w, s, inputs[f"xh{j}"], 2, None, "f16", tickets=False)
        plain[f"r{j}"] = ops.gemv_rmsnorm(w, s, inputs[f"xf{j}"], inputs[f"n{j}"], 1e-5, 2, tickets=False)
    assert_same_bits(got, plain, "tickets != fixed schedule")


def test_gemv_swiglu_tickets_every_launch(rng):
    """Each launch leaves its ticket counters at zero for the next: launches of two ticketed shapes
    (different pair counts on the same counters) and an unticketed one, interleaved, each write
    every output (poisoned before each run) with the same bits as the first launch of their shape."""
    shapes = [(16384, 3072), (2 * 9001, 4224), (258, 640)]
    data = []
    for N, K in shapes:
        w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
        x = bf16_bits(rng.standard_normal(K))
        want = silu_mul(*np.split(reference_linear(w, s, from_bf16(x)[None])[0], 2))
        data.append((w, s, x, want))
    first = {}
    for i in range(12):
        j = i % len(shapes)
        w, s, x, want = data[j]
        y = ops.gemv(w, s, x, 2, None, "bf16")
        assert_close(
            from_bf16(y), want, BF16_REL, f"launch {i} of {shapes[j]}", scale=max(float(np.linalg.norm(want)), BF16_TINY)
        )
        np.testing.assert_array_equal(y, first.setdefault(j, y), err_msg=f"launch {i} of {shapes[j]}")


@pytest.mark.parametrize("N,K", list(model_shapes()))
def test_gemm_model_shapes(rng, N, K):
    check_linear(rng, N, K, 37)


@pytest.mark.parametrize("M", [2, 5, 17, 128, 130, 257])
@pytest.mark.parametrize("N,K", [(1, 128), (7, 384), (129, 1024), (258, 640), (3072, 3072)])
def test_gemm_odd_shapes(rng, M, N, K):
    check_linear(rng, N, K, M)


def test_linear_rejects_bad_arguments():
    w, s, x = np.zeros((4, 128), np.uint8), np.ones((4, 1), np.float32), np.zeros(128, np.uint16)
    with pytest.raises(ValueError):
        ops.gemv(w, s, x.astype(np.float32))  # x must be bf16 bits
    with pytest.raises(ValueError):
        ops.gemv(np.zeros((4, 100), np.uint8), np.ones((4, 1), np.float32), np.zeros(100, np.uint16))  # K % 64
    with pytest.raises(ValueError):
        ops.gemv(np.zeros((3, 128), np.uint8), np.ones((3, 1), np.float32), x, 2)  # SwiGLU needs even N
    with pytest.raises(ValueError):
        ops.gemv(w, s, x, 1)  # AddResidual without out_init


F16_MAX = 65504.0


@pytest.mark.parametrize("N,K", [(16384, 3072), (28672, 4096), (258, 640), (6, 14336)])
def test_gemv_swiglu_f16_output(rng, N, K):
    """The decode step's SwiGLU output is fp16 (kernels.h), fused prologue or not: the same bits both
    ways, the reference within fp16's rounding, and the overflow flag set exactly when some output
    of the reference passes fp16's range (the input scaled up until it does)."""
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = (rng.standard_normal(K) * rng.uniform(0.1, 10)).astype(np.float32)
    nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
    F = N // 2
    for c in (1.0, 30.0, 1000.0, 8000.0):
        what = f"SwiGLU f16 N={N} K={K} x {c:g}"
        xs = f16_bits(np.clip(from_f16(ops.rmsnorm(x[None], nw, 1e-5)[0]) * c, -6e4, 6e4))  # the prologue's x, scaled
        plain, flag = ops.gemv(w, s, xs, 2, None, "f16", "f16")
        y = reference_linear(w, s, from_f16(xs).reshape(1, K))[0]
        want = silu_mul(y[:F], y[F:])
        big = np.abs(want) > F16_MAX
        if np.any(np.abs(np.abs(want) / F16_MAX - 1) < 1e-3):
            continue  # an output within fp32's error of the edge: either flag is right
        assert flag == int(big.any()), f"{what}: flag {flag}, {int(big.sum())} outputs past fp16"
        if big.any():
            continue  # the outputs left in range are the ones whose gate or up cancelled: no bound
        assert_close(from_f16(plain), want, F16_REL, what, scale=max(float(np.linalg.norm(want)), 2.0**-14))
        if c == 1.0:  # the fused prologue: the same bits and flag
            fused, flag_fused = ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 2, None, "f16")
            np.testing.assert_array_equal(fused, plain)
            assert flag_fused == flag, what


def test_gemv_f16_output_is_swiglus_only(rng):
    w, s = random_fp8(rng, (4, 128)), random_scales(rng, 4, 128)
    x = bf16_bits(rng.standard_normal(128))
    with pytest.raises(ValueError, match="SwiGLU"):
        ops.gemv(w, s, x, 0, None, "bf16", "f16")
    with pytest.raises(ValueError, match="out_dtype"):
        ops.gemv(w, s, x, 2, None, "bf16", "f32")


# ----------------------------------------------------------------------------- attention


def reference_attention(q, kc, vc, pos, scale):
    """float64 causal GQA attention: query m (position pos + m) sees cache rows [0, pos + m]."""
    M, H, D = q.shape
    Hkv = kc.shape[1]
    G = H // Hkv
    qf, kf, vf = from_bf16(q), from_bf16(kc), from_bf16(vc)
    out = np.empty((M, H, D))
    for m in range(M):
        n = pos + m + 1
        for h in range(Hkv):
            s = qf[m, h * G : (h + 1) * G] @ kf[:n, h].T * scale  # [G, n]
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[m, h * G : (h + 1) * G] = (p / p.sum(axis=1, keepdims=True)) @ vf[:n, h]
    return out


def attention_inputs(rng, M, context, Hkv, G, D, spare):
    """M queries (bf16 [M, Hkv G, D]) whose last sees `context` keys, a bf16 cache of context + spare
    rows whose rows past the context hold NaN (a kernel reading outside the causal range fails), the
    first query's position and the softmax scale."""
    kc = bf16_bits(rng.standard_normal((context + spare, Hkv, D)))
    vc = bf16_bits(rng.standard_normal((context + spare, Hkv, D)))
    kc[context:] = vc[context:] = 0x7FC0  # bf16 NaN
    q = bf16_bits(rng.standard_normal((M, Hkv * G, D)) * 2.0)
    return q, kc, vc, context - M, 1.0 / np.sqrt(D)


def check_attention(rng, M, context, Hkv, G, D, early=False):
    """M queries, the last one seeing `context` keys; cache rows past the context hold NaN, so a
    kernel reading outside the causal range fails. early: the decode engine's mode (cached rows read
    before the kernel's PDL wait, the newest after it)."""
    q, kc, vc, pos, scale = attention_inputs(rng, M, context, Hkv, G, D, spare=3)
    got = from_bf16(ops.attention(q, kc, vc, pos, scale, early=early))
    want = reference_attention(q, kc, vc, pos, scale)
    for m in range(M):
        assert_close(got[m], want[m], 6e-3, f"attention M={M} context={context} Hkv={Hkv} G={G} D={D} query {m}")


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 3, 4, 8])
@pytest.mark.parametrize("context", [1, 2, 17, 300, 4097])
@pytest.mark.parametrize("early", [False, True])
def test_attention_decode(rng, context, G, D, early):
    check_attention(rng, 1, context, 2, G, D, early)


@pytest.mark.slow
@pytest.mark.parametrize("D,G", [(64, 4), (128, 3), (128, 4)])
def test_attention_decode_long_context(rng, D, G):
    check_attention(rng, 1, 33000, 8, G, D)  # every split in use
    check_attention(rng, 1, 33000, 8, G, D, early=True)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 3, 4, 8])
@pytest.mark.parametrize("M,context", [(2, 2), (7, 7), (5, 300), (64, 64), (33, 4097)])
def test_attention_prefill_chunk(rng, M, context, G, D):
    check_attention(rng, M, context, 2, G, D)


ROWS_AS_STEPS_SHAPES = [(64, 3, 3, False), (128, 3, 8, False), (128, 4, 2, False), (96, 7, 2, False)]
ROWS_AS_STEPS_SHAPES += [(128, 4, 8, True), (64, 8, 2, True), (128, 6, 2, True)]  # a qk_norm model's halved plan


@pytest.mark.parametrize("D,G,Hkv,halved", ROWS_AS_STEPS_SHAPES)
@pytest.mark.parametrize("M,context", [(2, 40), (5, 1000), (9, 700), (16, 3000), (16, 2055)])
def test_attention_rows_as_steps_equal_decode_steps(rng, M, context, G, D, Hkv, halved):
    """A chunk of up to 16 rows planned as decode steps (AttnPlan::rows_as_steps: a speculative verify's
    attention) gives row m the bits of a decode step at position pos + m on the same cache: each row's
    keys split as that step splits them. (A chunk's shared plan, s_max = 128 / M splits of the last row's
    keys, stops matching past ~32 x 128 / M keys: 800 at 5 rows.) Rows past the context hold NaN. A
    halved plan (a qk_norm model's: ratios 4..8 on two blocks per kv head) keeps this with its own steps."""
    q, kc, vc, pos, scale = attention_inputs(rng, M, context, Hkv, G, D, spare=5)
    rows = ops.attention(q, kc, vc, pos, scale, rows_as_steps=True, halved=halved)
    for m in range(M):
        step = ops.attention(q[m : m + 1], kc, vc, pos + m, scale, halved=halved)
        np.testing.assert_array_equal(rows[m], step[0], err_msg=f"row {m} of {M} at context {context}")
    want = reference_attention(q, kc, vc, pos, scale)
    assert_close(from_bf16(rows), want, 6e-3, f"rows as steps M={M} context={context}")


@pytest.mark.slow
@pytest.mark.parametrize("M,context", [(256, 256), (256, 1300)])
def test_attention_prefill_large_chunk(rng, M, context):
    check_attention(rng, M, context, 8, 3, 128)


CLUSTER_MERGE_CASES = [  # (M, context, cache rows, Hkv, G, D): splits merged in a cluster by default
    (1, 300, 303, 2, 3, 128),  # 10 splits in a cluster of 16
    (1, 100, 103, 8, 4, 128),  # 4 of 4
    (1, 500, 503, 2, 8, 64),  # 16 of 16 (G * D = 512)
    (1, 100, 103, 2, 8, 128),  # 4 of 4 (G * D = 1024: the leader's buffer holds 4 splits)
    (1, 230, 2000, 2, 3, 128),  # a cache of 63 splits: no cluster, the scratch merge both ways
    (5, 250, 253, 2, 3, 128),  # a prefill chunk: 2 query tokens x 3 heads per block, 8 splits of 8
]


def test_attention_cluster_merge_equals_scratch_merge(rng):
    """The two merges of the splits' partials (the leader's shared memory within a thread-block
    cluster; the scratch and a ticket otherwise) add the same terms in the same order: the same bits.
    The scratch merge runs in the same process with the plan's cluster_merge=False."""
    inputs, got = {}, {}
    for i, (M, context, C, Hkv, G, D) in enumerate(CLUSTER_MERGE_CASES):
        q = bf16_bits(rng.standard_normal((M, Hkv * G, D)) * 2.0)
        kc = bf16_bits(rng.standard_normal((C, Hkv, D)))
        vc = bf16_bits(rng.standard_normal((C, Hkv, D)))
        inputs.update({f"q{i}": q, f"k{i}": kc, f"v{i}": vc})
        got[f"o{i}"] = ops.attention(q, kc, vc, context - M, 1.0 / np.sqrt(D))
        want = reference_attention(q, kc, vc, context - M, 1.0 / np.sqrt(D))
        assert_close(from_bf16(got[f"o{i}"]), want, 6e-3, f"cluster merge, case {CLUSTER_MERGE_CASES[i]}")
    plain = {}
    for i, (M, context, C, Hkv, G, D) in enumerate(CLUSTER_MERGE_CASES):
        assert ops.attention_cluster_size(M, Hkv * G, Hkv, D, C, cluster_merge=False) == 1
        plain[f"o{i}"] = ops.attention(
            inputs[f"q{i}"], inputs[f"k{i}"], inputs[f"v{i}"], context - M, 1.0 / np.sqrt(D), cluster_merge=False
        )
    assert_same_bits(got, plain, "cluster != scratch merge")


@pytest.mark.parametrize(
    "M,H,Hkv,D,max_context,want",
    [
        (1, 24, 8, 128, 128, 4),  # 3B decode: 4 splits, one cluster of 4 per group
        (1, 24, 8, 128, 448, 16),
        (1, 24, 8, 128, 512, 16),  # Engine::kShortKeys: 16 splits, one 16-block cluster
        (1, 24, 8, 128, 513, 1),  # 17 splits: no cluster holds them all, a plain launch
        (1, 24, 8, 128, 32768, 1),  # deep caches: clusters cost the key loops their wave
        (1, 32, 8, 128, 8192, 1),
        (5, 6, 2, 128, 253, 8),  # a prefill chunk of 5 rows: 8 splits
        (1, 16, 2, 128, 103, 4),  # G * D = 1024: the leader's buffer holds 4 splits
        (1, 16, 2, 128, 2000, 1),
    ],
)
def test_attention_clusters_only_when_one_holds_every_split(M, H, Hkv, D, max_context, want):
    """The launch uses thread-block clusters only when one cluster holds every split a call of that
    shape can have; a grid of several clusters per group cost a 3B step at 32768 keys 24%. None
    with the plan's cluster_merge=False."""
    assert ops.attention_cluster_size(M, H, Hkv, D, max_context) == want
    assert ops.attention_cluster_size(M, H, Hkv, D, max_context, cluster_merge=False) == 1


# (context, cache rows): one split; 10 splits in a cluster; 16 of 16; a cache of 63 splits merged
# through the scratch; a deep cache (every split, through the scratch).
F16_OUT_CASES = [(1, 4), (300, 303), (500, 503), (230, 2000), (4097, 4100)]


@pytest.mark.parametrize("context,C", F16_OUT_CASES)
@pytest.mark.parametrize("D,G", [(64, 4), (128, 3), (96, 7), (256, 16)])
def test_attention_f16_output(rng, context, C, D, G):
    """The decode step's attention writes fp16 (kernels.h): the reference within fp16's rounding
    (F16_REL, below bf16's), the overflow flag left at 0 while every output fits fp16, set once one
    does not (every V in [5e5, 1e6]). V uniform in +-60000: outputs (averages of V) stay in range, with
    fp16's coarsest steps."""
    Hkv, H, pos = 2, 2 * G, context - 1
    kc = bf16_bits(rng.standard_normal((C, Hkv, D)))
    q = bf16_bits(rng.standard_normal((1, H, D)) * 2.0)
    scale = 1.0 / np.sqrt(D)
    for lo, hi, flagged in ((-1.0, 1.0, False), (-60000.0, 60000.0, False), (5e5, 1e6, True)):
        vc = bf16_bits(rng.uniform(lo, hi, (C, Hkv, D)))
        vc[0, 0, 0] = bf16_bits(np.array([hi]))[0]  # in the row every query sees, the range's edge
        kc[context:] = vc[context:] = 0x7FC0  # bf16 NaN past the context
        got, flag = ops.attention(q, kc, vc, pos, scale, early=True, out_dtype="f16")
        what = f"attention f16 context={context} C={C} G={G} D={D} v in [{lo:g}, {hi:g}]"
        assert flag == int(flagged), f"{what}: overflow flag {flag}"
        if flagged:
            continue
        want = reference_attention(q, kc, vc, pos, scale)[0]
        assert_close(from_f16(got[0]), want, F16_REL, what)
        # the same fp32 values as the bf16 output: rounded to bf16 they differ by at most one bf16 step
        ref16 = from_bf16(ops.attention(q, kc, vc, pos, scale, early=True))[0]
        assert np.all(np.abs(from_f16(got[0]) - ref16) <= 2.0**-8 * np.abs(ref16) + 2.0**-24), what


# Every GQA ratio 1..16 at every head_dim the kernel takes. Ratios past the built group sizes (1, 2,
# 3, 4, 6, 8; 1..4 at D = 256) run on several blocks per kv head (5 and 7: two blocks of 3 or 4 heads;
# past 8 (4) query heads: blocks of up to 8 (4)), each block's rows past its heads masked
# (attention_decode.cu, HeadMap).
ATTN_RATIOS = list(range(1, 17))
ATTN_HEAD_DIMS = [64, 80, 96, 128, 256]
# (M, position of the first query, cache rows): decode at positions 0, 1, 99 (4 splits: a cluster of 4
# for every shape), 511 (16 splits: a cluster of 16 where the leader's buffer holds them, else the
# scratch), 513 and 4097 (the scratch); prefill chunks of 3, 17 and 64 tokens, one split to 7.
ATTN_CASES = {
    "decode": [(1, 0, 3), (1, 1, 64), (1, 99, 128), (1, 511, 512), (1, 513, 600), (1, 4097, 4100)],
    "prefill": [(3, 0, 8), (3, 4097, 4100), (17, 1, 128), (17, 513, 600), (64, 511, 600)],
}


@pytest.mark.parametrize("D", ATTN_HEAD_DIMS)
@pytest.mark.parametrize("G", ATTN_RATIOS)
@pytest.mark.parametrize("kind", list(ATTN_CASES))
def test_attention_every_ratio_and_head_dim(rng, kind, G, D):
    """The reference at every ratio and head_dim, cache rows past each call's context NaN, the output
    poisoned by the harness; each call under its default plan (clusters where one holds every split,
    cached rows read early for decode) and under the scratch merge (cluster_merge=False): the same bits."""
    Hkv = 2 if kind == "decode" else 3
    H, scale = Hkv * G, 1.0 / np.sqrt(D)
    for M, pos, C in ATTN_CASES[kind]:
        context = pos + M
        kc = bf16_bits(rng.standard_normal((C, Hkv, D)))
        vc = bf16_bits(rng.standard_normal((C, Hkv, D)))
        kc[context:] = vc[context:] = 0x7FC0  # bf16 NaN
        q = bf16_bits(rng.standard_normal((M, H, D)) * 2.0)
        what = f"attention G={G} D={D} M={M} pos={pos} C={C} Hkv={Hkv}"
        got = ops.attention(q, kc, vc, pos, scale, early=M == 1)
        plain = ops.attention(q, kc, vc, pos, scale, cluster_merge=False)
        want = reference_attention(q, kc, vc, pos, scale)
        for m in range(M):
            assert_close(from_bf16(got[m]), want[m], 6e-3, f"{what} query {m}")
        np.testing.assert_array_equal(got, plain, err_msg=f"{what}: cluster plan != scratch merge (bits)")


@pytest.mark.parametrize(
    "M,H,Hkv,D,max_context,want",
    [
        (1, 14, 2, 64, 512, 16),  # ratio 7 runs two blocks of G = 4: G * D = 256, 16 splits in a 16-block cluster
        (1, 10, 2, 96, 256, 8),  # ratio 5 runs two blocks of G = 3: G * D = 288, 8 splits in a cluster of 8
        (1, 10, 2, 96, 512, 16),  # 16 splits: the leader's buffer of G * D <= 512 holds them
        (1, 16, 1, 256, 128, 4),  # ratio 16 at D = 256: blocks of 4 heads, G * D = 1024, 4 splits
        (1, 32, 2, 80, 512, 1),  # ratio 16: blocks of 8 heads, G * D = 640 holds 8, not 16 splits
        (1, 32, 2, 80, 256, 8),
    ],
)
def test_attention_cluster_sizes_of_the_new_shapes(M, H, Hkv, D, max_context, want):
    assert ops.attention_cluster_size(M, H, Hkv, D, max_context) == want
    assert ops.attention_cluster_size(M, H, Hkv, D, max_context, cluster_merge=False) == 1


def test_attention_rejects_unsupported():
    z = lambda *s: np.zeros(s, np.uint16)
    with pytest.raises(ValueError, match="head_dim"):
        ops.attention(z(1, 4, 72), z(8, 2, 72), z(8, 2, 72), 0)
    with pytest.raises(ValueError, match="GQA"):
        ops.attention(z(1, 34, 64), z(8, 2, 64), z(8, 2, 64), 0)  # G = 17


# ----------------------------------------------------------------------------- rope + KV append


def llama_inv_freq(D, theta=500000.0):
    return (1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)).astype(np.float32)


@pytest.mark.parametrize("H,Hkv,D", [(24, 8, 128), (32, 8, 64), (3, 1, 64), (8, 2, 80), (8, 1, 96), (8, 1, 256)])
@pytest.mark.parametrize(
    "M,pos,C", [(1, 0, 4), (1, 4095, 4100), (5, 17, 30), (2, 70000, 70003), (33, 100000, 64), (3, 126, 128)]
)  # last two: tokens past the cache
def test_rope_kv_append(rng, M, pos, C, H, Hkv, D):
    W = (H + 2 * Hkv) * D
    qkv = rng.standard_normal((M, W)).astype(np.float32)
    inv_freq = llama_inv_freq(D)
    kc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    vc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    q, kc, vc = ops.rope_kv_append(qkv, inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy())

    p = (pos + np.arange(M)).astype(np.float32)
    angle = (p[:, None] * inv_freq[None, :]).astype(np.float64)  # the fp32 product, as on the device
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    heads = qkv.astype(np.float64).reshape(M, H + 2 * Hkv, D)
    x1, x2 = heads[..., : D // 2], heads[..., D // 2 :]
    rot = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    assert_close(from_bf16(q), rot[:, :H], BF16_REL, "rope q")
    written = [m for m in range(M) if pos + m < C]
    rows = [pos + m for m in written]
    if rows:
        assert_close(from_bf16(kc[rows]), rot[written, H : H + Hkv], BF16_REL, "rope k_cache")
        want_v = bf16_bits(heads[written, H + Hkv :].astype(np.float32))
        assert np.array_equal(vc[rows], want_v), "v_cache rows must be bf16(v) exactly"
    untouched = np.setdiff1d(np.arange(C), rows)
    assert np.array_equal(kc[untouched], kc0[untouched]) and np.array_equal(vc[untouched], vc0[untouched]), (
        "rope_kv_append wrote outside its rows"
    )


# The 3B, 8B and 1B shapes, a tiny one, and more: K 2048 / 2560 / 3584, groups of 5 and 7, 56 heads of 64.
@pytest.mark.parametrize(
    "H,Hkv,D,K",
    [
        (24, 8, 128, 3072),
        (32, 8, 128, 4096),
        (32, 8, 64, 2048),
        (3, 1, 64, 384),
        (32, 8, 128, 2048),
        (30, 6, 128, 2560),
        (28, 4, 128, 3584),
        (56, 8, 64, 3072),
        (8, 2, 80, 256),  # the head dims attention takes past 64 and 128
        (8, 1, 96, 256),
        (8, 1, 256, 256),
    ],
)
@pytest.mark.parametrize("pos,C", [(0, 4), (4095, 4100), (70000, 70001), (126, 126)])  # last: past the cache
def test_gemv_rmsnorm_rope_equals_the_three_kernels(rng, H, Hkv, D, K, pos, C):
    """The decode QKV launch (RMSNorm prologue, RoPE + KV append epilogue)
    writes exactly what rmsnorm -> gemv -> rope_kv_append write, bit for bit, and nothing else."""
    N = (H + 2 * Hkv) * D
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = (rng.standard_normal(K) * rng.uniform(0.1, 10)).astype(np.float32)
    nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
    inv_freq = llama_inv_freq(D)
    kc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    vc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    q, kc, vc = ops.gemv_rmsnorm_rope(w, s, x, nw, 1e-5, inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy())
    qkv = ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 0)
    q_ref, kc_ref, vc_ref = ops.rope_kv_append(qkv[None], inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy())
    np.testing.assert_array_equal(q, q_ref[0])
    np.testing.assert_array_equal(kc, kc_ref)
    np.testing.assert_array_equal(vc, vc_ref)
    if pos >= C:
        assert np.array_equal(kc, kc0) and np.array_equal(vc, vc0), "a position past the cache wrote into it"
    # and against the fp32 reference: q = rope(W xn)
    xn = from_f16(ops.rmsnorm(x[None], nw, 1e-5)[0])
    ref = reference_linear(w, s, xn.reshape(1, K))[0].astype(np.float64).reshape(H + 2 * Hkv, D)
    angle = (np.float32(pos) * inv_freq).astype(np.float64)
    x1, x2 = ref[:H, : D // 2], ref[:H, D // 2 :]
    rot = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)
    assert_close(from_bf16(q), rot, BF16_REL, "fused rope q")


def test_gemv_rmsnorm_rope_rejects_bad_arguments(rng):
    w, s = random_fp8(rng, (5 * 64, 256)), random_scales(rng, 5 * 64, 256)
    x, nw = np.ones(256, np.float32), bf16_bits(np.ones(256))
    kc = bf16_bits(np.zeros((8, 1, 64)))
    with pytest.raises(ValueError):  # w's rows do not match (H + 2 Hkv) * D
        ops.gemv_rmsnorm_rope(w, s, x, nw, 1e-5, llama_inv_freq(64), 0, 4, 1, 64, kc, kc.copy())
    with pytest.raises(ValueError):  # odd head_dim
        ops.gemv_rmsnorm_rope(w, s, x, nw, 1e-5, llama_inv_freq(64), 0, 3, 1, 63, kc, kc.copy())
    # One head_dim range for both RoPE paths: 1026 is refused by the fused one and by the rope kernel.
    D = 1026
    wd, sd = random_fp8(rng, (3 * D, 256)), random_scales(rng, 3 * D, 256)
    kd = bf16_bits(np.zeros((8, 1, D)))
    with pytest.raises(ValueError, match="head_dim must be even and <= 1024"):
        ops.gemv_rmsnorm_rope(wd, sd, x, nw, 1e-5, llama_inv_freq(D), 0, 1, 1, D, kd, kd.copy())
    with pytest.raises(ValueError, match="head_dim must be even and <= 1024"):
        ops.rope_kv_append(np.zeros((1, 3 * D), np.float32), llama_inv_freq(D), 0, 1, 1, D, kd.copy(), kd.copy())


# ----------------------------------------------------------------------------- small ops


@pytest.mark.parametrize("M,d", [(1, 1), (1, 3072), (3, 7), (5, 576), (17, 4096), (2, 8193), (4, 8196)])
def test_rmsnorm(rng, M, d):
    x = (rng.standard_normal((M, d)) * rng.uniform(0.1, 30, (M, 1))).astype(np.float32)
    w = bf16_bits(rng.standard_normal(d))
    eps = 1e-5
    xf = x.astype(np.float64)
    want = xf / np.sqrt((xf * xf).mean(axis=1, keepdims=True) + eps) * from_bf16(w)
    assert_close(from_f16(ops.rmsnorm(x, w, eps)), want, F16_REL, f"rmsnorm M={M} d={d}")


@pytest.mark.parametrize("vocab,d", [(1, 1), (50, 7), (1000, 3072)])
def test_embedding(rng, vocab, d):
    table = bf16_bits(rng.standard_normal((vocab, d)))
    tokens = rng.integers(0, vocab, 9).astype(np.int32)
    got = ops.embedding(table, tokens)
    assert np.array_equal(got, from_bf16(table[tokens]).astype(np.float32))
    # Out-of-range ids are clamped on the device (the host rejects them before this).
    got = ops.embedding(table, np.array([-5, vocab + 3], np.int32))
    assert np.array_equal(got, from_bf16(table[[0, vocab - 1]]).astype(np.float32))


@pytest.mark.parametrize("n", [1, 5, 1000003])
def test_add_inplace(rng, n):
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    assert np.array_equal(ops.add_inplace(x, y), x + y)


@pytest.mark.parametrize("n", [1, 3, 4, 1000, 128256, 49155])
def test_all_finite(rng, n):
    """all_finite (begin_prompt's check of its row): 1 for finite values, 0 for one NaN, +Inf or -Inf
    anywhere, on aligned and unaligned starts (the 16-byte loads and the scalar tail); the flag is
    poisoned (7) before the launch."""
    x = (rng.standard_normal(n) * 1e30).astype(np.float32)
    x[rng.integers(0, n)] = np.finfo(np.float32).max  # large but finite
    for offset in sorted({0, 1, 2, 3} & set(range(n))):
        assert ops.all_finite(x, offset) == 1
    for bad in (np.nan, np.inf, -np.inf):
        for where in sorted({0, n // 2, n - 1, int(rng.integers(0, n))}):
            y = x.copy()
            y[where] = bad
            for offset in sorted({0, 1, 3} & set(range(where + 1))):
                assert ops.all_finite(y, offset) == 0, f"{bad} at {where}, offset {offset}"
            if where > 0:
                assert ops.all_finite(y[:where]) == 1  # the prefix before it


def test_stream_read_bandwidth_is_sane():
    gbs = ops.stream_read_bandwidth(1 << 28, 5)
    assert np.isfinite(gbs) and 100 < gbs < 20000, f"{gbs} GB/s"


# ----------------------------------------------------------------------------- sampling


def distinct_logits(rng, vocab, spread=3.0):
    return (rng.standard_normal(vocab) * spread).astype(np.float32)


@pytest.mark.parametrize("vocab", [1, 3, 9, 1000, 128256, 151936])
def test_greedy_is_argmax_lowest_index_on_ties(rng, vocab):
    x = distinct_logits(rng, vocab)
    x[rng.integers(0, vocab, vocab // 10)] = -np.inf
    assert ops.sample(x, 0.0, 0, 1.0, 1, 0) == int(np.argmax(x))
    if vocab >= 3:
        i, j = sorted(rng.choice(vocab, 2, replace=False))
        x[i] = x[j] = x.max() + 1.0
        assert ops.sample(x, 0.0, 5, 0.5, 7, 3) == i  # top-k / top-p do not apply when greedy
        x[:] = 0.25  # all tied
        assert ops.sample(x, 0.0, 0, 1.0, 1, 0) == 0


# Settings exactly representable in fp32 (the device receives fp32), so only exp rounding differs.
SETTINGS = [
    (1.0, 0, 1.0),
    (0.5, 0, 1.0),
    (1.25, 50, 1.0),
    (1.0, 0, 0.875),
    (0.75, 20, 0.5),
    (1.0, 1, 1.0),
    (2.0, 0, 0.0625),
    (1.0, 999, 0.96875),
]


@pytest.mark.parametrize("vocab", [7, 1000, 128256])
def test_sampling_follows_sample_numpy(rng, vocab):
    """The device draw is sample_numpy's draw: same allowed set, same Philox u, same inverse CDF."""
    from atomflow.sampling import SamplingParams, sample_numpy

    mismatches, total = [], 0
    for T, k, p in SETTINGS:
        x = distinct_logits(rng, vocab)
        for _ in range(6):
            seed, pos = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**31 - 2))
            params = SamplingParams(temperature=T, top_k=k, top_p=p, seed=seed)
            got, want = ops.sample(x, T, k, p, seed, pos), sample_numpy(x, params, pos)
            total += 1
            if got != want:
                mismatches.append((T, k, p, seed, pos, got, want))
    # fp32 exp vs float64 may move a draw that lands within ~1e-7 of a CDF step: vanishingly rare.
    assert len(mismatches) <= 1, f"{len(mismatches)} of {total} draws differ: {mismatches[:4]}"


@pytest.mark.parametrize("vocab,d", [(128256, 3072), (1000, 64), (9, 5)])
def test_sample_step_ends_the_step(rng, vocab, d):
    """sample_step draws what sample() draws (RNG counter pos[1]), greedy too from the head's block
    maxima; it writes the token into ring slot pos % ring_size and the step's fp16 overflow flag
    into ring_size + that (no other slot), clears the flag, advances both positions and leaves the
    token's embedding row, as fp32, for the next step."""
    x = distinct_logits(rng, vocab)
    embed = bf16_bits(rng.standard_normal((vocab, d)))
    blocks = 37
    keys = argmax_keys(x)
    best = np.zeros(blocks, np.uint64)
    np.maximum.at(best, rng.integers(0, blocks, vocab), keys)
    for T, k, p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.75, 20, 0.5)]:
        for block_best in (None, best):  # the maxima only serve a greedy draw
            seed, pos, ring = int(rng.integers(0, 2**63)), int(rng.integers(0, 100000)), int(rng.integers(1, 9))
            flag = int(rng.integers(0, 2))
            token, pos_after, ring_out, row, flag_after = ops.sample_step(x, T, k, p, seed, pos, embed, block_best, ring, flag)
            assert token == ops.sample(x, T, k, p, seed, pos + 1)
            if T == 0:
                assert token == int(np.argmax(x))
            assert pos_after.tolist() == [pos + 1, pos + 2]
            want_ring = np.full(2 * ring, -1, np.int32)
            want_ring[pos % ring] = token
            want_ring[ring + pos % ring] = flag
            np.testing.assert_array_equal(ring_out, want_ring)
            assert flag_after == 0
            np.testing.assert_array_equal(row, from_bf16(embed[token]).astype(np.float32))


@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf])
def test_sampler_refuses_non_finite_logits(rng, bad):
    """Logits holding a NaN (either sign) or +Inf give -1, never a token (sample_numpy raises on them;
    -Inf is a masked token, test_greedy_is_argmax_lowest_index_on_ties): sample() and sample_step,
    greedy or not; sample_step still ends the step (ring slot -1, positions advanced, flag cleared)
    with token 0's embedding row as the next input (a valid one). Greedy from the head's block maxima
    sees only the largest key: a positive NaN or +Inf there gives -1."""
    vocab, d = 128256, 64
    x = distinct_logits(rng, vocab)
    x[vocab // 3] = bad
    embed = bf16_bits(rng.standard_normal((vocab, d)))
    for T, k, p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.75, 20, 0.5)]:
        assert ops.sample(x, T, k, p, 7, 11) == -1, (T, k, p)
        token, pos_after, ring_out, row, flag_after = ops.sample_step(x, T, k, p, 7, 10, embed, None, 4, 1)
        assert token == -1 and ring_out[10 % 4] == -1 and ring_out[4 + 10 % 4] == 1
        assert pos_after.tolist() == [11, 12] and flag_after == 0
        np.testing.assert_array_equal(row, from_bf16(embed[0]).astype(np.float32))
    keys = argmax_keys(x)  # a positive NaN's key is the largest, a negative one's the smallest
    best = np.array([keys.max()], np.uint64)
    want = -1 if keys.max() == keys[vocab // 3] else int(np.argmax(np.where(np.isnan(x), -np.inf, x)))
    assert ops.sample_step(x, 0.0, 0, 1.0, 7, 10, embed, best, 4, 0)[0] == want
    x[:] = -np.inf  # nothing to draw
    assert ops.sample(x, 1.0, 0, 1.0, 7, 11) == -1 and ops.sample(x, 0.0, 0, 1.0, 7, 11) == -1


def test_argmax_rows_is_the_greedy_samplers_choice(rng):
    """A verify's greedy tokens (kernels::argmax_rows) follow the sampler's rule: the larger value, the
    lower index on ties, -Inf a masked token, and -1 for a row with a NaN (either sign) or +Inf or
    nothing but -Inf."""
    vocab = 50000
    x = np.stack([distinct_logits(rng, vocab) for _ in range(8)])
    x[1, [7, 40000]] = x[1].max() + 1.0  # a tie: the lower index
    x[2, ::2] = -np.inf  # masked tokens
    x[2, 1] = x[2].max() + 1.0
    x[3, 123] = np.nan
    x[4, 4567] = -np.nan
    x[5, 9] = np.inf
    x[6, :] = -np.inf
    got = ops.argmax_rows(x)
    assert got[0] == int(np.argmax(x[0])) and got[1] == 7 and got[2] == 1 and got[7] == int(np.argmax(x[7]))
    assert got[3:7].tolist() == [-1, -1, -1, -1]
    assert got.tolist() == [ops.sample(r, 0.0, 0, 1.0, 7, 11) for r in x]


def test_sample_step_greedy_takes_the_block_maxima(rng):
    """With block maxima the greedy token is the one they name (the logits are not read again)."""
    x = distinct_logits(rng, 4096)
    embed = bf16_bits(rng.standard_normal((4096, 16)))
    best = argmax_keys(x)[[5, 77, 1234]]  # a subset: the best of those three rows
    token, *_ = ops.sample_step(x, 0.0, 0, 1.0, 1, 0, embed, best)
    assert token == [5, 77, 1234][int(np.argmax(x[[5, 77, 1234]]))]


def test_same_seed_same_token_other_seeds_vary(rng):
    x = distinct_logits(rng, 5000, spread=1.0)
    seeds = rng.integers(0, 2**63, 64, dtype=np.uint64)
    a = ops.sample_seeds(x, 1.0, 0, 1.0, seeds, 42)
    assert np.array_equal(a, ops.sample_seeds(x, 1.0, 0, 1.0, seeds, 42))
    assert len(set(a.tolist())) > 20
    b = ops.sample_seeds(x, 1.0, 0, 1.0, np.full(64, seeds[0], np.uint64), 42)
    assert (b == a[0]).all()


@pytest.mark.slow
def test_temperature_frequencies_match_softmax(rng):
    vocab, T, n = 12, 0.7, 40000
    x = distinct_logits(rng, vocab, spread=1.0)
    seeds = rng.integers(0, 2**63, n, dtype=np.uint64)
    got = ops.sample_seeds(x, T, 0, 1.0, seeds, int(rng.integers(0, 1000)))
    assert got.min() >= 0 and got.max() < vocab
    z = x.astype(np.float64) / T
    prob = np.exp(z - z.max())
    prob /= prob.sum()
    expected, observed = prob * n, np.bincount(got, minlength=vocab)
    ok = expected >= 5
    chi2 = float((((observed - expected) ** 2) / expected)[ok].sum())
    df = int(ok.sum()) - 1
    assert chi2 < df + 10 * np.sqrt(2 * df), f"chi-square {chi2:.1f} with {df} dof: {observed} vs {expected.round()}"


@pytest.mark.parametrize("vocab,k", [(1000, 1), (1000, 3), (1000, 20), (128256, 40)])
def test_top_k_stays_in_top_k(rng, vocab, k):
    x = distinct_logits(rng, vocab, spread=0.5)  # flat: the top k all get drawn
    top = set(np.argsort(x)[-k:].tolist())
    got = ops.sample_seeds(x, 1.5, k, 1.0, rng.integers(0, 2**63, 400, dtype=np.uint64), 9)
    outside = set(got.tolist()) - top
    assert not outside, f"tokens outside the top {k}: {sorted(outside)[:10]}"
    if k <= 3:
        assert set(got.tolist()) == top


@pytest.mark.parametrize(
    "vocab,top_p,top_k", [(1000, 0.5, 0), (1000, 0.875, 0), (1000, 0.9375, 100), (128256, 0.75, 0), (50, 0.03125, 0)]
)
def test_top_p_stays_in_nucleus(rng, vocab, top_p, top_k):
    from atomflow.sampling import SamplingParams, allowed_tokens

    T = 1.0
    # Logits whose nucleus boundary is not within 1e-6 of top_p (fp32 vs float64 could disagree).
    while True:
        x = distinct_logits(rng, vocab, spread=2.0)
        z = x.astype(np.float64) / T
        if 0 < top_k < vocab:
            z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
        p = np.exp(z - z.max())
        c = np.cumsum(np.sort(p / p.sum())[::-1])
        if np.abs(c - top_p).min() > 1e-6:
            break
    allowed = allowed_tokens(x, SamplingParams(temperature=T, top_k=top_k, top_p=top_p, seed=0))
    got = ops.sample_seeds(x, T, top_k, top_p, rng.integers(0, 2**63, 300, dtype=np.uint64), 5)
    outside = [t for t in set(got.tolist()) if not allowed[t]]
    assert not outside, f"tokens outside the nucleus ({int(allowed.sum())} tokens): {outside[:10]}"
    assert len(set(got.tolist())) > 1 or allowed.sum() == 1


# ----------------------------------------------------------------------------- the in-kernel trace


def test_trace_only_in_a_trace_build(rng):
    """A normal build records nothing and refuses to arm; a trace build (ATOMFLOW_TRACE=ON) records one
    160-byte record per GEMV warp, with its stamps in order, and stops once disarmed."""
    if not ops.trace_built():
        with pytest.raises(ValueError, match="ATOMFLOW_TRACE"):
            ops.trace_arm(16)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import trace_step  # the record layout (trace.cuh's Rec)

    N, K = 96, 512
    w = rng.integers(0, 256, (N, K), dtype=np.uint8) & 0x77  # finite e4m3
    s = np.ones((N, K // 128), np.float32)
    x = bf16_bits(rng.standard_normal(K))
    ops.trace_arm(64)
    try:
        ops.trace_reset()
        ops.gemv(w, s, x)
        raw, dropped = ops.trace_read()
    finally:
        ops.trace_arm(0)
    assert dropped == 0
    recs = np.frombuffer(raw, dtype=trace_step.REC)
    assert len(recs) == 48  # 48 row pairs on 6 blocks of 8 warps: one record per warp
    assert (recs["K"] == K).all() and (recs["n"] == 1).all() and (recs["kind"] == 0).all()  # Store, bf16 x
    t = recs["t"].astype(np.int64)
    for a, b in [(0, 2), (2, 3), (3, 4), (4, 15)]:  # entry <= waited <= staged <= iteration <= exit
        assert (t[:, a] <= t[:, b]).all() and (t[:, a] > 0).all()
