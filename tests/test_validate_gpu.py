"""The validator on the CUDA backend: the committed tiny ground truth, and ground truth made
here from HF for the Llama-3.2-1B and 3B shapes, at prompt and decode positions."""

from pathlib import Path

import pytest

from atomflow import Engine
from atomflow.validate import format_table, validate, verdict_line

pytestmark = pytest.mark.gpu
GT = Path(__file__).resolve().parents[1] / "ground_truth" / "tiny"


def check(rows):
    dequant = [r for r in rows if r.reference == "dequant"]
    bad = format_table([r for r in rows if r.verdict != "PASS"])
    assert dequant and all(r.verdict == "PASS" for r in dequant), f"{verdict_line(rows)}\n{bad}"
    assert {r.phase for r in dequant} == {"prompt", "decode"}
    assert not any(r.verdict == "FAIL" for r in rows), f"{verdict_line(rows)}\n{bad}"


def test_cuda_passes_tiny(tiny_model_file):
    eng = Engine.load(tiny_model_file, backend="cuda", max_context=128)
    check(validate(eng, GT))
    # probes run eagerly beside the graph; afterwards the graph still serves generation
    assert eng.backend.engine.graph_enabled


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.2-3b"])
def test_cuda_passes_presets(make_tiny_model, tmp_path_factory, preset):
    pytest.importorskip("torch")
    from conftest import load_tool

    from atomflow.model.quantize import quantize

    load_tool("hf_reference")
    gen = load_tool("gen_ground_truth")
    d = tmp_path_factory.mktemp(preset)
    hf = make_tiny_model.make_model(d / "hf", preset=preset, seed=0)
    model = d / "m.atomflow"
    quantize(hf, model, progress=False, log=lambda s: None)
    gen.generate(hf, model, d / "gt", prompt_tokens=32, steps=16)
    check(validate(Engine.load(model, backend="cuda", max_context=128), d / "gt"))
