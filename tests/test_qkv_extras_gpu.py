"""Rung 1 for the Qwen family's extras of attention's input (kernels.h, QkvExtras): rope_kv_append with
the QKV bias (Qwen2) and the per-head q/k RMSNorm before RoPE (Qwen3) against a float64 numpy
reference, outputs poisoned by the harness; the fused decode QKV GEMV with the bias in its RoPE epilogue
against the Store GEMV + rope_kv_append, bit for bit, and against the reference. Skipped cleanly without
the CUDA core or a GPU (the conftest marks `gpu` tests skipped)."""

from __future__ import annotations

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")
from numerics import bf16_bits, from_bf16, from_f16, load_ops  # noqa: E402

FP8 = ml_dtypes.float8_e4m3fn
FP8_TO_F64 = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float64)
BF16_REL = 4e-3  # an output rounded once to bf16 (relative rounding error <= 2^-9), as test_kernels_gpu.py


ops, WHY_NOT = load_ops()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(ops is None, reason=f"gpu: {WHY_NOT}")]


# ----------------------------------------------------------------------------- helpers


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def assert_close(got, want, what: str) -> None:
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    bad = ~np.isfinite(got)
    assert not bad.any(), f"{what}: {int(bad.sum())} non-finite outputs (unwritten?), first at {np.argwhere(bad)[0]}"
    err = rel_l2(got, want)
    assert err < BF16_REL, f"{what}: rel-L2 {err:.3e} >= {BF16_REL:.0e}"


def inv_freq_table(D, theta=1000000.0):
    return (1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)).astype(np.float32)


def random_fp8(rng, shape) -> np.ndarray:
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] ^= 1  # NaN codes -> +-448
    return b


def random_scales(rng, n, k) -> np.ndarray:
    return (2.0 ** rng.uniform(-12, -4, size=(n, k // 128))).astype(np.float32)


def reference_linear(w, scales, x) -> np.ndarray:
    """float64 x [K] @ (fp8 w [N, K] * scale).T, dequantized exactly."""
    n, k = w.shape
    wd = FP8_TO_F64[w].reshape(n, k // 128, 128) * scales[:, :, None]
    return wd.reshape(n, k) @ x


def reference_qkv(qkv, inv_freq, positions, H, Hkv, D, bias=None, q_norm=None, k_norm=None, eps=1e-6):
    """float64 [M, H + 2 Hkv, D] of what rope_kv_append writes before its bf16 rounding: row + bias
    (fp32, as the kernel adds it), q / k heads RMS-normalized with their weights (FORMAT.md, the
    forward pass), RoPE on q and k; v as it is."""
    M = qkv.shape[0]
    x = qkv if bias is None else (qkv + bias[None]).astype(np.float32)
    heads = x.astype(np.float64).reshape(M, H + 2 * Hkv, D).copy()
    if q_norm is not None:
        qk = heads[:, : H + Hkv]
        w = np.concatenate([np.tile(from_bf16(q_norm), (H, 1)), np.tile(from_bf16(k_norm), (Hkv, 1))])
        heads[:, : H + Hkv] = qk / np.sqrt(np.mean(qk**2, axis=-1, keepdims=True) + eps) * w[None]
    angle = (np.asarray(positions, np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)  # fp32 product
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = heads[:, : H + Hkv, : D // 2], heads[:, : H + Hkv, D // 2 :]
    heads[:, : H + Hkv] = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return heads


def extras(rng, mode, H, Hkv, D):
    """(bias, q_norm, k_norm) for mode 'bias', 'qk_norm' or 'both'; weights that differ per element, so
    an element or a head read from the wrong place shows."""
    W = (H + 2 * Hkv) * D
    bias = (0.5 * rng.standard_normal(W)).astype(np.float32) if mode in ("bias", "both") else None
    if mode in ("qk_norm", "both"):
        return bias, bf16_bits(1 + 0.3 * rng.standard_normal(D)), bf16_bits(1 + 0.3 * rng.standard_normal(D))
    return bias, None, None


# ----------------------------------------------------------------------------- rope_kv_append


@pytest.mark.parametrize("mode", ["bias", "qk_norm", "both"])
@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 64), (12, 2, 128), (16, 8, 128), (3, 1, 80), (6, 2, 96), (4, 1, 256)])
@pytest.mark.parametrize("M,pos,C", [(1, 0, 4), (3, 5, 9), (17, 4000, 4017), (64, 100, 300), (17, 126, 130)])
def test_rope_kv_append_extras(rng, mode, H, Hkv, D, M, pos, C):
    """Every q row and every cache row of the call's tokens written as the reference says (the last
    case: tokens past the cache, whose q is still written and whose K / V rows are not); nothing else."""
    W = (H + 2 * Hkv) * D
    # Heads of very different magnitudes: the q/k norm must take each head's own RMS.
    scale = 10.0 ** rng.uniform(-2, 2, size=(1, H + 2 * Hkv, 1))
    qkv = (rng.standard_normal((M, H + 2 * Hkv, D)) * scale).astype(np.float32).reshape(M, W)
    bias, qn, kn = extras(rng, mode, H, Hkv, D)
    eps = 1e-6
    inv_freq = inv_freq_table(D)
    kc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    vc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    q, kc, vc = ops.rope_kv_append(
        qkv, inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy(), bias=bias, q_norm=qn, k_norm=kn, eps=eps
    )
    want = reference_qkv(qkv, inv_freq, pos + np.arange(M), H, Hkv, D, bias, qn, kn, eps)
    assert_close(from_bf16(q), want[:, :H], f"q ({mode})")
    written = [m for m in range(M) if pos + m < C]
    rows = [pos + m for m in written]
    if rows:
        assert_close(from_bf16(kc[rows]), want[written, H : H + Hkv], f"k_cache ({mode})")
        v = qkv if bias is None else (qkv + bias[None]).astype(np.float32)  # one fp32 add, as the kernel
        want_v = bf16_bits(v.reshape(M, H + 2 * Hkv, D)[written, H + Hkv :])
        assert np.array_equal(vc[rows], want_v), "v_cache rows must be bf16(v + bias) exactly"
    untouched = np.setdiff1d(np.arange(C), rows)
    assert np.array_equal(kc[untouched], kc0[untouched]) and np.array_equal(vc[untouched], vc0[untouched]), (
        "rope_kv_append wrote outside its rows"
    )


def test_rope_kv_append_without_extras_is_unchanged(rng):
    """No extras and explicit Nones are the Llama path: the same bits."""
    H, Hkv, D, M = 8, 2, 128, 5
    qkv = rng.standard_normal((M, (H + 2 * Hkv) * D)).astype(np.float32)
    kc = bf16_bits(np.zeros((8, Hkv, D)))
    a = ops.rope_kv_append(qkv, inv_freq_table(D), 2, H, Hkv, D, kc.copy(), kc.copy())
    b = ops.rope_kv_append(qkv, inv_freq_table(D), 2, H, Hkv, D, kc.copy(), kc.copy(), bias=None, q_norm=None)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_rope_kv_append_rejects_half_a_norm(rng):
    H, Hkv, D = 2, 1, 64
    qkv = np.zeros((1, (H + 2 * Hkv) * D), np.float32)
    kc = bf16_bits(np.zeros((4, Hkv, D)))
    with pytest.raises(ValueError, match="come together"):
        ops.rope_kv_append(qkv, inv_freq_table(D), 0, H, Hkv, D, kc, kc.copy(), q_norm=bf16_bits(np.ones(D)))
    with pytest.raises(ValueError):  # a bias of the wrong length
        ops.rope_kv_append(qkv, inv_freq_table(D), 0, H, Hkv, D, kc, kc.copy(), bias=np.zeros(7, np.float32))


# ----------------------------------------------------------------------------- the fused QKV GEMV with a bias


# Qwen2.5 shapes (0.5B: 14 heads of 64 over 2; 1.5B: 12 of 128 over 2; 7B: 28 of 128 over 4), a tiny one.
@pytest.mark.parametrize(
    "H,Hkv,D,K", [(14, 2, 64, 896), (12, 2, 128, 1536), (28, 4, 128, 3584), (4, 2, 64, 256), (16, 2, 128, 2048)]
)
@pytest.mark.parametrize("staged_pair", [True, False])
@pytest.mark.parametrize("pos,C", [(0, 4), (4095, 4100), (126, 126)])  # last: past the cache
def test_gemv_rmsnorm_rope_bias_equals_the_split_path(rng, H, Hkv, D, K, staged_pair, pos, C):
    """The decode QKV launch with the bias in its RoPE epilogue writes exactly what the split path
    (Store GEMV, then rope_kv_append with the bias) writes, bit for bit, and what the fp32 reference
    says within bf16's rounding."""
    N = (H + 2 * Hkv) * D
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x = (rng.standard_normal(K) * rng.uniform(0.1, 10)).astype(np.float32)
    nw = bf16_bits(1 + 0.1 * rng.standard_normal(K))
    bias = (0.5 * rng.standard_normal(N)).astype(np.float32)
    inv_freq = inv_freq_table(D)
    kc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    vc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    q, kc, vc = ops.gemv_rmsnorm_rope(
        w, s, x, nw, 1e-6, inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy(), staged_pair=staged_pair, bias=bias
    )
    qkv = ops.gemv_rmsnorm(w, s, x, nw, 1e-6, 0)
    q_ref, kc_ref, vc_ref = ops.rope_kv_append(qkv[None], inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy(), bias=bias)
    np.testing.assert_array_equal(q, q_ref[0])
    np.testing.assert_array_equal(kc, kc_ref)
    np.testing.assert_array_equal(vc, vc_ref)
    if pos >= C:
        assert np.array_equal(kc, kc0) and np.array_equal(vc, vc0), "a position past the cache wrote into it"
    xn = from_f16(ops.rmsnorm(x[None], nw, 1e-6)[0])
    want = reference_qkv(reference_linear(w, s, xn)[None].astype(np.float32), inv_freq, [pos], H, Hkv, D, bias)
    assert_close(from_bf16(q)[None], want[:, :H], "fused rope q with bias")
    if pos < C:
        assert_close(from_bf16(kc[pos])[None], want[:, H : H + Hkv], "fused rope k with bias")
        assert_close(from_bf16(vc[pos])[None], want[:, H + Hkv :], "fused v with bias")


def test_gemv_rmsnorm_rope_zero_bias_changes_nothing(rng):
    """A zero bias leaves every value as the launch without one writes it (-0.0 + 0.0 = +0.0 aside)."""
    H, Hkv, D, K = 24, 8, 128, 3072
    N = (H + 2 * Hkv) * D
    w, s = random_fp8(rng, (N, K)), random_scales(rng, N, K)
    x, nw = rng.standard_normal(K).astype(np.float32), bf16_bits(1 + 0.1 * rng.standard_normal(K))
    kc = bf16_bits(rng.standard_normal((8, Hkv, D)))
    a = ops.gemv_rmsnorm_rope(w, s, x, nw, 1e-5, inv_freq_table(D), 3, H, Hkv, D, kc.copy(), kc.copy())
    zero = np.zeros(N, np.float32)
    b = ops.gemv_rmsnorm_rope(w, s, x, nw, 1e-5, inv_freq_table(D), 3, H, Hkv, D, kc.copy(), kc.copy(), bias=zero)
    for u, v in zip(a, b):
        assert np.isfinite(from_bf16(u)).all() and np.isfinite(from_bf16(v)).all()
        np.testing.assert_array_equal(from_bf16(u), from_bf16(v))


# ----------------------------------------------------------------------------- attention on the raw QKV row


# Qwen3 (8B: 32 / 8, 14B: 40 / 8, 32B: 64 / 8, 0.6B: 16 / 8), Qwen2.5 (0.5B: 14 / 2 of 64, 7B: 28 / 4), a
# ratio split over two blocks per kv head (16 / 1), the other head dims.
@pytest.mark.parametrize(
    "H,Hkv,D",
    [(32, 8, 128), (40, 8, 128), (64, 8, 128), (16, 8, 128), (14, 2, 64), (28, 4, 128), (16, 1, 128), (6, 2, 96),
     (4, 1, 256), (3, 1, 80)],
)  # fmt: skip
@pytest.mark.parametrize("mode", ["none", "bias", "qk_norm", "both"])
@pytest.mark.parametrize("pos,C", [(0, 4), (31, 40), (300, 512), (4096, 4200)])
def test_attention_qkv_equals_rope_then_attention(rng, H, Hkv, D, mode, pos, C):
    """The decode step's attention on the QKV product's raw row writes what rope_kv_append followed by
    attention() writes, bit for bit: the output and the cache rows at pos, and no other cache row. The
    token's own row and every row past it start as NaN, so a read before the write or past the causal
    range shows; the heads' magnitudes differ, so a norm taken over the wrong head shows."""
    W = (H + 2 * Hkv) * D
    scale = 10.0 ** rng.uniform(-1, 1, size=(H + 2 * Hkv, 1))
    qkv = (rng.standard_normal((H + 2 * Hkv, D)) * scale).astype(np.float32).reshape(W)
    bias, qn, kn = extras(rng, mode, H, Hkv, D) if mode != "none" else (None, None, None)
    inv_freq = inv_freq_table(D)
    kc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    vc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    kc0[pos:] = vc0[pos:] = 0x7FC0  # bf16 NaN
    kw = dict(bias=bias, q_norm=qn, k_norm=kn, eps=1e-6)
    for merge, early, halved in ((True, True, False), (True, False, False), (False, True, False), (True, True, True)):
        out, kc, vc = ops.attention_qkv(
            qkv, inv_freq, pos, H, Hkv, kc0.copy(), vc0.copy(), cluster_merge=merge, early=early, halved=halved, **kw
        )
        q, kc_ref, vc_ref = ops.rope_kv_append(qkv[None], inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy(), **kw)
        want = ops.attention(q, kc_ref, vc_ref, pos, cluster_merge=merge, halved=halved)
        np.testing.assert_array_equal(kc, kc_ref)
        np.testing.assert_array_equal(vc, vc_ref)
        assert np.isfinite(from_bf16(out)).all(), f"non-finite output (merge={merge}, early={early}, halved={halved})"
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("pos,C,v_scale", [(5, 8, 1e5), (2000, 2048, 1.0)])  # the first overflows fp16
def test_attention_qkv_f16_output(rng, pos, C, v_scale):
    """The decode step's fp16 hand-off to o: the same bits and overflow flag as attention()'s."""
    H, Hkv, D = 32, 8, 128
    qkv = rng.standard_normal((H + 2 * Hkv) * D).astype(np.float32)
    bias, qn, kn = extras(rng, "qk_norm", H, Hkv, D)
    inv_freq = inv_freq_table(D)
    kc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    vc0 = bf16_bits(rng.standard_normal((C, Hkv, D)) * v_scale)
    kw = dict(bias=bias, q_norm=qn, k_norm=kn, eps=1e-6)
    (bits, flag), _, _ = ops.attention_qkv(qkv, inv_freq, pos, H, Hkv, kc0.copy(), vc0.copy(), out_dtype="f16", **kw)
    q, kc, vc = ops.rope_kv_append(qkv[None], inv_freq, pos, H, Hkv, D, kc0.copy(), vc0.copy(), **kw)
    want_bits, want_flag = ops.attention(q, kc, vc, pos, out_dtype="f16")
    np.testing.assert_array_equal(bits, want_bits)
    assert flag == want_flag == (v_scale > 1e4)


def test_attention_qkv_rejects_bad_arguments(rng):
    H, Hkv, D = 4, 2, 64
    qkv = np.zeros((H + 2 * Hkv) * D, np.float32)
    kc = bf16_bits(np.zeros((8, Hkv, D)))
    with pytest.raises(ValueError, match="come together"):
        ops.attention_qkv(qkv, inv_freq_table(D), 0, H, Hkv, kc, kc.copy(), q_norm=bf16_bits(np.ones(D)))
    with pytest.raises(ValueError):  # the token past the cache
        ops.attention_qkv(qkv, inv_freq_table(D), 8, H, Hkv, kc, kc.copy())
    with pytest.raises(ValueError):  # qkv of another shape
        ops.attention_qkv(qkv[:-1], inv_freq_table(D), 0, H, Hkv, kc, kc.copy())
