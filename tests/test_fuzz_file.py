"""The reader cannot be crashed: a seeded mutation fuzz (tools/fuzz_atomflow.py) of a valid file,
520 variants through `atomflow info --verify` and `atomflow run`, in forked workers with a
memory limit and a timer per command. Every variant that is not byte-for-byte the valid file must end in one
clean error line (an AtomflowError) — no traceback, no hang, no memory blow-up, no answer (run,
without --verify, may read a file whose damage lies only in weights the prompt does not reach).
A sample goes through the real CLI in subprocesses: exit code 1, one stderr line, no traceback.

Replay or widen: ATOMFLOW_FUZZ_SEED=7 ATOMFLOW_FUZZ_VARIANTS=2000 pytest tests/test_fuzz_file.py,
or python tools/fuzz_atomflow.py --variants 2000 --seed 7 (prints counts by outcome)."""

import os
import subprocess
import sys

import pytest
from conftest import load_tool

SEED = int(os.environ.get("ATOMFLOW_FUZZ_SEED", "0"))
VARIANTS = int(os.environ.get("ATOMFLOW_FUZZ_VARIANTS", "520"))


@pytest.fixture(scope="module")
def fuzz():
    return load_tool("fuzz_atomflow")


@pytest.fixture(scope="module")
def base(fuzz, tmp_path_factory):
    return fuzz.build_base(tmp_path_factory.mktemp("fuzz")).read_bytes()


def test_mutation_fuzz(fuzz, base, tmp_path):
    [b] = fuzz.run_variants(base, SEED, [-1], tmp_path, workers=1)
    assert all(b[m][0] == "accepted" for m in fuzz.MODES), f"the valid file does not run: {b}"
    results = fuzz.run_variants(base, SEED, range(VARIANTS), tmp_path, workers=2)
    print(fuzz.summarize(results))
    assert len(results) == VARIANTS
    kinds = {r["kind"] for r in results}
    assert {"truncate", "append", "bitflip", "length", "table", "meta", "values"} <= kinds
    bad = [f"#{r['index']} {r['name'][:60]}: " + " | ".join(fuzz.failures(r)) for r in results if fuzz.failures(r)]
    assert not bad, f"{len(bad)} variants (seed {SEED}) not refused cleanly:\n" + "\n".join(bad[:20])
    assert not list(tmp_path.glob("v*.atomflow"))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "atomflow.cli", *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("index", [0, 5, 11, 26, 42, 271])
def test_cli_sample_is_one_line_exit_1(fuzz, base, tmp_path, index):
    """A few variants (a template that divides by zero, None offsets, an overlap, a NaN scale, an
    FP8 NaN code, a huge scale) through the real command: exit 1, one line, no traceback."""
    kind, name, blob = fuzz.make_variant(base, SEED, index)
    path = tmp_path / "bad.atomflow"
    path.write_bytes(blob)
    runs = [_cli("info", path, "--verify")]
    if kind not in ("values", "bitflip-data"):  # without --verify, run may not read the damaged weights
        runs.append(_cli("run", path, "-p", "Hello", "-n", "2", "--backend", "cpu", "--max-context", "64", "-q"))
    for r in runs:
        assert r.returncode == 1, (name, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("atomflow: error: "), (name, r.stderr)
        assert "Traceback" not in r.stderr and str(path) in lines[0], (name, r.stderr)
