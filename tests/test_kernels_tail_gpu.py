"""Rung 1 for tail FP8 groups: the W8A16 GEMV (every epilogue, the fused RMSNorm prologue, the
argmax head, the RoPE + KV append QKV launch) and the prefill GEMM for K a multiple of 64 but not
of 128 (scales [N, ceil(K / 128)], the last group 64 columns wide, docs/FORMAT.md), against a
float64 numpy reference, with the aligned K beside them. Fresh random inputs (the seed is printed:
ATOMFLOW_TEST_SEED replays it), outputs poisoned before every launch (the harness fills them with
0xFF bytes: NaN), scales spread over 8 binades so a scale read from the wrong group shows.
Skipped cleanly without the CUDA core or a GPU."""

from __future__ import annotations

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")
from numerics import bf16_bits, f16_bits, from_bf16, from_f16  # noqa: E402
from test_kernels_gpu import (  # noqa: E402
    BF16_REL,
    BF16_TINY,
    F16_REL,
    FP32_REL,
    argmax_keys,
    assert_close,
    llama_inv_freq,
    ops,
    random_fp8,
    resident_warps,
    silu_mul,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(ops is None, reason="gpu: atomflow._core.ops is unavailable")]

FP8_TO_F64 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)

# The K of the brief: tail groups (64, 192, 320, 576 = SmolLM2's hidden, 4096 + 64), and 1536
# (SmolLM2's intermediate, a whole multiple of 512) beside them.
TAIL_KS = [64, 192, 320, 576, 4160]
KS = TAIL_KS + [1536]
# N: one row, odd rows, fewer pairs than a block's 8 warps, SmolLM2's QKV (960) and o (576); the
# multi-round and ticketed shapes come in their own tests.
NS = [1, 7, 18, 258, 576, 960]


def groups(k: int) -> int:
    return -(-k // 128)


def random_scales(rng, n: int, k: int) -> np.ndarray:
    """[n, ceil(k / 128)] scales over 8 binades, so a scale read from the wrong group (or with the
    wrong row stride: K / 128 instead of ceil(K / 128)) shows."""
    return (2.0 ** rng.uniform(-12, -4, size=(n, groups(k)))).astype(np.float32)


def dequant(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """float64 fp8 [N, K] * scale[n, k // 128] (the last group covers the K % 128 columns left)."""
    k = w.shape[1]
    return FP8_TO_F64[w] * np.repeat(s.astype(np.float64), 128, axis=1)[:, :k]


def reference_linear(w: np.ndarray, s: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 x [M, K] @ dequant(w, s).T, in row chunks."""
    n, k = w.shape
    y = np.empty((x.shape[0], n))
    step = max(1, (1 << 23) // k)
    for r in range(0, n, step):
        y[:, r : r + step] = x @ dequant(w[r : r + step], s[r : r + step]).T
    return y


def check_linear(rng, N: int, K: int, M: int | None, x_dtype: str) -> None:
    """Store, AddResidual and (even N) SwiGLU of gemv (M None) or gemm (M rows) on one random matrix."""
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    to_bits, from_bits = (bf16_bits, from_bf16) if x_dtype == "bf16" else (f16_bits, from_f16)
    x = to_bits(rng.standard_normal((K,) if M is None else (M, K)))
    y = reference_linear(w, s, from_bits(x).reshape(-1, K))
    y = y[0] if M is None else y
    run = ops.gemv if M is None else ops.gemm
    what = f"{'gemv' if M is None else f'gemm M={M}'} N={N} K={K} x {x_dtype}"
    assert_close(run(w, s, x, 0, None, x_dtype), y, FP32_REL, f"{what} Store")
    residual = (rng.standard_normal(y.shape) * (np.sqrt(np.mean(y**2)) + 1.0)).astype(np.float32)
    got = np.asarray(run(w, s, x, 1, residual, x_dtype), np.float64)
    scale = np.linalg.norm(residual.astype(np.float64)) + np.linalg.norm(y)
    assert_close(got, residual + y, FP32_REL, f"{what} AddResidual", scale=scale)
    if N % 2 == 0:
        F = N // 2
        want = silu_mul(y[..., :F], y[..., F:])
        got = from_bf16(run(w, s, x, 2, None, x_dtype))
        assert_close(got, want, BF16_REL, f"{what} SwiGLU", scale=max(float(np.linalg.norm(want)), BF16_TINY))


# ----------------------------------------------------------------------------- gemv


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("N", NS)
def test_gemv_tail(rng, N, K):
    for x_dtype in ("bf16", "f16"):
        check_linear(rng, N, K, None, x_dtype)


@pytest.mark.parametrize("K", [64, 576, 4160])
def test_gemv_tail_several_rounds(rng, K):
    """More row pairs than resident warps (several per warp, the ticketed SwiGLU among them), and an
    odd N whose last pair holds one row."""
    W = resident_warps()
    check_linear(rng, 2 * W + 2 * 9 + 1, K, None, "bf16")
    check_linear(rng, 4 * W + 6, K, None, "f16")


@pytest.mark.parametrize("K", TAIL_KS)
def test_gemv_tail_swiglu_tickets_same_bits(rng, K):
    """The ticketed gate/up product of a tail K: the same bits as the fixed schedule, and the reference."""
    N = 2 * (resident_warps() + 1001)
    assert ops.gemv_swiglu_ticketed(N, K, True) and ops.gemv_swiglu_ticketed(N, K, False)
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    xh = f16_bits(rng.standard_normal(K))
    xf = (rng.standard_normal(K) * 3).astype(np.float32)
    nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
    got = ops.gemv(w, s, xh, 2, None, "f16")
    np.testing.assert_array_equal(got, ops.gemv(w, s, xh, 2, None, "f16", tickets=False))
    y = reference_linear(w, s, from_f16(xh)[None])[0]
    want = silu_mul(y[: N // 2], y[N // 2 :])
    assert_close(from_bf16(got), want, BF16_REL, f"ticketed SwiGLU K={K}", scale=max(float(np.linalg.norm(want)), BF16_TINY))
    fused = ops.gemv_rmsnorm(w, s, xf, nw, 1e-5, 2)
    np.testing.assert_array_equal(fused, ops.gemv_rmsnorm(w, s, xf, nw, 1e-5, 2, tickets=False))


@pytest.mark.parametrize("N,K", [(960, 576), (3072, 576), (576, 1536), (7, 64), (258, 192), (18, 320), (1001, 4160)])
def test_gemv_rmsnorm_tail(rng, N, K):
    """The fused RMSNorm prologue on a tail K: bit-identical to rmsnorm -> gemv(f16) for every
    epilogue (SwiGLU in bf16 and in fp16 with its flag), and the fp32 reference of the normed input."""
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = (rng.standard_normal(K) * rng.uniform(0.1, 10)).astype(np.float32)
    nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
    xn = ops.rmsnorm(x[None], nw, 1e-5)[0]  # fp16 bits
    y = reference_linear(w, s, from_f16(xn).reshape(1, K))[0]
    store = ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 0)
    np.testing.assert_array_equal(store, ops.gemv(w, s, xn, 0, None, "f16"))
    assert_close(store, y, FP32_REL, f"gemv_rmsnorm Store N={N} K={K}")
    residual = rng.standard_normal(N).astype(np.float32)
    added = ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 1, residual)
    np.testing.assert_array_equal(added, ops.gemv(w, s, xn, 1, residual, "f16"))
    scale = np.linalg.norm(residual.astype(np.float64)) + np.linalg.norm(y)
    assert_close(added, residual + y, FP32_REL, f"gemv_rmsnorm AddResidual N={N} K={K}", scale=scale)
    if N % 2 == 0:
        F = N // 2
        want = silu_mul(y[:F], y[F:])
        floor = max(float(np.linalg.norm(want)), BF16_TINY)
        glu = ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 2)
        np.testing.assert_array_equal(glu, ops.gemv(w, s, xn, 2, None, "f16"))
        assert_close(from_bf16(glu), want, BF16_REL, f"gemv_rmsnorm SwiGLU N={N} K={K}", scale=floor)
        half, flag = ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 2, None, "f16")
        plain, plain_flag = ops.gemv(w, s, xn, 2, None, "f16", "f16")
        np.testing.assert_array_equal(half, plain)
        assert flag == plain_flag
        if not np.any(np.abs(np.abs(want) / 65504.0 - 1) < 1e-3):  # else either flag is right
            assert flag == int(np.any(np.abs(want) > 65504.0))
        if not flag:
            assert_close(from_f16(half), want, F16_REL, f"gemv_rmsnorm SwiGLU f16 N={N} K={K}", scale=max(floor, 2.0**-14))


@pytest.mark.parametrize("N,K", [(49152, 576), (1024, 576), (2 * 2112 + 3, 192), (7, 64), (5000, 4160), (1, 320)])
def test_gemv_rmsnorm_argmax_tail(rng, N, K):
    """The FP8 head on a tail K (SmolLM2's: vocab 49152, hidden 576): the logits of gemv_rmsnorm
    (Store) to the bit, each block's largest argmax key over the rows it wrote, their max the argmax
    with the lowest index on ties, and the logits against the reference."""
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = (rng.standard_normal(K) * rng.uniform(0.1, 10)).astype(np.float32)
    nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
    tied = []
    if N >= 3:
        top = int(np.argmax(ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 0)))
        tied = [top] + [int(r) for r in rng.choice(np.setdiff1d(np.arange(N), [top]), 2, replace=False)]
        for r in tied[1:]:
            w[r], s[r] = w[top], s[top]
    out, best = ops.gemv_rmsnorm_argmax(w, s, x, nw, 1e-5)
    np.testing.assert_array_equal(out, ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 0))
    xn = from_f16(ops.rmsnorm(x[None], nw, 1e-5)[0])
    # The error of a sum is relative to its terms: one logit (N = 1) may nearly cancel.
    terms = float(np.linalg.norm(reference_linear(w & 0x7F, s, np.abs(xn).reshape(1, K))))
    assert_close(out, reference_linear(w, s, xn.reshape(1, K))[0], FP32_REL, f"head N={N} K={K}", scale=terms)
    blocks = ops.gemv_argmax_blocks(N, K)
    assert best.shape == (blocks,)
    want = np.zeros(blocks, np.uint64)
    np.maximum.at(want, (np.arange(N) // 2) % blocks, argmax_keys(out))
    np.testing.assert_array_equal(best, want)
    argmax = int(~np.uint32(best.max() & np.uint64(0xFFFFFFFF)))
    assert argmax == int(np.argmax(out)) == (min(tied) if tied else int(np.argmax(out)))


# (H, Hkv, D, K): SmolLM2-135M's QKV (9 heads on 3, K = 576), tools/make_tiny_arch.py's llama-tail
# (3 on 1, K = 192), K = 320 and 64, a 4160 of several iterations, and 1536 (whole) beside them.
ROPE_SHAPES = [(9, 3, 64, 576), (3, 1, 64, 192), (4, 2, 64, 320), (1, 1, 64, 64), (8, 2, 128, 4160), (24, 8, 64, 1536)]


@pytest.mark.parametrize("H,Hkv,D,K", ROPE_SHAPES)
@pytest.mark.parametrize("pos,C", [(0, 4), (4095, 4100), (126, 126)])  # last: past the cache
def test_gemv_rmsnorm_rope_tail(rng, H, Hkv, D, K, pos, C):
    """The decode QKV launch on a tail K writes what rmsnorm -> gemv -> rope_kv_append write, bit for
    bit, and nothing else; q, k and v against the fp32 reference."""
    N = (H + 2 * Hkv) * D
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = (rng.standard_normal(K) * rng.uniform(0.1, 10)).astype(np.float32)
    nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
    inv_freq = llama_inv_freq(D)
    kc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    vc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    for staged in (True, False):  # the plan stages no pairs for a tail K: both are the register path
        q, kc, vc = ops.gemv_rmsnorm_rope(w, s, x, nw, 1e-5, inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy(), staged)
        qkv = ops.gemv_rmsnorm(w, s, x, nw, 1e-5, 0)
        q_ref, kc_ref, vc_ref = ops.rope_kv_append(qkv[None], inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy())
        np.testing.assert_array_equal(q, q_ref[0])
        np.testing.assert_array_equal(kc, kc_ref)
        np.testing.assert_array_equal(vc, vc_ref)
    if K % 512:
        assert ops.gemv_qkv_staged_warps(H, Hkv, D, K) == 0
    xn = from_f16(ops.rmsnorm(x[None], nw, 1e-5)[0])
    ref = reference_linear(w, s, xn.reshape(1, K))[0].reshape(H + 2 * Hkv, D)
    angle = (np.float32(pos) * inv_freq).astype(np.float64)
    x1, x2 = ref[: H + Hkv, : D // 2], ref[: H + Hkv, D // 2 :]
    rot = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)
    assert_close(from_bf16(q), rot[:H], BF16_REL, f"fused rope q K={K}")
    if pos < C:
        assert_close(from_bf16(kc[pos]), rot[H:], BF16_REL, f"fused rope k K={K}")
        assert_close(from_bf16(vc[pos]), ref[H + Hkv :], BF16_REL, f"fused v K={K}")
        others = np.setdiff1d(np.arange(C), [pos])
        assert np.array_equal(kc[others], kc0[others]) and np.array_equal(vc[others], vc0[others])
    else:
        assert np.array_equal(kc, kc0) and np.array_equal(vc, vc0), "a position past the cache wrote into it"


# ----------------------------------------------------------------------------- gemm (prefill)


@pytest.mark.parametrize("M", [2, 37, 130])
@pytest.mark.parametrize("N,K", [(960, 576), (3072, 576), (576, 1536), (1, 64), (7, 192), (129, 320), (258, 4160)])
def test_gemm_tail(rng, M, N, K):
    for x_dtype in ("bf16", "f16"):
        check_linear(rng, N, K, M, x_dtype)


def test_tail_rejects_k_not_a_multiple_of_64(rng):
    w, s = random_fp8(rng, (4, 96)), random_scales(rng, 4, 96)
    x = bf16_bits(np.zeros(96))
    with pytest.raises(ValueError, match="multiple of 64"):
        ops.gemv(w, s, x)
    with pytest.raises(ValueError, match="multiple of 64"):
        ops.gemm(w, s, np.stack([x, x]))
    with pytest.raises(ValueError):  # scales [N, K / 128] (floor) for a tail K: the wrong shape
        ops.gemv(random_fp8(rng, (4, 576)), np.ones((4, 4), np.float32), bf16_bits(np.zeros(576)))
