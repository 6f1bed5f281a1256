"""The bench's timing loops and orchestration, run on the CPU backend (same Engine contract as the
CUDA one): every test gives the samples it promises, and run_bench assembles one result with
the baselines that cannot run here marked skipped."""

from __future__ import annotations

import json
import sys

import pytest

from atomflow.bench import driver
from atomflow.bench.engine import run_engine_tests
from atomflow.bench.plan import make_options
from atomflow.bench.report import render
from atomflow.engine import Engine
from atomflow.model.fileformat import AtomflowFile


def test_engine_tests_on_cpu(tiny_model_file):
    opts = make_options(str(tiny_model_file), n_prompt="8", n_gen="4", context="6", repetitions="2")
    eng = Engine.load(tiny_model_file, backend="cpu", max_context=opts.max_context)
    rows = {r["test"]: r for r in run_engine_tests(eng, opts, 100.0, lambda m: None)}
    assert set(rows) == {"pp8", "tg4", "pp8@d6", "tg4@d6"}
    assert all(r["status"] == "ok" and r["tokens_per_s_avg"] > 0 for r in rows.values())
    for name in ("pp8", "pp8@d6"):  # the second after 6 cached tokens, reused as the prompt's prefix
        assert len(rows[name]["samples"]["ttft_ms"]) == 2 and rows[name]["tpot_ms_p50"] is None
    assert rows["pp8@d6"]["depth"] == 6
    assert [len(g) for g in rows["tg4@d6"]["samples"]["tpot_ms"]] == [3, 3]
    assert rows["tg4@d6"]["bytes_per_token"] - rows["tg4"]["bytes_per_token"] == pytest.approx(6 * eng.spec.kv_bytes_per_token())
    assert eng.position == 0


def test_run_bench_orchestration(tiny_model_file, monkeypatch):
    """run_bench with the GPU parts swapped for the CPU backend: the result has every section, the
    HF directory comes from the file's recorded source, unavailable baselines are skipped rows."""
    import atomflow.bench.bandwidth as bench

    monkeypatch.setattr(driver, "preflight", lambda opts: AtomflowFile(opts.model))
    monkeypatch.setattr(bench, "read_bandwidth_gbs", lambda: 1000.0)
    real_load = Engine.load

    def cpu_load(cls, path, backend="auto", max_context=None, **kw):
        return real_load(path, backend="cpu", max_context=max_context)

    monkeypatch.setattr(Engine, "load", classmethod(cpu_load))
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    monkeypatch.setitem(sys.modules, "torch", None)  # the same for torch, on any machine
    opts = make_options(str(tiny_model_file), n_prompt="8", n_gen="3", repetitions="1", baselines=["vllm", "torch-compile"])
    result = driver.run_bench(opts, log=lambda m: None)
    assert result["hf_dir"] and result["baselines"] == ["torch-compile", "vllm"]  # vllm last
    assert result["read_bandwidth_gbs"] == 1000.0 and result["options"]["max_context"] == 9
    by = {(r["engine"], r["test"]): r for r in result["rows"]}
    assert by[("atomflow", "tg3")]["status"] == "ok"
    assert by[("vllm", "tg3")]["status"] == "skipped" and "vllm is not importable" in by[("vllm", "tg3")]["reason"]
    assert by[("torch-compile", "pp8")]["status"] == "skipped"
    assert "torch is not installed" in by[("torch-compile", "pp8")]["reason"]
    assert result["speedups"] == []
    assert json.loads(render(result, "json"))["rows"] == result["rows"]
    assert "skipped: vllm is not importable" in render(result, "md")


def test_engine_side_never_imports_torch():
    """torch lives in the baselines' runners only: the bench, the profiler and the CLI load without it."""
    import subprocess

    code = (
        "import sys; import atomflow.cli, atomflow.bench.driver, atomflow.bench.profile, atomflow.bench.engine, "
        "atomflow.bench.baselines, atomflow.bench.baselines.torch_runner, atomflow.bench.baselines.vllm_runner; "
        "from atomflow.engine import Engine; "
        "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'matplotlib') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


def test_gpu_check_decode_row_uses_the_bench_loop(tiny_model_file):
    """scripts/gpu_check.sh times decode through tools/gpu_bench.py's decode_row, which is the
    bench's own tg loop: on any backend it gives the gpu_check summary's fields."""
    from conftest import load_tool

    gpu_bench = load_tool("gpu_bench")
    eng = Engine.load(tiny_model_file, backend="cpu", max_context=16)
    r = gpu_bench.decode_row(eng, prompt=5, gen=4, bandwidth_gbs=100.0)
    assert r["test"] == "tg4@d5" and len(r["samples"]["tpot_ms"][0]) == 3
    assert r["tokens_per_s"] == pytest.approx(1e3 / r["tpot_ms_p50"])
    assert r["bytes_per_token"] == pytest.approx(
        eng.model.weight_bytes + eng.spec.hidden_size * 2 + eng.spec.kv_bytes_per_token() * (5 + 4 / 2 + 1)
    )
    assert r["efficiency"] == pytest.approx(r["achieved_gbs"] / 100.0)
    assert eng.position == 0


def test_gpu_bench_compares_each_shape_with_the_8b(monkeypatch, capsys):
    """Each row of another preset gets its efficiency minus llama-3.1-8b's in the same mode (the
    JSON field and the table's `vs 8B` points); none without the 8B in the run; an unknown preset
    is refused before any GPU work."""
    from conftest import load_tool

    gpu_bench = load_tool("gpu_bench")
    row = dict(tpot_ms_p50=2.5, tpot_ms_p99=2.6, tokens_per_s=400.0, bytes_per_token=8e9, achieved_gbs=3000.0, core_load_s=0.4)
    models = {
        "llama-3.1-8b/graph": dict(row, efficiency=0.66),
        "llama-3.1-8b/eager": dict(row, efficiency=0.60),
        "qwen3-8b/graph": dict(row, efficiency=0.64),
        "qwen3-8b/eager": dict(row, efficiency=0.61),
    }
    gpu_bench.add_efficiency_vs_reference(models)
    assert gpu_bench.VS_REFERENCE not in models["llama-3.1-8b/graph"]
    assert models["qwen3-8b/graph"][gpu_bench.VS_REFERENCE] == pytest.approx(-0.02)
    assert models["qwen3-8b/eager"][gpu_bench.VS_REFERENCE] == pytest.approx(0.01)
    lines = gpu_bench.table(models).splitlines()
    assert "vs 8B" in lines[0] and " -2.0 " in lines[3] and " +1.0 " in lines[4] and "+" not in lines[1]
    alone = {"qwen3-8b/graph": dict(row, efficiency=0.64)}
    gpu_bench.add_efficiency_vs_reference(alone)
    assert gpu_bench.VS_REFERENCE not in alone["qwen3-8b/graph"]

    monkeypatch.setattr(sys, "argv", ["gpu_bench.py", "--out", "x.json", "--presets", "llama-3.1-8b,qwen9-1t"])
    with pytest.raises(SystemExit):
        gpu_bench.main()
    assert "unknown qwen9-1t" in capsys.readouterr().err


def test_gpu_bench_make_only_drop_hf_keeps_only_the_file(tmp_path, monkeypatch):
    """--make-only --drop-hf: the file is made, the random HF directory goes once quantized (four
    7-8B presets' directories would not fit the GPU machine's disk next to their files), nothing
    is timed; a later run reuses the file."""
    from conftest import load_tool

    gpu_bench = load_tool("gpu_bench")
    argv = ["gpu_bench.py", "--out", str(tmp_path / "x.json"), "--presets", "tiny", "--workdir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv + ["--make-only", "--drop-hf"])
    assert gpu_bench.main() == 0
    f = tmp_path / "tiny.atomflow"
    assert f.is_file() and not (tmp_path / "tiny").exists() and not (tmp_path / "x.json").exists()
    mtime = f.stat().st_mtime_ns
    assert gpu_bench.model_file("tiny", tmp_path, drop_hf=True).stat().st_mtime_ns == mtime
