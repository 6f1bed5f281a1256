"""The GPU tools' command lines, on any machine: their arguments are checked before they touch the GPU,
so a typo fails in a second with a one-line error instead of after a model load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / tool), *args], capture_output=True, text=True, timeout=60)


def test_bench_kernels_refuses_an_unknown_section():
    r = run("bench_kernels.py", "--sections", "gemm_sm90,bogus")
    assert r.returncode == 2
    assert "unknown section(s) bogus" in r.stderr and "gemm_sm90" in r.stderr


@pytest.mark.parametrize("tool", ["prefill_profile.py", "verify_cost.py", "prefill_recipe_quality.py", "step_gaps.py"])
def test_gpu_tools_need_a_model(tool):
    r = run(tool)
    assert r.returncode == 2 and "model" in r.stderr
    assert run(tool, "--help").returncode == 0


def test_prefill_profile_refuses_an_unknown_recipe():
    r = run("prefill_profile.py", "model.atomflow", "--recipe", "w8a16,w4a4")
    assert r.returncode == 2 and "--recipe" in r.stderr


def test_prefill_recipe_quality_checks_its_window():
    r = run("prefill_recipe_quality.py", "model.atomflow", "--text", "t.txt", "--ctx", "2048")
    assert r.returncode == 2 and "--ctx" in r.stderr


def test_recipe_tools_run_on_the_cpu_reference(tiny_model_file, tmp_path):
    """tools/recipe_attribution.py and tools/recipe_smoothing.py (no GPU): every variant scored, the table
    printed."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 120)
    common = ["--text", str(text), "--ctx", "256", "--max-windows", "1"]
    r = run("recipe_attribution.py", str(tiny_model_file), *common)
    assert r.returncode == 0, r.stderr
    assert "| w8a16 | " in r.stdout and "| w8a8, down in 16 bits | " in r.stdout
    r = run("recipe_attribution.py", str(tiny_model_file), *common, "--groups", "128,32")
    assert r.returncode == 0, r.stderr
    assert "| w8a8, groups of 128 columns | " in r.stdout and "| w8a8, groups of 32 columns | " in r.stdout
    assert "in 16 bits" not in r.stdout
    for bad in ("0", "x"):
        r = run("recipe_attribution.py", str(tiny_model_file), *common, "--groups", bad)
        assert r.returncode == 2 and "--groups" in r.stderr
    r = run("recipe_smoothing.py", str(tiny_model_file), "--calib", str(text), *common)
    assert r.returncode == 0, r.stderr
    assert "| smoothed (alpha 0.5), w8a16 | " in r.stdout and "| smoothed (alpha 0.5), w8a8 | " in r.stdout


def test_step_gaps_cuts_steps_at_the_sampler():
    """The trace's kernels cut into steps at each sampler (what ran before the first one is the prompt's):
    span = first kernel's start to the sampler's end, gap = the previous sampler's end to the first start."""
    sys.path.insert(0, str(TOOLS))
    from step_gaps import steps_of

    k = [(0.0, 5.0, "prefill_gemm"), (6.0, 7.0, "sample_kernel")]  # the prompt and its first token
    for s0 in (10.0, 30.0):  # two steps of three kernels, 4 us apart
        k += [(s0, s0 + 3.0, "gemv"), (s0 + 3.5, s0 + 6.0, "attention"), (s0 + 6.5, s0 + 7.0, "sample_kernel")]
    steps = steps_of(k)
    assert [s["kernels"] for s in steps] == [3, 3]
    assert [s["span_us"] for s in steps] == [7.0, 7.0]
    assert [s["gap_us"] for s in steps] == [3.0, 13.0]
    assert steps_of([(0.0, 1.0, "gemv")]) == []


def test_step_gaps_slots_are_medians_per_kernel_position():
    sys.path.insert(0, str(TOOLS))
    from step_gaps import slots_of, steps_of

    k = [(0.0, 1.0, "sample_kernel")]
    for s0, d in ((10.0, 3.0), (30.0, 5.0), (50.0, 3.0)):  # the gemv of the second step runs longer
        k += [(s0, s0 + d, "gemv"), (s0 + d + 0.5, s0 + d + 1.0, "sample_kernel")]
    slots = slots_of(k, steps_of(k))
    assert [s["name"] for s in slots] == ["gemv", "sample_kernel"]
    assert [s["dur_us"] for s in slots] == [3.0, 0.5]
    assert [s["start_us"] for s in slots] == [0.0, 3.5]


def test_speculate_sim_replays_the_real_loop():
    """The replay yields the recorded tokens through the real speculative loop (it asserts so); a
    sequence that repeats itself is drafted and accepted, and predicted faster than plain decoding;
    random tokens draft nothing and cost nothing."""
    sys.path.insert(0, str(TOOLS))
    from speculate_sim import replay

    from atomflow.speculate import SpecConfig

    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    item = dict(prompt=prompt, output=[5, 6, 7, 8, 9, 10, 11, 12] * 8)
    r = replay(item, SpecConfig(), step_ms=1.0, verify_ms=(1.2, 0.05))
    assert r["stats"].accepted > 40 and r["stats"].tokens_per_step > 3 and r["speedup"] > 2.5
    rng = np.random.default_rng(0)
    noise = dict(prompt=rng.permutation(1000)[:40].tolist(), output=rng.permutation(1000)[:40].tolist())
    r = replay(noise, SpecConfig(), step_ms=1.0, verify_ms=(1.2, 0.05))
    assert r["stats"].verify_steps == 0 and r["speedup"] == pytest.approx(1.0)


def test_speculate_sim_models_runs_and_a_verify_table():
    """--call-ms: each run of plain steps pays its wait once, so random tokens (no draft) cost 39 steps and one
    wait a run of plain_run; --verify-table: a verify of k drafts costs the k-th time (the last past its end)."""
    sys.path.insert(0, str(TOOLS))
    from speculate_sim import replay

    from atomflow.speculate import SpecConfig

    rng = np.random.default_rng(1)
    noise = dict(prompt=rng.permutation(1000)[:40].tolist(), output=rng.permutation(1000)[:40].tolist())
    for run_len in (1, 3):
        r = replay(noise, SpecConfig(plain_run=run_len), step_ms=1.0, verify_ms=(1.2, 0.05), call_ms=0.5)
        assert r["speedup"] == pytest.approx(39 / (39 + 0.5 * -(-39 // run_len)))
    item = dict(prompt=[5, 6, 7, 8, 9, 10, 11, 12] * 4, output=[5, 6, 7, 8, 9, 10, 11, 12] * 8)
    cheap = replay(item, SpecConfig(), step_ms=1.0, verify_ms=[1.1] * 15)
    dear = replay(item, SpecConfig(), step_ms=1.0, verify_ms=[1.1] * 7 + [3.0])
    assert cheap["stats"].accepted == dear["stats"].accepted and cheap["speedup"] > dear["speedup"] > 1


def test_speculate_bench_refuses_bad_configs():
    r = run("speculate_bench.py", "m.atomflow", "--config", "bogus=1")
    assert r.returncode == 2 and "--config" in r.stderr and "bogus" in r.stderr
    r = run("speculate_bench.py", "m.atomflow", "--config", "plain_run=0")
    assert r.returncode == 2 and "plain_run" in r.stderr
    r = run("speculate_bench.py", "m.atomflow", "--speculate", "off")
    assert r.returncode == 2 and "speculation is off" in r.stderr


def test_speculate_sim_refuses_bad_costs(tmp_path):
    r = run("speculate_sim.py", "m.atomflow", "--verify-ms", "1")
    assert r.returncode == 2 and "--verify-ms" in r.stderr
    r = run("speculate_sim.py", "m.atomflow", "--config", "n_min=5,n_max=3")
    assert r.returncode == 2 and "--config" in r.stderr


def test_speculate_sim_fits_costs_to_a_bench_run(tmp_path):
    sys.path.insert(0, str(TOOLS))
    from speculate_sim import costs_from_bench

    runs = [dict(plain_tps=1000.0, drafted=d * v, verify_steps=v, verify_ms=0.7 + 0.05 * d) for d, v in ((1, 4), (3, 5), (6, 2))]
    runs.append(dict(plain_tps=1000.0, drafted=0, verify_steps=0, verify_ms=float("nan")))
    (tmp_path / "b.json").write_text(json.dumps(dict(runs=runs)))
    step, (a, b) = costs_from_bench(str(tmp_path / "b.json"))
    assert step == pytest.approx(1.0) and a == pytest.approx(0.7) and b == pytest.approx(0.05)
    (tmp_path / "none.json").write_text(json.dumps(dict(runs=runs[-1:])))
    with pytest.raises(ValueError, match="no run made a verify step"):
        costs_from_bench(str(tmp_path / "none.json"))


def test_split_norm_quality_roundings():
    """tools/split_norm_quality.py's emulated roundings: f16 / bf16 of the norm's output, and the split norm's
    bf16(x * w) scaled by 1 / rms; fp32 and the skipped norms untouched."""
    import ml_dtypes

    sys.path.insert(0, str(TOOLS))
    import split_norm_quality as q

    from atomflow.model.reference import rmsnorm

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 64)) * 7).astype(np.float32)
    w = rng.uniform(0.5, 2.0, 64).astype(np.float32)
    plain = rmsnorm(x, w, 1e-5)
    never = lambda x, w: False  # noqa: E731
    np.testing.assert_array_equal(q.rounding("fp32", rmsnorm, never)(x, w, 1e-5), plain)
    np.testing.assert_array_equal(q.rounding("f16", rmsnorm, never)(x, w, 1e-5), plain.astype(np.float16).astype(np.float32))
    bf = q.rounding("bf16", rmsnorm, never)(x, w, 1e-5)
    np.testing.assert_array_equal(bf, plain.astype(ml_dtypes.bfloat16).astype(np.float32))
    r = 1 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + 1e-5)
    split = q.rounding("split", rmsnorm, never)(x, w, 1e-5)
    np.testing.assert_allclose(split, (x * w).astype(ml_dtypes.bfloat16).astype(np.float32) * r, rtol=1e-6)
    assert not np.array_equal(split, plain)  # a rounding, not the fp32 norm
    np.testing.assert_allclose(split, plain, rtol=2**-8)
    np.testing.assert_array_equal(q.rounding("split", rmsnorm, lambda x, w: True)(x, w, 1e-5), plain)
