"""The validator: the CPU backend passes the committed tiny-model ground truth, a corrupted
weight is caught at its layer and not before, and ground truth from another file is refused."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from atomflow import Engine
from atomflow.errors import AtomflowError
from atomflow.model.fileformat import AtomflowFile
from atomflow.validate import load_ground_truth, validate, verdict_line

GT = Path(__file__).resolve().parents[1] / "ground_truth" / "tiny"


def test_committed_ground_truth_is_for_this_tiny_model(tiny_model_file):
    """The tiny model is generated deterministically; if this fails, its generator changed:
    regenerate with the command in ground_truth/README.md."""
    refs = load_ground_truth(GT)
    assert {g.reference for g in refs} == {"dequant", "original"}
    assert all(g.checksum == AtomflowFile(tiny_model_file).checksum for g in refs)
    assert len(refs[0].prompt) == 32 and len(refs[0].decode) == 16


def test_cpu_backend_passes(tiny_model_file):
    rows = validate(Engine.load(tiny_model_file, backend="cpu", max_context=64), GT)
    assert len(rows) == 2 * (3 * 5 * 2 + 4)  # 2 refs x (3 layers x 5 probes + 2 final) x (prompt, decode)
    assert all(r.verdict == "PASS" for r in rows if r.reference == "dequant"), verdict_line(rows)
    assert not any(r.verdict == "FAIL" for r in rows), verdict_line(rows)
    assert min(r.cosine for r in rows if r.reference == "dequant") > 0.99999


def _corrupt_row(src: Path, dst: Path, tensor: str, row: int, factor: float) -> None:
    """Scales one output row of an FP8 matrix by rewriting its fp32 scales in place (the header,
    and so the checksum field the validator matches on, stays as it was)."""
    shutil.copyfile(src, dst)
    with AtomflowFile(src) as m:
        t = m.tensors[tensor + ".scale"]
        cols = t.shape[1]
        off = t.offset + row * cols * 4
        scales = np.array(m.array(tensor + ".scale")[row], dtype=np.float32) * factor
    with open(dst, "r+b") as f:
        f.seek(off)
        f.write(scales.tobytes())


def test_corrupted_weight_fails_at_its_layer_not_before(tiny_model_file, tmp_path):
    bad = tmp_path / "bad.atomflow"
    _corrupt_row(tiny_model_file, bad, "layers.1.w2", row=7, factor=8.0)
    rows = [r for r in validate(Engine.load(bad, backend="cpu", max_context=64), GT) if r.reference == "dequant"]
    fails = [r for r in rows if r.verdict == "FAIL"]
    assert fails, verdict_line(rows)
    assert min(r.layer for r in fails if r.layer >= 0) == 1
    assert fails[0].layer == 1 and fails[0].probe == "mlp_out"
    before = [r for r in rows if r.layer == 0 or (r.layer == 1 and r.probe in ("attn_norm", "attn_out", "resid_mid"))]
    assert all(r.verdict == "PASS" for r in before)

    r = subprocess.run(
        [sys.executable, "-m", "atomflow.cli", "validate", str(bad), "--ground-truth", str(GT), "--backend", "cpu"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "first FAIL: dequant mlp_out at layer 1" in r.stderr


def test_ground_truth_from_another_file_is_refused(make_tiny_model, tmp_path):
    from atomflow.model.quantize import quantize

    other = tmp_path / "other.atomflow"
    quantize(make_tiny_model.make_model(tmp_path / "hf", preset="tiny", seed=1), other, progress=False, log=lambda s: None)
    with pytest.raises(AtomflowError, match="made from another model file"):
        validate(Engine.load(other, backend="cpu", max_context=64), GT)


def test_cli_json(tiny_model_file):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "atomflow.cli",
            "validate",
            str(tiny_model_file),
            "--ground-truth",
            str(GT),
            "--backend",
            "cpu",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {row["probe"] for row in rows} == {
        "attn_norm",
        "attn_out",
        "resid_mid",
        "mlp_out",
        "layer_out",
        "final_norm",
        "logits",
    }


def test_gen_ground_truth_reproduces_committed_dumps(tiny_hf_dir, tiny_model_file, tmp_path):
    """The dumps come from HF hooks; regenerating them here gives the committed numbers."""
    pytest.importorskip("torch")
    from conftest import load_tool

    load_tool("hf_reference")
    gen = load_tool("gen_ground_truth")
    gen.generate(tiny_hf_dir, tiny_model_file, tmp_path / "gt")
    new, old = load_ground_truth(tmp_path / "gt"), load_ground_truth(GT)
    for a, b in zip(sorted(new, key=lambda g: g.reference), sorted(old, key=lambda g: g.reference)):
        assert a.prompt == b.prompt and a.decode == b.decode
        for k, v in b.tensors.items():
            assert a.tensors[k].shape == v.shape
            np.testing.assert_allclose(a.tensors[k], v, rtol=1e-4, atol=1e-5, err_msg=k)
