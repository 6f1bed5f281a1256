"""The prefill recipes on the CPU reference (atomflow/model/recipe.py): the FP8 recipe's activation
quantization as the CUDA kernel's contract states it, where the reference applies it (calls of at least
W8A8_MIN_ROWS tokens, every linear's input), and the recipe's switch through Engine.load and the CLI."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from atomflow.backends.cpu import CpuBackend
from atomflow.model.fileformat import AtomflowFile
from atomflow.model.recipe import W8A8_MIN_ROWS
from atomflow.model.reference import quantize_fp8_rows


def test_quantize_fp8_rows_per_token_per_128_columns(rng=np.random.default_rng(0)):
    x = rng.standard_normal((5, 320)).astype(np.float32) * np.float32(3.0)
    x[2, 128:256] = 0.0  # an all-zero group stays zero (scale 1)
    x[3, :] *= np.float32(1e-3)  # the scale follows each row's own range
    q = quantize_fp8_rows(x)
    for r in range(5):
        for g0 in (0, 128, 256):  # the last group holds 64 columns
            blk, qb = x[r, g0 : g0 + 128], q[r, g0 : g0 + 128]
            amax = np.abs(blk).max()
            if amax == 0:
                assert not qb.any()
                continue
            scale = np.float32(amax / np.float32(448.0))
            on_grid = (qb / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
            np.testing.assert_array_equal(qb, on_grid)  # every value on the group's e4m3 grid
            assert np.abs(qb).max() == pytest.approx(amax, rel=1e-6)  # the largest maps to 448 exactly
            assert np.all(np.abs(qb - blk) <= np.abs(blk) * 2.0**-4 + scale * 2.0**-9 + 1e-30)  # e4m3's half step


def test_quantize_fp8_rows_takes_other_group_sizes(rng=np.random.default_rng(3)):
    """Groups of 32 columns: each block on its own e4m3 grid, its largest value exact; the default is 128."""
    x = rng.standard_normal((3, 96)).astype(np.float32)
    x[1, 40] = 300.0  # an outlier moves only its own group's scale
    q = quantize_fp8_rows(x, 32)
    for r in range(3):
        for g0 in (0, 32, 64):
            blk, qb = x[r, g0 : g0 + 32], q[r, g0 : g0 + 32]
            scale = np.float32(np.abs(blk).max() / np.float32(448.0))
            np.testing.assert_array_equal(qb, (qb / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale)
            assert np.abs(qb).max() == pytest.approx(np.abs(blk).max(), rel=1e-6)
    np.testing.assert_array_equal(quantize_fp8_rows(x), quantize_fp8_rows(x, 128))
    assert not np.array_equal(q, quantize_fp8_rows(x))


def test_reference_applies_the_fp8_recipe_to_long_calls(tiny_model_file):
    model = AtomflowFile(tiny_model_file)
    ids = np.random.default_rng(1).integers(0, model.spec.vocab_size, W8A8_MIN_ROWS + 40).astype(np.int32)
    plain, fp8 = CpuBackend(model, 1024), CpuBackend(model, 1024, prefill_recipe="w8a8")
    # Calls under the threshold (short prompts, decode steps) run W8A16 on both.
    short = ids[: W8A8_MIN_ROWS - 1]
    np.testing.assert_array_equal(plain.prefill(short), fp8.prefill(short))
    np.testing.assert_array_equal(plain.decode(7), fp8.decode(7))
    plain.reset(), fp8.reset()
    a, b = plain.prefill(ids), fp8.prefill(ids)
    cos = float(a.astype(np.float64) @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    assert 0.99 < cos < 1.0, cos  # other bits, the same model
    with pytest.raises(ValueError, match="prefill_recipe"):
        CpuBackend(model, 64, prefill_recipe="w4a8")


def test_reference_fp8_products_attribute_the_recipe(tiny_model_file):
    """tools/recipe_attribution.py's switch: no product quantized is w8a16's bits, all of them w8a8's, and
    each product left out changes the logits (its input was quantized)."""
    from atomflow.model.reference import FP8_PRODUCTS

    model = AtomflowFile(tiny_model_file)
    ids = np.random.default_rng(2).integers(0, model.spec.vocab_size, W8A8_MIN_ROWS + 8).astype(np.int32)
    plain, fp8 = CpuBackend(model, 512), CpuBackend(model, 512, prefill_recipe="w8a8")

    def run(products):
        fp8.reset()
        fp8.ref.fp8_products = frozenset(products)
        return fp8.prefill(ids)

    every = run(FP8_PRODUCTS)
    np.testing.assert_array_equal(run(()), plain.prefill(ids))
    for p in FP8_PRODUCTS:
        assert not np.array_equal(run([q for q in FP8_PRODUCTS if q != p]), every), f"{p} left out changed nothing"
    fp8.reset()
    fp8.ref.fp8_products = frozenset(FP8_PRODUCTS)
    np.testing.assert_array_equal(fp8.prefill(ids), every)
    fp8.reset()
    fp8.ref.fp8_group = 32  # tools/recipe_attribution.py --groups: the scales' columns
    assert not np.array_equal(fp8.prefill(ids), every)


def test_perplexity_cli_takes_the_recipe(tiny_model_file, tmp_path, capsys):
    from atomflow import cli

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    args = ["perplexity", str(tiny_model_file), "--text", str(text), "--ctx", "256", "--max-windows", "1"]
    assert cli.main([*args, "--backend", "cpu", "--prefill-recipe", "w8a8"]) == 0
    fp8 = capsys.readouterr().out
    assert cli.main([*args, "--backend", "cpu"]) == 0
    plain = capsys.readouterr().out
    assert "ppl" in fp8 and fp8 != plain
    with pytest.raises(SystemExit) as bad:
        cli.main([*args, "--backend", "cpu", "--prefill-recipe", "w4"])
    assert bad.value.code == 1 and "--prefill-recipe" in capsys.readouterr().err
