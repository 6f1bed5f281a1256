"""The sandbox on the GPU (marker `gpu`, skipped without one):
- paged attention is the contiguous kernel with another addressing policy: the same K/V
  scattered into random blocks of a pool (the other blocks NaN) gives the SAME bits as the
  batched-contiguous and the core's attention(), and matches a float64 reference, for every
  block size, head_dim 64/128, GQA ratios 1..16, batches of different lengths, outputs poisoned;
- the batched (contiguous) launcher at head_dim 80, 96, 256;
- attention calls of different shapes in a row on one scratch give the bits each gives alone;
- rope_kv_append_slots equals the core's rope_kv_append bit for bit;
- a batch of sequences through PagedModel + the scheduler gives each sequence the greedy tokens
  of single-stream decode with the core engine (atomflow.Engine, backend='cuda'), and B = 1
  reproduces the core's logits bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")
from numerics import bf16_bits, from_bf16  # noqa: E402


def _load():
    try:
        from atomflow import _sandbox
    except ImportError as e:
        return None, f"atomflow._sandbox is not importable ({e})"
    ok, why = _sandbox.cuda_available()
    return (_sandbox, "") if ok else (None, why)


sb, WHY_NOT = _load()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(sb is None, reason=f"gpu: {WHY_NOT}")]
NAN16 = 0x7FC0  # bf16 NaN


def reference_attention(q, k, v, n_keys, M, scale):
    """float64: q [M, H, D], k/v [n_keys, Hkv, D]; query m sees keys [0, n_keys - M + m]."""
    H, Hkv = q.shape[1], k.shape[1]
    G = H // Hkv
    out = np.empty(q.shape)
    for m in range(M):
        n = n_keys - M + m + 1
        for h in range(Hkv):
            s = q[m, h * G : (h + 1) * G] @ k[:n, h].T * scale
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[m, h * G : (h + 1) * G] = (p / p.sum(axis=1, keepdims=True)) @ v[:n, h]
    return out


def place(rng, lens, bs, spare_blocks=5):
    """Random block tables for sequences of these lengths: tables int32 [B, max_blocks] (entries past a
    sequence's blocks point at spare blocks, which hold NaN) and the pool size."""
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + spare_blocks
    perm = rng.permutation(num_blocks)
    tables = rng.choice(perm[sum(need) :], size=(len(lens), max(need) + 1)).astype(np.int32)
    at = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[at : at + k]
        at += k
    return tables, num_blocks


def fill_pool(caches, lens, tables, num_blocks, bs):
    """Per-sequence caches [B, C, Hkv, D] -> a NaN pool [num_blocks, bs, Hkv, D] holding them at their blocks."""
    pool = np.full((num_blocks, bs) + caches.shape[2:], NAN16, np.uint16)
    for b, n in enumerate(lens):
        for j in range(-(-n // bs)):
            rows = caches[b, j * bs : min((j + 1) * bs, n)]
            pool[tables[b, j], : len(rows)] = rows
    return pool


def check_paged(rng, lens, M, Hkv, G, D, bs):
    B, H, scale = len(lens), Hkv * G, 1.0 / np.sqrt(D)
    C = max(lens)
    kc = bf16_bits(rng.standard_normal((B, C, Hkv, D)))
    vc = bf16_bits(rng.standard_normal((B, C, Hkv, D)))
    for b, n in enumerate(lens):
        kc[b, n:] = vc[b, n:] = NAN16  # rows past a sequence's length must never be read
    q = bf16_bits(rng.standard_normal((B, M, H, D)) * 2.0)
    tables, num_blocks = place(rng, lens, bs)
    kp, vp = fill_pool(kc, lens, tables, num_blocks, bs), fill_pool(vc, lens, tables, num_blocks, bs)
    lens_a = np.array(lens, np.int32)
    what = f"lens={lens} M={M} Hkv={Hkv} G={G} D={D} block_size={bs}"
    paged = sb.attention_paged(q, kp, vp, tables, lens_a, scale)
    batched = sb.attention_batched(q, kc, vc, lens_a, scale)
    assert np.isfinite(from_bf16(paged)).all(), f"{what}: non-finite output (unwritten, or read a NaN block)"
    np.testing.assert_array_equal(paged, batched, err_msg=f"{what}: paged != contiguous (bits)")
    for b, n in enumerate(lens):
        got = from_bf16(paged[b * M : (b + 1) * M])
        want = reference_attention(from_bf16(q[b]), from_bf16(kc[b]), from_bf16(vc[b]), n, M, scale)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 6e-3, f"{what} sequence {b}: rel-L2 {err:.2e}"
        if B == 1:  # the core's own launcher: same split count only when the batch is one sequence
            core = sb.attention_contiguous(q[b], kc[b], vc[b], n - M, scale)
            np.testing.assert_array_equal(paged, core, err_msg=f"{what}: != the core's attention()")


@pytest.mark.parametrize("bs", [16, 32, 64, 128, 8, 256])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_paged_decode_equals_contiguous(rng, bs, D, G):
    for B in (1, 3, 8):
        lens = [int(n) for n in rng.integers(1, 700, B)]
        lens[0] = bs * 2  # a sequence ending exactly on a block boundary
        if B > 2:
            lens[1] = 1
        check_paged(rng, lens[:B], 1, 2, G, D, bs)


@pytest.mark.parametrize("G", range(1, 17))
def test_paged_every_ratio_equals_contiguous(rng, G):
    """Every GQA ratio 1..16 (past 8 query heads per KV head, several blocks per KV head), decode and a
    prefill chunk, the head_dims the paged policy is built for."""
    D = 64 if G % 2 else 128
    check_paged(rng, [700, 1, 64], 1, 2, G, D, 16)
    check_paged(rng, [300, 17], 17, 3, G, D, 32)


def check_batched(rng, lens, M, Hkv, G, D):
    """attention_batched (contiguous caches [B, C, Hkv, D], rows past each sequence NaN) against the
    float64 reference."""
    B, H, scale = len(lens), Hkv * G, 1.0 / np.sqrt(D)
    kc = bf16_bits(rng.standard_normal((B, max(lens), Hkv, D)))
    vc = bf16_bits(rng.standard_normal((B, max(lens), Hkv, D)))
    for b, n in enumerate(lens):
        kc[b, n:] = vc[b, n:] = NAN16
    q = bf16_bits(rng.standard_normal((B, M, H, D)) * 2.0)
    got = sb.attention_batched(q, kc, vc, np.array(lens, np.int32), scale)
    for b, n in enumerate(lens):
        want = reference_attention(from_bf16(q[b]), from_bf16(kc[b]), from_bf16(vc[b]), n, M, scale)
        out = from_bf16(got[b * M : (b + 1) * M])
        assert np.isfinite(out).all(), f"lens={lens} M={M} G={G} D={D}: non-finite output"
        err = np.linalg.norm(out - want) / np.linalg.norm(want)
        assert err < 6e-3, f"lens={lens} M={M} G={G} D={D} sequence {b}: rel-L2 {err:.2e}"


@pytest.mark.parametrize("D", [80, 96, 256])
@pytest.mark.parametrize("G", [1, 5, 7, 16])
def test_batched_head_dims(rng, D, G):
    """The batched (contiguous) launcher takes every head_dim the core does (the paged one: 64, 128)."""
    check_batched(rng, [700, 1, 64], 1, 2, G, D)
    check_batched(rng, [300, 17], 17, 2, G, D)


@pytest.mark.slow
@pytest.mark.parametrize("bs", [16, 128])
def test_paged_decode_long_context(rng, bs):
    check_paged(rng, [5000, 33000], 1, 8, 4, 128, bs)  # every split in use


@pytest.mark.parametrize("M", [2, 17, 64])
@pytest.mark.parametrize("bs", [16, 64])
def test_paged_prefill_chunk_equals_contiguous(rng, M, bs):
    check_paged(rng, [M + 40, M], M, 2, 4, 128, bs)
    check_paged(rng, [M + 300], M, 2, 3, 64, bs)


def test_paged_rejects_unsupported():
    z = lambda *s: np.zeros(s, np.uint16)  # noqa: E731
    t, n = np.zeros((1, 2), np.int32), np.array([1], np.int32)
    with pytest.raises(ValueError, match="block_size"):
        sb.attention_paged(z(1, 1, 4, 64), z(4, 12, 2, 64), z(4, 12, 2, 64), t, n)
    with pytest.raises(ValueError, match="head_dim must be 64 or 128"):  # the core's attention takes 96
        sb.attention_paged(z(1, 1, 4, 96), z(4, 16, 2, 96), z(4, 16, 2, 96), t, n)
    with pytest.raises(ValueError, match="GQA"):
        sb.attention_paged(z(1, 1, 34, 64), z(4, 16, 2, 64), z(4, 16, 2, 64), t, n)  # G = 17


def test_attention_calls_share_one_scratch(rng):
    """Calls in a row on ONE scratch, as the engines make them (decode, prefill chunks, batches of
    other sizes): the kernel's last block per group merges on a counter in the scratch, so every call
    must leave the counters zero and never write partials over them. A counter left behind makes the
    next call skip its merge (outputs stay poisoned); each call must give the bits it gives alone."""
    Hkv, G, D = 2, 4, 128
    H = Hkv * G
    shapes = [([3000], 1), ([700, 5, 2048], 1), ([300], 17), ([3000], 1), ([64, 900], 64), ([1], 1), ([2500], 1)]
    calls = []
    for lens, M in shapes:
        B, C = len(lens), max(lens)
        kc = bf16_bits(rng.standard_normal((B, C, Hkv, D)))
        vc = bf16_bits(rng.standard_normal((B, C, Hkv, D)))
        q = bf16_bits(rng.standard_normal((B, M, H, D)) * 2.0)
        calls.append((q, kc, vc, np.array(lens, np.int32)))
    outs = sb.attention_batched_calls(calls)
    for i, ((q, kc, vc, lens), got) in enumerate(zip(calls, outs)):
        M = q.shape[1]
        what = f"call {i}: lens={lens.tolist()} M={M}"
        assert np.isfinite(from_bf16(got)).all(), f"{what}: non-finite output (merge skipped?)"
        np.testing.assert_array_equal(
            got, sb.attention_batched(q, kc, vc, lens), err_msg=f"{what}: shared scratch != a fresh one"
        )
        for b, n in enumerate(lens):
            want = reference_attention(from_bf16(q[b]), from_bf16(kc[b]), from_bf16(vc[b]), int(n), M, 1 / np.sqrt(D))
            err = np.linalg.norm(from_bf16(got[b * M : (b + 1) * M]) - want) / np.linalg.norm(want)
            assert err < 6e-3, f"{what} sequence {b}: rel-L2 {err:.2e}"


def test_rope_slots_equals_core_rope(rng):
    core = pytest.importorskip("atomflow._core")
    H, Hkv, D, M, pos, C = 24, 8, 128, 7, 300, 320
    qkv = rng.standard_normal((M, (H + 2 * Hkv) * D)).astype(np.float32)
    inv_freq = (1.0 / 500000.0 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    kc0 = bf16_bits(rng.standard_normal((C, Hkv, D)))
    q_core, k_core, v_core = core.ops.rope_kv_append(qkv, inv_freq, pos, H, Hkv, D, kc0.copy(), kc0.copy())
    S = 4 * C
    slots = rng.choice(S, M, replace=False).astype(np.int32)
    slots[-1] = S + 5  # outside the pool: rotated into q, written nowhere
    positions = np.arange(pos, pos + M, dtype=np.int32)
    kp0 = bf16_bits(rng.standard_normal((S, Hkv, D)))
    q, kp, vp = sb.rope_kv_append_slots(qkv, inv_freq, positions, slots, H, Hkv, D, kp0, kp0.copy())
    np.testing.assert_array_equal(q, q_core)
    np.testing.assert_array_equal(kp[slots[:-1]], k_core[pos : pos + M - 1])
    np.testing.assert_array_equal(vp[slots[:-1]], v_core[pos : pos + M - 1])
    untouched = np.setdiff1d(np.arange(S), slots[:-1])
    assert np.array_equal(kp[untouched], kp0[untouched]) and np.array_equal(vp[untouched], kp0[untouched])


def test_argmax_rows(rng):
    x = rng.standard_normal((5, 1000)).astype(np.float32)
    x[1, [3, 700]] = 50.0  # tie: the lower index
    x[2, :] = -np.inf
    x[3, 10] = np.nan
    got = sb.argmax_rows(x)
    want = [int(np.argmax(np.nan_to_num(r, nan=-np.inf))) for r in x]
    assert got.tolist() == want


# ----------------------------------------------------------------------------- the batched model


class Recording:
    """SandboxModel that also keeps the logits of every step (for comparing with the core)."""

    def __init__(self, model):
        self.m, self.logits = model, []
        for k in ("block_size", "num_blocks", "max_seqs", "max_rows", "max_blocks_per_seq"):
            setattr(self, k, getattr(model, k))

    def step(self, *args, **kw):
        nxt, logits = self.m.impl.step(*args, want_logits=True, **kw)
        self.logits.append(logits)
        return nxt

    def copy_blocks(self, copies):
        self.m.copy_blocks(copies)

    @property
    def last_step_ms(self):
        return self.m.last_step_ms


def run_batched(model_path, prompts, n_new, block_size=16, fork_at=None, **load):
    """Greedy tokens and per-token logits of each prompt, all decoded in one batch."""
    from atomflow.sandbox.model import SandboxModel
    from atomflow.sandbox.scheduler import Scheduler

    rec = Recording(SandboxModel.load(model_path, block_size=block_size, **load))
    sch = Scheduler(rec)
    rids = [sch.add(p, n_new) for p in prompts]
    logits = {r: [] for r in rids}
    forked = None
    while sch.has_work:
        rep = sch.step()
        for i, (rid, _) in enumerate(rep.tokens):
            logits.setdefault(rid, []).append(rec.logits[-1][i])
        room = len(sch.running) + (sch.prefilling is not None) < sch.max_batch
        if fork_at is not None and forked is None and room and any(len(r.output) >= fork_at for r in sch.running):
            parent = next(r for r in sch.running if len(r.output) >= fork_at)
            forked = (sch.fork(parent.rid), parent.rid)
    out = {rid: r.output for rid, r in sch.finished.items()}
    return rids, out, logits, forked, sch


def core_check(eng, prompt, tokens, logits, what):
    """Teacher-forced single-stream decode with the core: at every step the batched token must be
    the core's greedy token (or tie with it within 1e-3 of the logit spread), and the logits close."""
    eng.reset()
    want = eng.prefill(np.asarray(prompt, np.int32))
    for i, (tok, got) in enumerate(zip(tokens, logits)):
        cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
        assert cos >= 0.9999, f"{what} token {i}: logits cosine {cos:.6f} vs the core"
        best = int(np.argmax(want))
        assert tok == best or want[best] - want[tok] <= 1e-3 * (want.max() - want.min()), (
            f"{what} token {i}: batched {tok}, core {best} (margin {want[best] - want[tok]:.3e})"
        )
        if i + 1 < len(tokens):
            want = eng.decode(tok)


def test_batch_matches_single_stream_core(tiny_model_file):
    from atomflow import Engine

    eng = Engine.load(tiny_model_file, backend="cuda", max_context=1024)
    rng = np.random.default_rng(3)
    vocab = eng.spec.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 40, 300, 17, 1, 100, 64, 250)]
    rids, out, logits, forked, sch = run_batched(
        tiny_model_file, prompts, 24, block_size=16, fork_at=5, max_batch=9, max_context=1024
    )  # 8 prompts + the fork
    for rid, p in zip(rids, prompts):
        assert len(out[rid]) == 24
        core_check(eng, p, out[rid], logits[rid], f"sequence {rid} ({len(p)}-token prompt)")
    assert forked is not None, "the fork never happened"
    child, parent = forked
    assert out[child] == out[parent], "a forked sequence must continue exactly as its parent (copy-on-write)"
    assert sch.bm.stats["cow_copies"] >= 1 and sch.bm.num_used == 0


@pytest.mark.parametrize("block_size", [16, 64])
def test_single_sequence_bit_identical_to_core(tiny_model_file, block_size):
    """B = 1 takes the core's M = 1 kernels and the same attention split count: from a one-token prompt
    (one M = 1 step on both) every decode step's logits are the core's bits."""
    from atomflow.backends.cuda import CudaBackend
    from atomflow.model.fileformat import AtomflowFile

    eng = CudaBackend(AtomflowFile(tiny_model_file), 1024, verbose=False)
    prompt = [7]
    rids, out, logits, _, _ = run_batched(tiny_model_file, [prompt], 24, block_size=block_size, max_batch=1, max_context=1024)
    eng.reset()
    want = eng.prefill(np.asarray(prompt, np.int32))
    for i, tok in enumerate(out[rids[0]]):
        np.testing.assert_array_equal(logits[rids[0]][i], want, err_msg=f"step {i}")
        want = eng.decode(tok)


def test_single_sequence_prefill_follows_core(tiny_model_file):
    """A 300-token prompt (chunks of 256 + 44 on both): the core prefills on its tensor-core attention,
    the sandbox on the paged CUDA-core kernel, so the bits differ; the logits of every step stay within
    the core's reference tolerance of the core teacher-forced on the sandbox's tokens."""
    from atomflow.backends.cuda import CudaBackend
    from atomflow.model.fileformat import AtomflowFile

    eng = CudaBackend(AtomflowFile(tiny_model_file), 1024, verbose=False, prefill_chunk=256)
    prompt = np.random.default_rng(5).integers(0, eng.spec.vocab_size, 300).tolist()
    rids, out, logits, _, _ = run_batched(tiny_model_file, [prompt], 12, max_batch=1, max_context=1024)
    eng.reset()
    want = eng.prefill(np.asarray(prompt, np.int32))
    for i, tok in enumerate(out[rids[0]]):
        got = np.asarray(logits[rids[0]][i], np.float64)
        cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert cos >= 0.9999 and rel <= 1e-2, f"step {i}: cosine {cos:.6f}, rel-L2 {rel:.2e}"
        want = eng.decode(tok)


def test_preemption_and_prefix_cache_keep_tokens(tiny_model_file):
    """A pool too small for the batch (preemption + recompute) and a shared prompt prefix (prefix
    hits) must not change a single token against a roomy run without caching."""
    from atomflow.sandbox.model import SandboxModel
    from atomflow.sandbox.scheduler import Scheduler

    rng = np.random.default_rng(11)
    system = rng.integers(0, 200, 96).tolist()
    prompts = [system + rng.integers(0, 200, int(n)).tolist() for n in rng.integers(1, 40, 6)]
    n_new = 60

    def run(num_blocks, caching):
        m = SandboxModel.load(tiny_model_file, block_size=16, max_batch=6, max_context=512, num_blocks=num_blocks)
        sch = Scheduler(m, prefix_caching=caching)
        rids = [sch.add(p, n_new) for p in prompts]
        out = sch.run()
        return [out[r] for r in rids], sch

    want, _ = run(6 * 32, False)
    got, sch = run(30, True)
    assert got == want
    assert sum(r.preemptions for r in sch.finished.values()) > 0 and sch.bm.stats["cached_tokens"] > 0
