"""Rung 3 of the correctness ladder: the CUDA engine (atomflow._core through CudaBackend) against
the numpy reference (CpuBackend) on the same file, plus the engine's own contract: graph == eager,
repeatable greedy output, zero allocations after load, rollback, the pipelined token ring, seeded
sampling, and the errors it must raise. Skipped (conftest) without the CUDA core or a GPU."""

from __future__ import annotations

import gc
import shutil

import numpy as np
import pytest
from engine_util import assert_close, assert_graph_and_eager_agree, cos_rel, cpu, cuda, greedy, prompt

from atomflow.model.fileformat import AtomflowFile
from atomflow.sampling import SamplingParams, sample_numpy

pytestmark = pytest.mark.gpu


# ----------------------------------------------------------------------------- helpers


def compare_run(model: AtomflowFile, ids: np.ndarray, steps: int, max_context: int, split: int | None = None, **cuda_kw) -> None:
    """Prefill ids (in two calls at `split`) on both backends, then `steps` decode steps fed with
    the reference's greedy token; the logits must agree at every step."""
    ref, eng = cpu(model, max_context), cuda(model, max_context, **cuda_kw)
    parts = [ids] if split is None else [ids[:split], ids[split:]]
    for i, part in enumerate(parts):
        want, got = ref.prefill(part), eng.prefill(part)
        assert_close(got, want, f"prefill part {i} ({len(part)} tokens at {ref.position - len(part)})")
    assert eng.position == ref.position == len(ids)
    for step in range(steps):
        token = int(np.argmax(want))
        want, got = ref.decode(token), eng.decode(token)
        assert_close(got, want, f"decode step {step} (position {ref.position - 1})")
    assert eng.position == len(ids) + steps


# ----------------------------------------------------------------------------- model files


@pytest.fixture(scope="session")
def model_files(tmp_path_factory, make_tiny_model):
    """make(preset, lm_head="fp8", untied=False) -> AtomflowFile, built once per session."""
    from atomflow.model.quantize import quantize

    cache: dict = {}

    def make(preset: str, lm_head: str = "fp8", untied: bool = False) -> AtomflowFile:
        key = (preset, lm_head, untied)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{preset}-{lm_head}{'-untied' if untied else ''}")
            hf = make_tiny_model.make_model(root / "hf", preset=preset, seed=0, untied=untied)
            quantize(hf, root / "model.atomflow", lm_head=lm_head, progress=False, log=lambda s: None)
            shutil.rmtree(hf)  # the big presets' HF copies would fill the disk
            cache[key] = AtomflowFile(root / "model.atomflow")
        return cache[key]

    return make


@pytest.fixture(scope="module")
def tiny(tiny_model_file) -> AtomflowFile:
    return AtomflowFile(tiny_model_file)


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    eng = cuda(tiny, 512)
    yield eng
    del eng
    gc.collect()


# ----------------------------------------------------------------------------- logits vs reference


@pytest.mark.parametrize(
    "lm_head,untied",
    [("fp8", False), ("bf16", False), ("bf16", True), ("fp8", True)],
    ids=["fp8-head", "tied-bf16-embed-head", "bf16-head", "fp8-untied"],
)
def test_logits_match_reference_tiny(model_files, lm_head, untied):
    model = model_files("tiny", lm_head, untied)
    compare_run(model, prompt(64, model.spec.vocab_size), steps=64, max_context=256)


@pytest.mark.parametrize("n", [1, 2, 4, 5, 9, 16, 17, 31, 32, 33, 64, 65, 255, 256, 257, 300, 513])
def test_prefill_lengths_match_reference(tiny, n):
    """Chunk edges: a one-row chunk takes the GEMV path, 2..4 rows the small-M GEMV
    (StepPlan::small_m_rows), 5..32 the skinny GEMM (skinny_min_rows, skinny_max_rows), more the sm90 GEMM;
    32 rows and more attention on tensor cores; 257 leaves a one-row last chunk."""
    compare_run(tiny, prompt(n, tiny.spec.vocab_size, seed=n), steps=2, max_context=1024)


@pytest.mark.parametrize("n", [17, 24, 32])
def test_skinny_gemm_off_takes_the_sm90_gemm(tiny, n):
    """skinny_gemm=False sends chunks of 17..32 rows to the sm90 GEMM (another rounding of w * s): the plan
    says which, and both engines match the reference."""
    ids = prompt(n, tiny.spec.vocab_size, seed=60 + n)
    on, off = cuda(tiny, 256), cuda(tiny, 256, skinny_gemm=False)
    assert on.step_plan["prefill_skinny_max_rows"] == 32 and off.step_plan["prefill_skinny_max_rows"] is None
    assert not off.step_plan["options"]["skinny_gemm"]
    want = cpu(tiny, 256).prefill(ids)
    assert_close(on.prefill(ids), want, "skinny GEMM")
    assert_close(off.prefill(ids), want, "sm90 GEMM")


@pytest.mark.parametrize("model", ["tiny", "tiny-tail"])
@pytest.mark.parametrize("n", [9, 20, 32])
def test_skinny_rope_keeps_the_two_launches_bits(model_files, model, n):
    """A skinny chunk's QKV product does RoPE + KV append in its epilogue (StepPlan::skinny_rope);
    skinny_rope=False runs rope_kv_append after the Store product instead. The same bits: the prompt's logits,
    the tokens generated after it and the logits of a step that reads the prompt's cache rows."""
    m = model_files(model)
    ids = prompt(n, m.spec.vocab_size, seed=80 + n)

    def run(**kw):
        eng = cuda(m, 256, **kw)
        last = eng.prefill(ids)
        eng.rollback(0)
        tokens = list(eng.generate_ids(ids, greedy(6)))
        eng.rollback(n)
        return eng.step_plan, last, tokens, eng.decode(tokens[0])

    on, off = run(), run(skinny_rope=False)
    assert on[0]["prefill_skinny_rope"] and not off[0]["prefill_skinny_rope"]
    assert not off[0]["options"]["skinny_rope"]
    np.testing.assert_array_equal(on[1], off[1])
    assert on[2] == off[2]
    np.testing.assert_array_equal(on[3], off[3])


@pytest.mark.parametrize("n", [5, 20, 32])
def test_skinny_norm_split_matches_the_rmsnorm_launches(model_files, n):
    """A skinny chunk's RMSNorms (but layer 0's first) split between the products around them
    (StepPlan::skinny_norm): o and down leave bf16(x * w) and their sums of squares, qkv and gate_up normalize
    their sums. Another rounding than the rmsnorm launches (skinny_norm=False), both close to the reference; the
    decode step after the prompt reads the prompt's cache rows either way."""
    m = model_files("tiny-3072")  # a width the plan splits the norm at (StepPlan::kSkinnyNormHidden)
    ids = prompt(n, m.spec.vocab_size, seed=90 + n)
    on, off = cuda(m, 256), cuda(m, 256, skinny_norm=False)
    assert on.step_plan["prefill_skinny_norm"] and not off.step_plan["prefill_skinny_norm"]
    assert not off.step_plan["options"]["skinny_norm"]
    ref = cpu(m, 256)
    want = ref.prefill(ids)
    got_on, got_off = on.prefill(ids), off.prefill(ids)
    assert_close(got_on, want, "split RMSNorm")
    assert_close(got_off, want, "rmsnorm launches")
    assert_close(got_on, got_off, "split RMSNorm against the launches")
    token = int(np.argmax(want))
    assert_close(on.decode(token), ref.decode(token), "the step after a split-norm prompt")


@pytest.mark.parametrize("hidden,ffn,heads,on", [(2048, 8192, 32, False), (3072, 8192, 24, True), (4096, 14336, 32, False)])
def test_skinny_norm_split_where_it_was_measured_to_pay(tiny, hidden, ffn, heads, on):
    """The plan splits a skinny chunk's RMSNorms at the hidden sizes where that was measured to pay
    (StepPlan::kSkinnyNormHidden: the 3B's, not the 1B's nor the 8B's), and only with the skinny GEMM."""
    from atomflow import _core

    spec = dict(tiny.spec.to_dict(), hidden_size=hidden, intermediate_size=ffn, num_heads=heads, num_kv_heads=8)
    spec["head_dim"] = 128
    plan = _core.plan_for(spec, 1024)
    assert plan["prefill_skinny_max_rows"] == 32
    assert plan["prefill_skinny_norm"] == on
    assert not _core.plan_for(spec, 1024, skinny_gemm=False)["prefill_skinny_norm"]


@pytest.mark.parametrize("n", [2, 7, 16])
def test_small_m_prefill_equals_decode_steps(tiny, n):
    """A chunk of 2..16 rows runs its products through the small-M GEMV, whose row m is the decode
    GEMV's bits on x[m]; with bf16 activations on both paths (the decode step's default fp16 ones are
    another rounding), the chunk's last logits equal those of the same tokens fed one decode step at a
    time (the verify step of speculative decoding rests on this)."""
    ids = prompt(n, tiny.spec.vocab_size, seed=40 + n)
    eng = cuda(tiny, 256, eager=True, f16_activations=False)
    assert 2 <= n <= eng.step_plan["prefill_small_m_max_rows"]
    chunk = eng.engine.prefill_rows(ids)[-1]  # a prompt chunk of skinny_min_rows+ rows takes the skinny GEMM
    eng.reset()
    eng.prefill(ids[:1])
    for t in ids[1:]:
        steps = eng.decode(int(t))
    np.testing.assert_array_equal(chunk, steps)


def test_prefill_in_two_calls_matches_reference(tiny):
    compare_run(tiny, prompt(300, tiny.spec.vocab_size, seed=3), steps=4, max_context=512, split=123)


def test_small_prefill_chunk_matches_reference(tiny):
    from atomflow import _core

    ref = cpu(tiny, 256)
    eng = _core.Engine(
        str(tiny.path), tiny.spec.to_dict(), tiny.tensor_table(), tiny.spec.rope_inv_freq(), 256, prefill_chunk=7, verbose=False
    )
    ids = prompt(100, tiny.spec.vocab_size, seed=5)
    assert_close(eng.prefill(ids), ref.prefill(ids), "prefill in 7-row chunks")


def test_prefill_chunk_default_and_bound(tiny):
    """The core's default chunk is the step plan's: the rule of StepPlan::prefill_chunk_for on this GPU's SMs
    where the sm90 GEMM takes the layers (tests/test_prefill_chunk.py checks the rule), 2048 rows elsewhere; the
    plan says it, and it never passes max_context."""
    from atomflow import _core

    keys = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")

    def expected(spec, plan):
        if plan["prefill_sm90_gemm_min_rows"] is None:
            return 2048
        return _core.prefill_chunk_for(*(spec[k] for k in keys), plan["device"]["sm_count"])

    eng = cuda(tiny, 4096 + 64)
    want = expected(tiny.spec.to_dict(), eng.step_plan)
    assert eng.prefill_chunk == want and eng.step_plan["prefill_chunk"] == want
    del eng
    gc.collect()
    for sizes in [(3072, 8192, 24, 8, 128), (4096, 14336, 32, 8, 128)]:  # the 3B's and the 8B's
        spec = dict(tiny.spec.to_dict(), **dict(zip(keys, sizes)))
        plan = _core.plan_for(spec, 8192)
        assert plan["prefill_chunk"] == expected(spec, plan)
        if plan["prefill_sm90_gemm_min_rows"] is not None and plan["device"]["sm_count"] == 132:  # H100 / H200
            assert plan["prefill_chunk"] == (4096 if sizes[0] == 3072 else 2048)
    assert _core.plan_for(tiny.spec.to_dict(), 300)["prefill_chunk"] == 300
    gc.collect()
    assert cuda(tiny, 300).prefill_chunk == 300
    assert cuda(tiny, 300, prefill_chunk=7).prefill_chunk == 7


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.2-3b"])
def test_logits_match_reference_presets(model_files, preset):
    model = model_files(preset)
    compare_run(model, prompt(64, model.spec.vocab_size), steps=64, max_context=256)


def test_long_context_matches_reference(tiny):
    """Positions past 8192, reached through chunked prefill in two calls."""
    ids = prompt(8200, tiny.spec.vocab_size, seed=1)
    compare_run(tiny, ids, steps=16, max_context=8448, split=5000)


# ----------------------------------------------------------------------------- determinism


def test_graph_and_eager_agree(tiny):
    assert_graph_and_eager_agree(tiny, 64)


def test_short_steps_graph_has_the_same_bits(tiny):
    """Steps of at most 512 keys replay a second graph whose attention grid is planned for 512 keys
    (step_plan.h, kShortKeys); eager steps plan theirs the same way. The split count per position does
    not depend on the grid, so the logits across the switch (keys 501 .. 530) have the same bits as with
    one grid planned for max_context (the plan's short_steps=False, in the same process)."""
    ids = prompt(500, tiny.spec.vocab_size, seed=5)

    def run(grids, **kw):
        eng = cuda(tiny, 2048, **kw)
        out = [eng.prefill(ids)]
        for _ in range(30):
            out.append(eng.decode(int(np.argmax(out[-1]))))
        # Which grid each step took: the load's warm-up step, then positions 500..529.
        assert (eng.engine.short_grid_steps, eng.engine.long_grid_steps) == grids
        return np.stack(out)

    two, eager = run((13, 18)), run((13, 18), eager=True)  # 0 and 500..511 short, 512..529 long
    one, one_eager = run((0, 31), short_steps=False), run((0, 31), eager=True, short_steps=False)
    np.testing.assert_array_equal(two, one, err_msg="graph: short-steps grid != max_context grid")
    np.testing.assert_array_equal(eager, one_eager, err_msg="eager: short-steps grid != max_context grid")
    _, rel = cos_rel(eager[-1], two[-1])
    assert rel <= 1e-5


@pytest.mark.parametrize("lm_head", ["fp8", "bf16"])
def test_fused_tail_has_the_same_tokens(model_files, lm_head):
    """The sampler that ends the step (token ring, position, the next step's embedding; greedy from
    the FP8 head's per-block maxima) gives the tokens and logits of the separate embedding, sample
    and finish launches (the plan's fused_tail=False, in the same process), greedy and sampled, graph
    and eager."""
    model = model_files("tiny", lm_head)
    ids = prompt(40, model.spec.vocab_size, seed=13)
    sampled_params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=5, max_new_tokens=48)

    def run(**kw):
        eng = cuda(model, 256, **kw)
        out = [list(eng.generate_ids(ids, greedy(48))), list(eng.generate_ids(ids, sampled_params))]
        eng.rollback(60)  # decode() after a pipelined run: its token's embedding, not the sampler's
        return out, eng.decode(out[0][5])

    fused, fused_eager = run(), run(eager=True)
    split, split_eager = run(fused_tail=False), run(eager=True, fused_tail=False)
    assert fused[0][0] == split[0][0] == fused_eager[0][0] == split_eager[0][0], "greedy tokens"
    assert fused[0][1] == split[0][1] == fused_eager[0][1] == split_eager[0][1], "sampled tokens"
    np.testing.assert_array_equal(fused[1], split[1])
    np.testing.assert_array_equal(fused_eager[1], split_eager[1])
    assert len(set(fused[0][1])) > 1


# ----------------------------------------------------------------------------- fp16 activations


def test_f16_and_bf16_activations_match_reference(tiny, monkeypatch):
    """Decode steps write attention's and SwiGLU's outputs in fp16 by default, bf16 with
    ATOMFLOW_BF16_ACTS=1 (or the plan's f16_activations=False): both within the reference's bound at
    every step."""
    ids = prompt(64, tiny.spec.vocab_size, seed=21)
    assert cuda(tiny, 256).engine.f16_activations
    compare_run(tiny, ids, 64, 256)
    assert not cuda(tiny, 256, f16_activations=False).engine.f16_activations
    compare_run(tiny, ids, 64, 256, f16_activations=False)
    monkeypatch.setenv("ATOMFLOW_BF16_ACTS", "1")
    assert not cuda(tiny, 256).engine.f16_activations
    assert cuda(tiny, 256, f16_activations=True).engine.f16_activations  # an explicit option wins
    compare_run(tiny, ids, 64, 256)


@pytest.mark.parametrize("eager", [False, True])
def test_f16_overflow_reruns_the_step_in_bf16(loud, eager, monkeypatch):
    """A step whose fp16 activations overflow is never returned: the engine switches to bf16 for good
    and runs it (and the steps in flight after it) again, so tokens and logits are those of an engine
    in bf16 from the start, bit for bit, through generate (4 steps in flight), decode() and a probed
    step (one row per probe, not two)."""
    ids = prompt(30, loud.spec.vocab_size, seed=3)
    sampled_params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=9, max_new_tokens=40)

    def run():
        eng = cuda(loud, 256, eager=eager)
        out = [list(eng.generate_ids(ids, greedy(40))), list(eng.generate_ids(ids, sampled_params))]
        eng.rollback(45)
        logits = eng.decode(out[0][3])
        probes = eng.probed_decode(out[0][4])
        return eng, out, logits, probes

    monkeypatch.setenv("ATOMFLOW_BF16_ACTS", "1")
    ref_eng, ref, ref_logits, ref_probes = run()
    assert not ref_eng.engine.f16_activations
    monkeypatch.delenv("ATOMFLOW_BF16_ACTS")
    eng = cuda(loud, 256, eager=eager)
    assert eng.engine.f16_activations
    eng.prefill(ids[:-1])  # as generate_ids does
    eng.engine.begin(int(ids[-1]))
    eng.engine.enqueue(4)
    first = eng.engine.wait(1)  # the first step overflowed: it and the 3 after it ran again in bf16
    assert not eng.engine.f16_activations and eng.engine.graph_enabled == (not eager)
    assert eng.engine.in_flight == 3 and eng.engine.position == 33
    eng.engine.synchronize()
    del eng
    eng, got, logits, probes = run()
    assert not eng.engine.f16_activations
    assert got[0] == ref[0] and got[0][0] == first[0], "greedy tokens"
    assert got[1] == ref[1], "sampled tokens"
    np.testing.assert_array_equal(logits, ref_logits)
    assert probes.keys() == ref_probes.keys()
    for name in probes:
        np.testing.assert_array_equal(probes[name], ref_probes[name], err_msg=name)


def test_f16_overflow_needs_a_known_input(loud):
    """Steps enqueued after synchronize() without begin() have an input only the device knows: an
    overflow there cannot be rerun, and says so."""
    eng = cuda(loud, 256)
    eng.prefill(prompt(10, loud.spec.vocab_size))
    core = eng.engine
    core.begin(1)
    core.enqueue(2)
    core.synchronize()
    core.enqueue(1)
    with pytest.raises(RuntimeError, match="begin"):
        core.wait(1)
    assert not core.f16_activations and core.in_flight == 0 and core.position == 12


def test_eager_from_environment(tiny, monkeypatch):
    """ATOMFLOW_EAGER is the default of the eager argument; an explicit argument wins."""
    from atomflow import Engine

    monkeypatch.delenv("ATOMFLOW_EAGER", raising=False)
    assert not cuda(tiny, 64).eager
    monkeypatch.setenv("ATOMFLOW_EAGER", "1")
    assert cuda(tiny, 64).eager and not cuda(tiny, 64).engine.graph_enabled
    graph = cuda(tiny, 64, eager=False)
    assert not graph.eager and graph.engine.graph_enabled
    assert Engine.load(tiny.path, backend="cuda", max_context=64).backend.eager
    assert not Engine.load(tiny.path, backend="cuda", max_context=64, eager=False).backend.eager
    monkeypatch.setenv("ATOMFLOW_EAGER", "0")
    assert not cuda(tiny, 64).eager


def test_greedy_is_repeatable(tiny_engine, tiny):
    ids = prompt(40, tiny.spec.vocab_size, seed=4)
    first = list(tiny_engine.generate_ids(ids, greedy(80)))
    assert list(tiny_engine.generate_ids(ids, greedy(80))) == first
    assert len(set(first)) > 1, "the tiny model should not repeat one token forever"


def test_generate_matches_decode_loop(tiny_engine, tiny):
    """The pipelined path (device sampling, token ring) == argmax of prefill()'s then decode()'s logits."""
    ids = prompt(33, tiny.spec.vocab_size, seed=6)
    piped = list(tiny_engine.generate_ids(ids, greedy(40)))
    tiny_engine.reset()
    logits = tiny_engine.prefill(ids)  # as generate_ids does: the first token from the prompt's last row
    loop = []
    for _ in range(40):
        loop.append(int(np.argmax(logits)))
        logits = tiny_engine.decode(loop[-1])
    assert piped == loop


@pytest.mark.parametrize("n", [2, 3, 16, 17, 18, 33, 40])
def test_begin_prompt_samples_the_last_row(tiny, n):
    """begin_prompt prefills in chunks (never a last chunk of one row: 17 = 15 + 2 at chunks of 16, as
    prefill() does) and its first step is the sample of the last row: greedy, argmax of the row's
    logits (which equal the reference's and prefill()'s to the bit); sampled, sample_numpy with the RNG
    counter of a decode step at that row. The position is then the prompt's, and the next enqueued
    steps continue from the token."""
    eng = cuda(tiny, 128, prefill_chunk=16)
    core = eng.engine
    ids = prompt(n, tiny.spec.vocab_size, seed=20 + n)
    want = cpu(tiny, 128).prefill(ids)
    core.set_sampling(0.0, 0, 1.0, 0)
    core.begin_prompt(ids)
    assert core.in_flight == 1
    (token,) = core.wait(1)
    assert core.prompt_finite()  # checked on the device
    logits = core.prompt_logits()
    assert core.position == n and core.in_flight == 0
    assert_close(logits, want, f"begin_prompt's last row, {n} ids")
    assert token == int(np.argmax(logits))
    eng.reset()  # prefill() chunks alike (Engine::prompt_chunk_rows): the same bits
    np.testing.assert_array_equal(eng.prefill(ids), logits)
    # The steps after it: the same tokens as decode() fed with the first one.
    eng.reset()
    core.begin_prompt(ids)
    core.enqueue(3)
    piped = core.wait(4)
    with pytest.raises(RuntimeError, match="overwritten"):
        core.prompt_logits()  # the steps after it took the logits
    eng.reset()
    eng.prefill(ids)
    loop = [token]
    for _ in range(3):
        loop.append(int(np.argmax(eng.decode(loop[-1]))))
    assert piped == loop
    # Sampled: the decode step's RNG counter (the position after the row).
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=5, max_new_tokens=1)
    eng.reset()
    core.set_sampling(params.temperature, params.top_k, params.top_p, params.seed)
    core.begin_prompt(ids)
    (drawn,) = core.wait(1)
    assert drawn == sample_numpy(core.prompt_logits(), params, n)


def test_begin_prompt_errors(tiny_engine, tiny):
    core = tiny_engine.engine
    tiny_engine.reset()
    with pytest.raises(ValueError, match="at least 2 ids"):
        core.begin_prompt(np.array([5], np.int32))
    with pytest.raises(ValueError, match="does not fit"):
        core.begin_prompt(prompt(513, tiny.spec.vocab_size))
    core.begin_prompt(prompt(8, tiny.spec.vocab_size))
    with pytest.raises(RuntimeError, match="call wait"):
        core.begin_prompt(prompt(8, tiny.spec.vocab_size))
    core.synchronize()  # drops the prompt's token: the cache holds the prompt
    assert core.position == 8


# ----------------------------------------------------------------------------- memory


def test_no_allocations_after_load(tiny_engine, tiny):
    eng = tiny_engine
    before = eng.engine.device_allocations
    assert before >= 1
    ids = prompt(100, tiny.spec.vocab_size, seed=8)
    eng.reset()
    eng.prefill(ids)
    for t in range(20):
        eng.decode(t)
    assert len(list(eng.generate_ids(ids, SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=300)))) == 300
    assert eng.engine.device_allocations == before


def test_plan(tiny):
    s = tiny.spec
    eng = cuda(tiny, 1000).engine
    plan = eng.plan
    assert set(plan) == {"weights", "kv", "activations", "scratch", "total"}
    assert plan["total"] == plan["weights"] + plan["kv"] + plan["activations"] + plan["scratch"]
    slot = -(-1000 * s.kv_dim * 2 // 256) * 256
    assert plan["kv"] == 2 * s.num_layers * slot
    assert plan["weights"] >= sum(t["nbytes"] for t in tiny.tensor_table())
    assert plan["activations"] + plan["scratch"] < 64 << 20
    assert eng.load_seconds > 0 and eng.graph_enabled and eng.max_context == 1000


def test_device_and_build_info():
    from atomflow import _core

    ok, why = _core.cuda_available()
    assert ok and why == ""
    info = _core.device_info()
    assert info["capability"] >= (8, 9) and info["total_memory"] >= info["free_memory"] > 0
    assert info["sm_count"] > 0 and info["l2_bytes"] > 0 and info["name"]
    build = _core.build_info()
    assert build["cuda_arch"] and build["cuda_runtime_version"] > 0


# ----------------------------------------------------------------------------- position control


def test_rollback_reproduces_logits(tiny_engine, tiny):
    eng = tiny_engine
    eng.reset()
    eng.prefill(prompt(40, tiny.spec.vocab_size, seed=9))
    first = [eng.decode(t) for t in (5, 6, 7)]
    assert eng.position == 43
    eng.rollback(41)
    again = [eng.decode(t) for t in (6, 7)]
    for a, b in zip(first[1:], again):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        eng.rollback(44)


def test_closing_generate_keeps_prompt_and_yielded(tiny_engine, tiny):
    """Closed after 5 tokens, the cache holds the prompt and the first 4: decoding the 5th
    continues exactly where the CPU reference does."""
    eng = tiny_engine
    ids = prompt(30, tiny.spec.vocab_size, seed=10)
    gen = eng.generate_ids(ids, greedy(50))
    tokens = [next(gen) for _ in range(5)]
    gen.close()
    assert eng.position == 30 + 4
    ref = cpu(tiny, 128)
    ref.prefill(np.concatenate([ids, np.array(tokens[:4], np.int32)]))
    assert_close(eng.decode(tokens[4]), ref.decode(tokens[4]), "decode after close")


def test_context_full(tiny):
    eng = cuda(tiny, 48)
    eng.prefill(prompt(47, tiny.spec.vocab_size))
    eng.decode(1)
    with pytest.raises(RuntimeError, match="context full: max_context 48 reached"):
        eng.decode(1)
    eng.rollback(46)
    core = eng.engine
    core.begin(3)
    core.enqueue(2)
    with pytest.raises(RuntimeError, match="context full"):
        core.enqueue(1)
    assert len(core.wait(2)) == 2 and core.position == 48
    # generate_ids stops when the context is full: steps at positions 40..47.
    assert len(list(eng.generate_ids(prompt(41, tiny.spec.vocab_size), greedy(100)))) == 8


# ----------------------------------------------------------------------------- the token ring


def test_ring_limits(tiny_engine, tiny):
    core = tiny_engine.engine
    tiny_engine.reset()
    tiny_engine.prefill(prompt(10, tiny.spec.vocab_size))
    core.begin(1)
    core.enqueue(core.ring_size)
    with pytest.raises(ValueError, match="ring"):
        core.enqueue(1)
    with pytest.raises(RuntimeError, match="call wait"):
        core.decode(1)
    with pytest.raises(ValueError):
        core.wait(core.ring_size + 1)
    tokens = core.wait(core.ring_size)
    assert len(tokens) == core.ring_size and all(0 <= t < tiny.spec.vocab_size for t in tokens)
    assert core.in_flight == 0 and core.position == 10 + core.ring_size
    core.enqueue(3)
    core.synchronize()  # drops the three unread tokens
    assert core.in_flight == 0 and core.position == 10 + core.ring_size + 3


# ----------------------------------------------------------------------------- sampling


def sampled(eng, ids, params) -> list[int]:
    return list(eng.generate_ids(ids, params))


def test_seeded_sampling_repeats_and_varies(tiny_engine, tiny):
    ids = prompt(16, tiny.spec.vocab_size, seed=11)
    p = dict(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=48)
    a = sampled(tiny_engine, ids, SamplingParams(seed=1234, **p))
    assert sampled(tiny_engine, ids, SamplingParams(seed=1234, **p)) == a
    b = sampled(tiny_engine, ids, SamplingParams(seed=4321, **p))
    assert a != b


def test_device_sampler_follows_sample_numpy(tiny_engine, tiny):
    """Each step's device-sampled token equals sample_numpy on that step's logits with the CPU
    backend's RNG counter (the position after the fed token). Rerunning a step after a rollback
    gives its logits."""
    eng, core = tiny_engine, tiny_engine.engine
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=77, max_new_tokens=1)
    eng.reset()
    ids = prompt(24, tiny.spec.vocab_size, seed=12)
    eng.prefill(ids[:-1])
    core.set_sampling(params.temperature, params.top_k, params.top_p, params.seed)
    token, mismatches = int(ids[-1]), 0
    for _ in range(48):
        pos = core.position
        core.begin(token)
        core.enqueue(1)
        (drawn,) = core.wait(1)
        eng.rollback(pos)
        logits = eng.decode(token)
        mismatches += drawn != sample_numpy(logits, params, core.position)
        token = drawn
    assert mismatches <= 1, f"{mismatches} of 48 draws differ from sample_numpy"


def test_bad_sampling_settings(tiny_engine):
    core = tiny_engine.engine
    for args in [(-1.0, 0, 1.0, 0), (1.0, -1, 1.0, 0), (1.0, 0, 0.0, 0), (1.0, 0, 1.5, 0), (1.0, 0, 1.0, -1)]:
        with pytest.raises(ValueError):
            core.set_sampling(*args)


# ----------------------------------------------------------------------------- errors


def test_prompt_longer_than_context(tiny):
    eng = cuda(tiny, 64)
    with pytest.raises(ValueError, match="prompt of 65 tokens at position 0 does not fit max_context 64"):
        eng.prefill(prompt(65, tiny.spec.vocab_size))
    with pytest.raises(ValueError, match="does not fit max_context 64"):
        eng.generate_ids(prompt(65, tiny.spec.vocab_size), greedy(4))
    eng.prefill(prompt(60, tiny.spec.vocab_size))
    with pytest.raises(ValueError, match="prompt of 5 tokens at position 60 does not fit max_context 64"):
        eng.prefill(prompt(5, tiny.spec.vocab_size))
    assert eng.position == 60


def test_token_out_of_range(tiny_engine, tiny):
    eng, vocab = tiny_engine, tiny.spec.vocab_size
    eng.reset()
    for bad in ([0, vocab], [-1], [2**40]):
        with pytest.raises(ValueError, match="out of range"):
            eng.prefill(np.array(bad, dtype=np.int64))
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match="out of range"):
            eng.decode(bad)
        with pytest.raises(ValueError, match="out of range"):
            eng.engine.begin(bad)
    with pytest.raises(ValueError):
        eng.prefill(np.array([], dtype=np.int32))
    with pytest.raises(ValueError):
        eng.prefill(np.array([1.5, 2.0]))
    assert eng.position == 0


def test_bad_tensor_table(tiny):
    from atomflow import _core

    table = [t for t in tiny.tensor_table() if t["name"] != "layers.1.w2"]
    with pytest.raises(ValueError, match="layers.1.w2"):
        _core.Engine(str(tiny.path), tiny.spec.to_dict(), table, tiny.spec.rope_inv_freq(), 64, verbose=False)
    table = tiny.tensor_table()
    table[-1] = dict(table[-1], offset=tiny.file_size)  # past the end of the file
    with pytest.raises(ValueError, match="past the end"):
        _core.Engine(str(tiny.path), tiny.spec.to_dict(), table, tiny.spec.rope_inv_freq(), 64, verbose=False)


def test_too_large_context_names_what_fits(tiny):
    from atomflow import _core

    with pytest.raises(RuntimeError, match="largest max_context that fits is"):
        _core.Engine(
            str(tiny.path), tiny.spec.to_dict(), tiny.tensor_table(), tiny.spec.rope_inv_freq(), 2 * 10**8, verbose=False
        )


# ----------------------------------------------------------------------------- load speed


@pytest.mark.slow
def test_load_time_3b_is_reported(model_files):
    """The load time is measured and reported (tools/gpu_bench.py tracks it; a timed assertion here
    would fail on a busy machine, not on slow code)."""
    model = model_files("llama-3.2-3b")
    cuda(model, 256)  # warms the page cache
    gc.collect()
    eng = cuda(model, 256)
    assert 0.0 < eng.engine.load_seconds < 60.0, eng.engine.load_seconds
    print(f"3B load: {eng.engine.load_seconds:.2f} s")


# ----------------------------------------------------------------------------- the step plan

PLAN_PRODUCT_FIELDS = {"product", "when", "kernel", "N", "K", "blocks", "warps", "pre_warps", "staged_warps", "tickets", "smem"}
PLAN_ATTENTION_FIELDS = {"product", "when", "kernel", "keys", "splits", "cluster", "merge", "halved", "blocks", "warps"}


def test_info_plan_lists_every_product(tiny):
    """`atomflow info MODEL --plan --json` is the plan an engine of that model makes on this GPU: every
    GEMV product of the decode step (and of the probed step) with its kernel, grid and per-warp
    choices, attention's grids, the options; the table form names the same products."""
    import json
    import subprocess
    import sys

    def info(*extra):
        r = subprocess.run(
            [sys.executable, "-m", "atomflow.cli", "info", str(tiny.path), "--plan", "--max-context", "2048", *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    plan = json.loads(info("--json"))
    s = tiny.spec
    want = {
        ("qkv", "decode"): (s.qkv_dim, s.hidden_size),
        ("o", "decode, f16 activations"): (s.hidden_size, s.q_dim),
        ("o", "decode, bf16 activations"): (s.hidden_size, s.q_dim),
        ("gate_up", "decode"): (2 * s.intermediate_size, s.hidden_size),
        ("down", "decode, f16 activations"): (s.hidden_size, s.intermediate_size),
        ("down", "decode, bf16 activations"): (s.hidden_size, s.intermediate_size),
        ("lm_head", "decode"): (s.vocab_size, s.hidden_size),
        ("qkv", "probed decode"): (s.qkv_dim, s.hidden_size),
        ("gate_up", "probed decode"): (2 * s.intermediate_size, s.hidden_size),
        ("lm_head", "probed decode"): (s.vocab_size, s.hidden_size),
    }
    got = {(r["product"], r["when"]): r for r in plan["products"]}
    assert set(got) == set(want)
    for key, (N, K) in want.items():
        r = got[key]
        assert set(r) == PLAN_PRODUCT_FIELDS, key
        assert (r["N"], r["K"]) == (N, K) and r["kernel"].startswith("gemv_w8a16<"), key
        assert 1 <= r["blocks"] <= 2 * plan["device"]["sm_count"] and r["warps"] == 8, key
        assert 0 <= r["pre_warps"] <= 8 and 0 <= r["staged_warps"] <= 8 and r["smem"] > 0, key
    assert [a["when"] for a in plan["attention"]] == ["decode", "decode, short steps"]
    for a in plan["attention"]:
        assert set(a) == PLAN_ATTENTION_FIELDS
        assert a["merge"] in ("cluster", "scratch", "none") and (a["cluster"] > 1) == (a["merge"] == "cluster")
    assert [a["keys"] for a in plan["attention"]] == [2048, 512]
    assert plan["max_context"] == 2048 and plan["activations"] == "f16" and len(plan["graphs"]) == 2
    assert plan["options"] == dict(
        eager=False,
        f16_activations=True,
        fused_tail=True,
        short_steps=True,
        cluster_merge=True,
        staged_pair=True,
        tickets=True,
        prefill_fp8=False,
        gemm_pdl=True,
        skinny_gemm=True,
        skinny_rope=True,
        skinny_norm=True,
        pdl=plan["options"]["pdl"],
    )
    # The engine's own plan is the same.
    eng = cuda(tiny, 2048)
    assert json.loads(json.dumps(eng.step_plan)) == plan
    table = info()
    for product, when in want:
        assert product in table and when in table
    # The prompt chunks' products by rows (StepPlan: small_m_max_rows, skinny_max_rows, sm90_gemm_min_rows).
    assert plan["prefill_small_m_max_rows"] == 16 and plan["prefill_skinny_max_rows"] == 32
    assert plan["prefill_skinny_min_rows"] == 5 and plan["prefill_skinny_rope"] and not plan["prefill_skinny_norm"]
    if plan["prefill_sm90_gemm_min_rows"] is not None:  # a build with nvidia-cutlass
        assert "gemm_w8a16_skinny for 5..32 rows (QKV with RoPE + KV append fused), gemm_w8a16_sm90" in table


def test_plan_overrides_in_one_process(tiny):
    """Engines built with plan overrides in one process: every override but f16_activations changes the
    schedule only, so the tokens and logits are those of the default engine bit for bit; the plan says
    what each engine was built with."""
    ids = prompt(40, tiny.spec.vocab_size, seed=17)

    def run(**kw):
        eng = cuda(tiny, 1024, **kw)
        tokens = list(eng.generate_ids(ids, greedy(24)))
        eng.rollback(50)
        return eng.step_plan, tokens, eng.decode(tokens[5])

    plan, tokens, logits = run()
    for kw in (
        dict(fused_tail=False),
        dict(short_steps=False),
        dict(cluster_merge=False),
        dict(staged_pair=False),
        dict(tickets=False),
        dict(gemm_pdl=False),
        dict(fused_tail=False, short_steps=False, cluster_merge=False, staged_pair=False, tickets=False, eager=True),
    ):
        p, t, lg = run(**kw)
        assert all(p["options"][k] == v for k, v in kw.items()), kw
        assert t == tokens, kw
        np.testing.assert_array_equal(lg, logits, err_msg=str(kw))
    p, _, _ = run(short_steps=False)
    assert len(p["graphs"]) == 1 and len(p["attention"]) == 1
    p, _, _ = run(cluster_merge=False)
    assert all(a["cluster"] == 1 for a in p["attention"])
    p, _, _ = run(staged_pair=False, tickets=False)
    assert all(r["staged_warps"] == 0 and not r["tickets"] for r in p["products"])
    p, t, _ = run(f16_activations=False)
    assert p["activations"] == "bf16" and len(t) == len(tokens)
    with pytest.raises(ValueError, match="unknown engine option"):
        cuda(tiny, 64, one_graph=True)
