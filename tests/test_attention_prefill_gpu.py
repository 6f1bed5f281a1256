"""Prefill attention on tensor cores (csrc/kernels/attention_prefill.cu) against a float64 numpy causal
GQA reference on awkward sizes, and the engine's prefill (which runs it for chunks of at least the step
plan's prefill_attn_min_rows rows) against the numpy reference model across chunk edges and past
position 8192. Outputs come back poisoned (NaN) where the kernel did not write, and every cache row at
or past pos + M holds NaN: a kernel that reads one, or lets a masked one into a sum, fails.
Skipped cleanly without the CUDA core or a GPU."""

from __future__ import annotations

import gc

import numpy as np
import pytest

pytest.importorskip("ml_dtypes")
from numerics import bf16_bits, from_bf16, load_ops  # noqa: E402

ops, WHY_NOT = load_ops()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(ops is None, reason=f"gpu: {WHY_NOT}")]

BF16_NAN = 0x7FC0
# bf16 output (2^-9 relative rounding) and bf16 probabilities in the P V product (the row sum adds the
# same rounded values): a few times 2^-9 per output row.
ROW_REL = 8e-3


def reference_attention(q, kc, vc, pos, scale, block=128):
    """float64 causal GQA attention: query m (position pos + m) sees cache rows [0, pos + m]."""
    M, H, D = q.shape
    Hkv = kc.shape[1]
    G = H // Hkv
    n = pos + M
    qf, kf, vf = from_bf16(q), from_bf16(kc[:n]), from_bf16(vc[:n])
    out = np.empty((M, H, D))
    keys = np.arange(n)
    for m0 in range(0, M, block):
        m1 = min(M, m0 + block)
        visible = keys[None, :] <= pos + np.arange(m0, m1)[:, None]  # [rows, n]
        for h in range(Hkv):
            s = (qf[m0:m1, h * G : (h + 1) * G].reshape(-1, D) @ kf[:, h].T * scale).reshape(m1 - m0, G, n)
            s = np.where(visible[:, None, :], s, -np.inf)
            p = np.exp(s - s.max(axis=2, keepdims=True))
            p /= p.sum(axis=2, keepdims=True)
            out[m0:m1, h * G : (h + 1) * G] = (p.reshape(-1, n) @ vf[:, h]).reshape(m1 - m0, G, D)
    return out


def check_prefill(rng, M, pos, Hkv, G, D, key_groups=None, spare=5, kernel="auto", q_gain=2.0, splits=None):
    """M queries after pos cached keys; `spare` cache rows past pos + M hold NaN. Scores have a standard
    deviation of about q_gain. splits: the wgmma kernel's, forced (None: the plan's for pos cached keys)."""
    H = Hkv * G
    C = pos + M + spare
    kc = bf16_bits(rng.standard_normal((C, Hkv, D)))
    vc = bf16_bits(rng.standard_normal((C, Hkv, D)))
    kc[pos + M :] = vc[pos + M :] = BF16_NAN
    q = bf16_bits(rng.standard_normal((M, H, D)) * q_gain)
    scale = 1.0 / np.sqrt(D)
    got = from_bf16(ops.attention_prefill(q, kc, vc, pos, scale, key_groups=key_groups, kernel=kernel, splits=splits))
    what = f"attention_prefill M={M} pos={pos} Hkv={Hkv} G={G} D={D} key_groups={key_groups} kernel={kernel} splits={splits}"
    bad = ~np.isfinite(got)
    assert not bad.any(), f"{what}: {int(bad.sum())} non-finite outputs, first at {np.argwhere(bad)[0]}"
    want = reference_attention(q, kc, vc, pos, scale)
    err = np.linalg.norm(got - want, axis=2) / np.maximum(np.linalg.norm(want, axis=2), 1e-300)  # [M, H]
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() < ROW_REL, f"{what}: rel-L2 {err.max():.3e} at (query, head) {worst}"


# Both kernels at head_dim 128 (wgmma is the plan's there); head_dim 64 has the mma kernel only.
KERNELS = [(128, "mma"), (128, "wgmma"), (64, "mma")]


@pytest.mark.parametrize("D,kernel", KERNELS)
@pytest.mark.parametrize("pos", [0, 1, 300, 8192 + 5])
@pytest.mark.parametrize("M", [1, 2, 17, 64, 65, 100, 127, 128, 129, 511, 512, 1000])
def test_prefill_attention_sizes(rng, M, pos, D, kernel):
    check_prefill(rng, M, pos, 2, 3 if D == 128 else 4, D, kernel=kernel)


@pytest.mark.parametrize("D,kernel", KERNELS)
@pytest.mark.parametrize("G", [1, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("M,pos", [(1, 0), (17, 1), (65, 300), (100, 0), (200, 8192 + 5)])
def test_prefill_attention_ratios(rng, M, pos, G, D, kernel):
    check_prefill(rng, M, pos, 2, G, D, kernel=kernel)


@pytest.mark.parametrize("D,kernel", KERNELS)
@pytest.mark.parametrize("M,pos", [(100, 300), (129, 4000)])
def test_prefill_attention_peaked_scores(rng, M, pos, D, kernel):
    """Scores ~60 log2 units apart per standard deviation: most of a row's probabilities fall under 2^-126
    of its max (flushed to 0 by the exponential) and the running max moves by hundreds of units between
    tiles; the rows still match the float64 softmax."""
    check_prefill(rng, M, pos, 2, 3 if D == 128 else 4, D, kernel=kernel, q_gain=40.0)


@pytest.mark.parametrize("splits", [2, 3, 7, 32])
@pytest.mark.parametrize("M,pos,Hkv,G", [(32, 4000, 8, 3), (300, 700, 2, 4), (5, 129, 1, 8), (129, 8192 + 5, 2, 3)])
def test_prefill_attention_splits(rng, splits, M, pos, Hkv, G):
    """The wgmma kernel's keys split over blocks whose partials (poisoned scratch) a second kernel merges:
    splits of several tiles, of one, and empty ones (a block whose rows see fewer key tiles than splits)."""
    check_prefill(rng, M, pos, Hkv, G, 128, kernel="wgmma", splits=splits)


def test_prefill_attention_splits_past_a_warp_are_refused():
    """The merge reads one split a lane: a forced count past 32 is refused before any launch."""
    z = lambda *s: np.zeros(s, np.uint16)  # noqa: E731
    with pytest.raises(ValueError, match="splits must be in 1..32"):
        ops.attention_prefill(z(4, 2, 128), z(8, 1, 128), z(8, 1, 128), 0, kernel="wgmma", splits=33)


def test_prefill_attention_split_plan(rng):
    """A short chunk deep in the context splits its keys over the SMs its blocks leave idle, a chunk whose
    blocks leave a partial wave into fuller waves; a long one, or one at the start, does not (and needs no
    scratch). The rule itself: tests/test_attention_prefill_plan.py."""
    from atomflow import _core

    sms = _core.device_info()["sm_count"]
    deep = ops.attention_prefill_plan(32, 24, 8, 128, prior=4096)  # 8 blocks over 33 key tiles
    assert deep == ops.attention_prefill_plan(32, 24, 8, 128, prior=4096, sm_count=sms) and deep["splits"] >= 2
    assert deep["kernel"] == f"attention_prefill_wgmma<D=128> x {deep['splits']} splits"
    assert deep["scratch_bytes"] == 32 * 24 * deep["splits"] * (128 + 2) * 4
    for M, prior in [(32, 0), (4096, 4096), (512, 0)]:
        p = ops.attention_prefill_plan(M, 24, 8, 128, prior=prior)
        assert p["splits"] == 1 and p["scratch_bytes"] == 0, (M, prior, p)
    check_prefill(rng, 32, 4096, 8, 3, 128)  # the plan's splits through the default path
    check_prefill(rng, 8, 1000, 8, 3, 128)  # a short chunk's
    wide = ops.attention_prefill_plan(512, 24, 8, 128, prior=4096)  # 96 blocks: four splits on 132 SMs
    if sms == 132:
        assert wide["splits"] == 4
    check_prefill(rng, 512, 4096, 8, 3, 128)


def test_prefill_attention_kernels_agree(rng):
    """The two kernels on one chunk deep in the context agree within bf16 rounding (each is held to the
    float64 reference by the tests above)."""
    M, pos, Hkv, G, D = 300, 2000, 2, 4, 128
    C = pos + M
    kc = bf16_bits(rng.standard_normal((C, Hkv, D)))
    vc = bf16_bits(rng.standard_normal((C, Hkv, D)))
    q = bf16_bits(rng.standard_normal((M, Hkv * G, D)) * 2.0)
    a = from_bf16(ops.attention_prefill(q, kc, vc, pos, kernel="mma"))
    b = from_bf16(ops.attention_prefill(q, kc, vc, pos, kernel="wgmma"))
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 4e-3


@pytest.mark.parametrize("key_groups", [1, 2])
@pytest.mark.parametrize("M,pos,G,D", [(1, 0, 1, 64), (64, 63, 3, 128), (300, 700, 4, 128), (130, 64, 7, 64)])
def test_prefill_attention_key_groups(rng, key_groups, M, pos, G, D):
    """Both block shapes: one group of 4 warps over every key tile, and two groups on alternate tiles
    merged in shared memory (including a group that gets no tile: keys <= 64)."""
    check_prefill(rng, M, pos, 2, G, D, key_groups=key_groups)
    assert ops.attention_prefill_plan(M, 2 * G, 2, D, key_groups=key_groups)["key_groups"] == key_groups


@pytest.mark.parametrize("D", [80, 96])
def test_prefill_attention_other_head_dims(rng, D):
    check_prefill(rng, 70, 90, 2, 3, D)


def test_prefill_attention_3b_shape(rng):
    """Llama 3.2 3B's attention (H 24, Hkv 8, D 128) for a 256-row chunk deep in the context."""
    check_prefill(rng, 256, 4000, 8, 3, 128)


def test_prefill_attention_matches_decode_kernel(rng):
    """The CUDA-core kernel (attention_decode.cu) and this one agree on a prefill chunk."""
    M, pos, Hkv, G, D = 97, 410, 2, 4, 128
    C = pos + M
    kc = bf16_bits(rng.standard_normal((C, Hkv, D)))
    vc = bf16_bits(rng.standard_normal((C, Hkv, D)))
    q = bf16_bits(rng.standard_normal((M, Hkv * G, D)))
    a = from_bf16(ops.attention_prefill(q, kc, vc, pos))
    b = from_bf16(ops.attention(q, kc, vc, pos))
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 4e-3


def test_prefill_attention_plan():
    p = ops.attention_prefill_plan(512, 24, 8, 128, kernel="mma")
    assert p["tiles"] == 512 * 3 // 64 and p["blocks"] == 8 * p["tiles"]
    assert p["key_groups"] in (1, 2) and p["threads"] == 128 * p["key_groups"]
    assert p["kernel"] == f"attention_prefill<D=128, KG={p['key_groups']}>"
    assert p["smem"] == (64 * 136 + p["key_groups"] * 4 * 64 * 136) * 2
    w = ops.attention_prefill_plan(512, 24, 8, 128)  # the plan's kernel at head_dim 128
    assert w["kernel"] == "attention_prefill_wgmma<D=128>" and w["threads"] == 256
    # Q and three stages of K and V, 128 x 128 bf16 each, and 1 KB to align them
    assert w["tiles"] == 512 * 3 // 128 and w["smem"] == 7 * 128 * 128 * 2 + 1024
    assert ops.attention_prefill_plan(512, 24, 8, 64)["kernel"].startswith("attention_prefill<D=64")


def test_prefill_attention_rejects_unsupported():
    z = lambda *s: np.zeros(s, np.uint16)  # noqa: E731
    with pytest.raises(ValueError, match="head_dim"):
        ops.attention_prefill(z(4, 2, 256), z(8, 2, 256), z(8, 2, 256), 0)
    with pytest.raises(ValueError, match="16 query heads"):
        ops.attention_prefill(z(4, 17, 64), z(8, 1, 64), z(8, 1, 64), 0)
    with pytest.raises(ValueError, match="pos \\+ M"):
        ops.attention_prefill(z(4, 2, 64), z(8, 1, 64), z(8, 1, 64), 5)
    with pytest.raises(ValueError, match="head_dim 128"):
        ops.attention_prefill(z(4, 2, 64), z(8, 1, 64), z(8, 1, 64), 0, kernel="wgmma")
    with pytest.raises(ValueError, match="kernel must be"):
        ops.attention_prefill(z(4, 2, 64), z(8, 1, 64), z(8, 1, 64), 0, kernel="fa3")


# ----------------------------------------------------------------------------- the engine's prefill


def _engine_case(model, ids, split, max_context, prefill_chunk=None, check_plan=None):
    """Prefill ids (in calls cut at `split`) on the numpy reference and the CUDA engine; the last
    row's logits must agree after each call, then two decode steps."""
    from atomflow import _core
    from atomflow.backends.cpu import CpuBackend

    ref = CpuBackend(model, max_context)
    kw = {} if prefill_chunk is None else dict(prefill_chunk=prefill_chunk)
    eng = _core.Engine(
        str(model.path), model.spec.to_dict(), model.tensor_table(), model.spec.rope_inv_freq(), max_context, verbose=False, **kw
    )
    try:
        plan = eng.step_plan["prefill_attention"]
        assert 2 <= plan["min_rows"] <= 256  # the default chunks run on tensor cores
        if check_plan is not None:
            check_plan(eng.step_plan)
        start = 0
        for end in [*split, len(ids)]:
            part = ids[start:end]
            want, got = ref.prefill(part), eng.prefill(part)
            assert_logits(got, want, f"prefill of {len(part)} tokens at {start}")
            start = end
        for step in range(2):
            token = int(np.argmax(want))
            want, got = ref.decode(token), eng.decode(token)
            assert_logits(got, want, f"decode step {step} at {len(ids) + step}")
    finally:
        del eng
        gc.collect()


def assert_logits(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), f"{what}: non-finite logits"
    cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert cos >= 0.9999 and rel <= 1e-2, f"{what}: cosine {cos:.6f}, rel-L2 {rel:.2e}"


def _prompt(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


@pytest.fixture(scope="module")
def tiny(tiny_model_file):
    from atomflow.model.fileformat import AtomflowFile

    return AtomflowFile(tiny_model_file)


@pytest.fixture(scope="module")
def d128(tmp_path_factory, make_tiny_model):
    """A small random Llama with head_dim 128 and 4 query heads on one kv head (the tiny preset has 64)."""
    from atomflow.model.fileformat import AtomflowFile
    from atomflow.model.quantize import quantize

    make_tiny_model.PRESETS.setdefault("test-d128", make_tiny_model.Preset(512, 1024, 2, 4, 1, 128, None, 8.0, 64, 16384, True))
    root = tmp_path_factory.mktemp("d128")
    hf = make_tiny_model.make_model(root / "hf", preset="test-d128", seed=1)
    quantize(hf, root / "model.atomflow", progress=False, log=lambda s: None)
    return AtomflowFile(root / "model.atomflow")


@pytest.mark.parametrize("n,split", [(33, []), (256, []), (300, [100]), (777, [256, 300])])
def test_engine_prefill_chunk_edges(tiny, n, split):
    """Chunks of 256 rows and tails of 44, 33, 100 and 221 rows: tensor cores; tails under the
    threshold (and a 7-row chunking) keep the decode kernel."""
    _engine_case(tiny, _prompt(n, tiny.spec.vocab_size, n), split, 1024, prefill_chunk=256)


def test_engine_prefill_small_chunks_keep_decode_kernel(tiny):
    """head_dim 64 (the mma.sync kernel, no key splits): chunks under the threshold keep the decode kernel at
    any depth."""

    def no_deep(plan):
        assert plan["prefill_attention"]["deep_prior"] is None

    _engine_case(tiny, _prompt(100, tiny.spec.vocab_size, 5), [], 256, prefill_chunk=7, check_plan=no_deep)


def test_engine_prefill_past_8192(tiny):
    """8300 tokens in two calls (the second crosses position 8192; the default chunks of 2048 rows): every
    key tile of a long context."""
    _engine_case(tiny, _prompt(8300, tiny.spec.vocab_size, 1), [5000], 8448)


@pytest.mark.parametrize("n,split", [(300, [200]), (8292, [8000]), (2100, [2048])])
def test_engine_prefill_head_dim_128(d128, n, split):
    """The wgmma kernel in the engine; the chunks of 292 rows at 8000 and 52 at 2048 split their keys."""
    _engine_case(d128, _prompt(n, d128.spec.vocab_size, 2), split, 8448)


def test_engine_prefill_short_chunks_deep_in_a_context(d128):
    """Prompt chunks of 7 rows (and a tail of 3) after 64 or more cached keys take the wgmma kernel with its
    keys split (StepPlan::prefill_attn_deep_prior), the first chunks the decode kernel. (A verify's rows keep
    the decode kernel at any depth, StepPlan::prefill_on_tensor_cores's step_rows; not checked here.)"""
    from atomflow import _core

    def deep(plan):
        if _core.device_info()["capability"][0] == 9:  # the wgmma kernel's splits
            assert plan["prefill_attention"]["deep_prior"] == 64

    _engine_case(d128, _prompt(3000, d128.spec.vocab_size, 4), [2000, 2990], 4096, prefill_chunk=7, check_plan=deep)
