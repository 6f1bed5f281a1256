"""The `atomflow` command as a user runs it: quantize -> info -> run, download from the local
HF cache when offline, and one-line errors with exit code 1 for bad input."""

import json
import os
import subprocess
import sys

import pytest


def atomflow(*args, env=None, check=True):
    r = subprocess.run(
        [sys.executable, "-m", "atomflow.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )
    if check and r.returncode != 0:
        raise AssertionError(f"atomflow {args} -> {r.returncode}\n{r.stderr}")
    return r


def test_quantize_info_run(tiny_hf_dir, tmp_path):
    out = tmp_path / "tiny.atomflow"
    r = atomflow("quantize", tiny_hf_dir, "-o", out, "-q")
    assert "wrote" in r.stdout and out.is_file()
    assert "relative quantization error" in r.stderr and "lm_head" in r.stderr

    info = json.loads(atomflow("info", out, "--json", "--verify").stdout)
    assert info["spec"]["num_layers"] == 3 and info["quantization"]["lm_head"] == "fp8"
    assert info["checksum_verified"] and info["source"]["path"] == str(tiny_hf_dir.resolve())
    assert "checksum" in atomflow("info", out).stdout

    r = atomflow(
        "run",
        out,
        "--prompt",
        "Tell me a story",
        "-n",
        "12",
        "--temperature",
        "0.8",
        "--seed",
        "1",
        "--backend",
        "cpu",
        "--ignore-eos",
    )
    assert len(r.stdout) > 1, "no text streamed"
    for field in ("load time", "prompt eval", "eval time", "tokens per second", "backend cpu"):
        assert field in r.stderr
    again = atomflow(
        "run",
        out,
        "--prompt",
        "Tell me a story",
        "-n",
        "12",
        "--temperature",
        "0.8",
        "--seed",
        "1",
        "--backend",
        "cpu",
        "--ignore-eos",
        "-q",
    )
    assert again.stdout == r.stdout  # same seed: same text


def _error_line(r) -> str:
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("atomflow: error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["run", "{missing}", "-p", "hi"], "no such model file"),
        (["run", "{garbage}", "-p", "hi"], "not an atomflow file"),
        (["run", "{model}", "-p", "hi", "--top-p", "1.5", "--backend", "cpu"], "top_p"),
        (["run", "{model}", "-p", "hi", "--temperature", "-1", "--backend", "cpu"], "temperature"),
        (["run", "{model}", "-p", "word " * 40, "--max-context", "8", "--backend", "cpu"], "does not fit max_context 8"),
        (["info", "{garbage}"], "not an atomflow file"),
        (["quantize", "{missing}", "-o", "{out}"], "no such model directory"),
    ],
)
def test_bad_input_is_one_line(tiny_model_file, tmp_path, args, needle):
    garbage = tmp_path / "garbage.atomflow"
    garbage.write_bytes(os.urandom(4096))
    subst = dict(missing=tmp_path / "nope.atomflow", garbage=garbage, model=tiny_model_file, out=tmp_path / "o")
    r = atomflow(*[a.format(**subst) for a in args], check=False)
    assert needle in _error_line(r)
    assert not (tmp_path / "o").exists()


def test_download_offline_from_cache(tiny_hf_dir, tmp_path):
    """The download path against local data: an HF cache holding the model, the Hub unreachable."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "cache" / "models--org--tiny" / "snapshots" / commit
    snap.mkdir(parents=True)
    (tmp_path / "cache" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "cache" / "models--org--tiny" / "refs" / "main").write_text(commit)
    for f in tiny_hf_dir.iterdir():
        (snap / f.name).symlink_to(f)
    env = dict(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "cache"))
    target = tmp_path / "dl"
    r = atomflow("download", "org/tiny", "--dir", target, env=env)
    assert "downloaded" in r.stdout
    assert (target / "config.json").is_file() and not (target / "config.json").is_symlink()
    out = tmp_path / "m.atomflow"
    atomflow("quantize", target, "-o", out, "-q")
    src = json.loads(atomflow("info", out, "--json").stdout)["source"]
    assert src["repo_id"] == "org/tiny" and src["revision"] == commit

    r = atomflow("download", "org/absent", "--dir", tmp_path / "x", env=env, check=False)
    assert "not in the local cache" in _error_line(r)


def test_info_plan_without_gpu_is_one_line(tiny_model_file):
    """`atomflow info MODEL --plan` plans for the GPU at hand: without the CUDA core or a GPU it says so
    in one line and exits 1 (with --json too)."""
    from atomflow.device import cuda_status

    if cuda_status()[0]:
        pytest.skip("a usable GPU is present: tests/test_engine_gpu.py checks the plan")
    for extra in ([], ["--json"]):
        r = atomflow("info", tiny_model_file, "--plan", *extra, check=False)
        line = _error_line(r)
        assert "--plan needs the CUDA core and a GPU" in line and r.stdout == ""
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


SM90_TILES = [[64, "narrow-streamk"], [256, "wide-streamk"], [None, "xwide or wide by tile waves"]]


@pytest.mark.parametrize(
    "skinny,sm90,route",
    [
        (
            32,
            17,
            "2..4 rows (verify chunks 2..16), gemm_w8a16_skinny for 5..32 rows (QKV with RoPE + KV append fused; RMSNorm "
            "split between the products around it), gemm_w8a16_sm90 (CUTLASS wgmma) from 33",
        ),
        (None, 17, "2..16 rows, gemm_w8a16_sm90 (CUTLASS wgmma) from 17 rows"),
        (
            32,
            None,
            "gemm_w8a16_skinny for 5..32 rows (QKV with RoPE + KV append fused; RMSNorm split between the products "
            "around it), gemm_w8a16",
        ),
        (None, None, "2..16 rows, gemm_w8a16 (tensor cores) from 17 rows"),
    ],
)
def test_plan_table_names_the_prompt_route(capsys, skinny, sm90, route):
    """`info --plan` says which kernel takes a prompt chunk of each size, as forward.cu routes it: the
    small-M GEMV, the skinny GEMM (the plan's prefill_skinny_max_rows, None without it), then the sm90 GEMM
    (None in a build without nvidia-cutlass: gemm_w8a16)."""
    from atomflow.cli import _print_plan

    plan = dict(
        device=dict(name="GPU", sm_count=132, capability=[9, 0]),
        options=dict(pdl=True),
        max_context=2048,
        graphs=[],
        activations="f16",
        tail="fused",
        products=[],
        attention=[],
        prefill_small_m_max_rows=16,
        prefill_small_m_rope=False,
        prefill_skinny_max_rows=skinny,
        prefill_skinny_min_rows=5 if skinny else None,
        prefill_skinny_rope=skinny is not None,
        prefill_skinny_norm=skinny is not None,
        prefill_sm90_gemm_min_rows=sm90,
        prefill_sm90_tiles=SM90_TILES,
    )
    _print_plan(plan)
    line = next(s for s in capsys.readouterr().out.splitlines() if "prefill products" in s)
    assert line.startswith("  prefill products: gemv_w8a16_m for chunks of 2..") and route in line, line
