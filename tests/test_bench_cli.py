"""`atomflow bench` and `atomflow profile` as a user runs them, without a GPU: bad options are one
line on stderr and exit 1, before any GPU work; where the CUDA backend cannot run, they say so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from atomflow.device import cuda_status


def atomflow(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "atomflow.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def error_line(r) -> str:
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("atomflow: error: "), r.stderr
    assert r.stdout == ""
    return lines[0]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["bench", "{missing}"], "no such model file"),
        (["bench", "{garbage}"], "not an atomflow file"),
        (["bench", "{model}", "-p", "-5"], "-p: -5 must be >= 0"),
        (["bench", "{model}", "-p", "12x"], "-p: '12x' is not an integer"),
        (["bench", "{model}", "-n", "1"], "-n: 1 generated token"),
        (["bench", "{model}", "-r", "0"], "-r: 0 must be >= 1"),
        (["bench", "{model}", "-o", "xml"], "output format must be one of md, json, csv"),
        (["bench", "{model}", "--baseline", "llama.cpp"], "unknown baseline 'llama.cpp'"),
        (["bench", "{model}", "--context", "16384"], "the model supports 16384"),  # + 128 generated > 16384
        (["bench", "{model}", "-p", "20000"], "pp20000 needs 20001 positions"),
        (["bench"], "the following arguments are required: model"),
        (["profile", "{missing}"], "no such model file"),
        (["profile", "{model}", "--steps", "0"], "--steps: 0 must be >= 1"),
        (["profile", "{model}", "--steps", "many"], "--steps: 'many' is not an integer"),
        (["profile", "{model}", "--context", "-3"], "--context: -3 must be >= 0"),
        (["profile", "{model}", "--context", "16380"], "the model supports 16384"),
    ],
)
def test_bad_input_is_one_line(tiny_model_file, tmp_path, args, needle):
    garbage = tmp_path / "garbage.atomflow"
    garbage.write_bytes(os.urandom(2048))
    subst = dict(missing=tmp_path / "nope.atomflow", garbage=garbage, model=tiny_model_file)
    assert needle in error_line(atomflow(*[a.format(**subst) for a in args]))


@pytest.mark.skipif(cuda_status()[0], reason="a usable GPU is present")
@pytest.mark.parametrize("cmd", ["bench", "profile"])
def test_cuda_unavailable_is_a_clear_error(tiny_model_file, cmd):
    line = error_line(atomflow(cmd, tiny_model_file))
    assert "cuda backend unavailable" in line


@pytest.mark.skipif(cuda_status()[0], reason="a usable GPU is present")
def test_plot_without_matplotlib_or_gpu(tiny_model_file, tmp_path):
    """--plot checks matplotlib before any GPU work; without one, the GPU error comes next."""
    try:
        import matplotlib  # noqa: F401

        want = "cuda backend unavailable"
    except ImportError:
        want = "--plot needs matplotlib"
    assert want in error_line(atomflow("profile", tiny_model_file, "--plot", tmp_path / "p.png"))


def test_help_lists_the_options():
    r = atomflow("bench", "--help")
    assert r.returncode == 0
    for flag in ("-p", "-n", "--context", "-r", "-o", "--baseline", "--hf-dir", "--no-warmup"):
        assert flag in r.stdout
    r = atomflow("profile", "--help")
    assert r.returncode == 0 and "--steps" in r.stdout and "--plot" in r.stdout and "--json" in r.stdout


def test_bench_baseline_flags_parse():
    """--baseline torch-fp8 and --eager-prefill reach the bench options."""
    from atomflow.bench.plan import make_options
    from atomflow.cli import build_parser

    a = build_parser().parse_args(
        ["bench", "m.atomflow", "--baseline", "torch-compile", "--baseline", "torch-fp8", "--eager-prefill"]
    )
    assert a.baseline == ["torch-compile", "torch-fp8"] and a.eager_prefill
    opts = make_options(a.model, baselines=a.baseline, compile_prefill=not a.eager_prefill)
    assert opts.baselines == ("torch-compile", "torch-fp8") and opts.compile_prefill is False
    assert build_parser().parse_args(["bench", "m.atomflow"]).eager_prefill is False
