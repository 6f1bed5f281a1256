"""The quantizer: FP8 rounding by definition, every source dtype and lm_head mode, atomic
output on failure, and peak memory near one tensor rather than the model."""

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from atomflow.errors import UnsupportedModelError
from atomflow.model.fileformat import AtomflowFile
from atomflow.model.quantize import dequantize_rows, quantize, quantize_rows
from atomflow.model.reference import ReferenceModel


def test_quantize_rows_by_definition():
    rng = np.random.default_rng()
    w = (rng.standard_normal((7, 384)) * rng.uniform(1e-3, 1e3, (7, 1))).astype(np.float32)
    w[3, 128:256] = 0.0
    q, s = quantize_rows(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == w.shape and s.shape == (7, 3)
    g = w.reshape(7, 3, 128)
    np.testing.assert_array_equal(s[3, 1], 1.0)  # all-zero group
    amax = np.abs(g).max(-1)
    np.testing.assert_allclose(s[amax > 0], amax[amax > 0] / 448, rtol=1e-7)
    expect = (g / s[..., None]).astype(ml_dtypes.float8_e4m3fn).reshape(7, 384)  # RNE, in range
    np.testing.assert_array_equal(q.view(np.uint8), expect.view(np.uint8))
    qf = q.astype(np.float32).reshape(7, 3, 128)
    assert np.all(np.abs(qf).max(-1)[amax > 0] == 448)  # each group's absmax hits the top code
    err = np.abs(dequantize_rows(q, s) - w)
    assert np.all(err <= np.repeat(s, 128, axis=1) * 16 + 1e-30)  # half a step of e4m3 at 448 is 16
    assert not np.isnan(quantize_rows(np.full((1, 128), 3e38, np.float32))[0].astype(np.float32)).any()


@pytest.mark.parametrize("k", [64, 192, 576, 1536 + 64])
def test_quantize_rows_tail_group(k):
    """k not a multiple of 128: ceil(k / 128) scales, the last over the k % 128 columns left."""
    rng = np.random.default_rng(k)
    w = (rng.standard_normal((5, k)) * rng.uniform(1e-2, 1e2, (5, 1))).astype(np.float32)
    w[:, -(k % 128 or 128) :] *= 100.0  # the tail group gets its own scale, not its neighbour's
    q, s = quantize_rows(w)
    groups = -(-k // 128)
    assert q.shape == w.shape and q.flags.c_contiguous and s.shape == (5, groups)
    for g in range(groups):
        cols = w[:, 128 * g : min(k, 128 * (g + 1))]
        np.testing.assert_allclose(s[:, g], np.abs(cols).max(-1) / 448, rtol=1e-7)
    err = np.abs(dequantize_rows(q, s) - w)
    assert np.all(err <= np.repeat(s, 128, axis=1)[:, :k] * 16)


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_source_dtypes(make_tiny_model, tmp_path, tiny_model_file, dtype):
    hf = make_tiny_model.make_model(tmp_path / "hf", preset="tiny", seed=0, dtype=dtype)
    out = tmp_path / "m.atomflow"
    quantize(hf, out, progress=False, log=lambda s: None)
    with AtomflowFile(out) as m, AtomflowFile(tiny_model_file) as ref:
        assert m.quantization["source_dtype"] == dtype
        # same random model in another dtype: the dequantized weights agree to bf16-ish precision
        a, b = m.weight_f32("layers.0.wqkv"), ref.weight_f32("layers.0.wqkv")
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.05


@pytest.mark.parametrize(
    "untied,lm_head,mode,stored",
    [
        (False, "fp8", "fp8", "F8_E4M3"),
        (True, "fp8", "fp8", "F8_E4M3"),
        (True, "bf16", "bf16", "BF16"),
        (False, "bf16", "tied", None),
    ],
)
def test_lm_head_modes(make_tiny_model, tmp_path, untied, lm_head, mode, stored):
    hf = make_tiny_model.make_model(tmp_path / "hf", preset="tiny", seed=1, untied=untied)
    out = tmp_path / "m.atomflow"
    quantize(hf, out, lm_head=lm_head, progress=False, log=lambda s: None)
    with AtomflowFile(out) as m:
        assert m.quantization["lm_head"] == mode
        assert (m.tensors["lm_head"].dtype if "lm_head" in m.tensors else None) == stored
        logits = ReferenceModel(m, 16).forward(np.array([1, 2, 3]))
        assert np.isfinite(logits).all() and logits.std() > 0.1


def _assert_no_output(tmp_path, out):
    assert not out.exists()
    assert not list(out.parent.glob(out.name + ".tmp*"))


def test_missing_shard_leaves_nothing(make_tiny_model, tmp_path):
    hf = make_tiny_model.make_model(tmp_path / "hf", preset="tiny", seed=2)
    (hf / "model-00002-of-00002.safetensors").unlink()
    out = tmp_path / "m.atomflow"
    with pytest.raises(FileNotFoundError, match="missing"):
        quantize(hf, out, progress=False, log=lambda s: None)
    _assert_no_output(tmp_path, out)


@pytest.mark.parametrize(
    "edit,err,needle",
    [
        (lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"), UnsupportedModelError, "GPT2"),
        (lambda c: c.update(hidden_size=300), UnsupportedModelError, "hidden_size = 300"),
        (lambda c: c.update(intermediate_size=768), UnsupportedModelError, "config.json implies"),
    ],
)
def test_unsupported_or_inconsistent_model(make_tiny_model, tmp_path, edit, err, needle):
    hf = make_tiny_model.make_model(tmp_path / "hf", preset="tiny", seed=3)
    cfg = json.loads((hf / "config.json").read_text())
    edit(cfg)
    (hf / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "m.atomflow"
    with pytest.raises(err) as e:
        quantize(hf, out, progress=False, log=lambda s: None)
    assert needle in str(e.value)
    _assert_no_output(tmp_path, out)


def test_no_tokenizer(make_tiny_model, tmp_path):
    hf = make_tiny_model.make_model(tmp_path / "hf", preset="tiny", seed=3)
    (hf / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        quantize(hf, tmp_path / "m.atomflow", progress=False, log=lambda s: None)


@pytest.mark.slow
def test_peak_memory_is_one_tensor_not_the_model(make_tiny_model, tmp_path):
    """The Llama-3.2-1B shape: 2.3 GiB of bf16 weights whose largest tensor is the 128256 x 2048
    embedding (501 MiB, also quantized as the lm_head). Peak RSS of a fresh quantize process must
    stay under the largest tensor + 1 GiB, well under the model (a shard held mapped would not)."""
    hf = make_tiny_model.make_model(tmp_path / "hf", preset="llama-3.2-1b", seed=0)
    largest = 128256 * 2048 * 2
    model = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    assert model > largest + 2**30 + 2**29  # the bound below can fail
    code = (
        "import resource, sys; from atomflow.model.quantize import quantize; "
        "quantize(sys.argv[1], sys.argv[2], progress=False, log=lambda s: None); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(hf), str(tmp_path / "m.atomflow")], capture_output=True, text=True, check=True
    )
    peak = int(r.stdout.strip())
    assert peak < largest + 2**30, f"peak RSS {peak / 2**20:.0f} MiB for a {model / 2**20:.0f} MiB model"
