"""Decode timings on random models of real shapes (tools/make_tiny_model.py's presets), for scripts/gpu_check.sh.

    python tools/gpu_bench.py --out summary.json [--presets llama-3.2-3b,llama-3.1-8b]
        [--workdir /tmp/atomflow-models] [--drop-hf] [--make-only] [--prompt 128] [--gen 256] [--max-context N]
        [--tests-xml gpu_tests.xml]

Per preset: makes the random HF directory and quantizes it (both cached in --workdir; --drop-hf
removes the HF directory once quantized, so four 7-8B presets fit a 64 GiB disk; --make-only
stops there, so a machine with a per-command time limit can make the files in one command and
time them in the next), loads it on
the CUDA backend, and measures TPOT p50/p99, tokens/s, bytes per token and efficiency against
the read bandwidth measured in the same run (atomflow bench's timing loop). When llama-3.1-8b is
in the run, every other row also gets `efficiency_vs_llama_3_1_8b`: its efficiency minus that
row's (same mode), in fractions (the table prints points). Writes one JSON summary, prints a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

REFERENCE_PRESET = "llama-3.1-8b"  # the other shapes' efficiency is compared with this one's
VS_REFERENCE = "efficiency_vs_llama_3_1_8b"  # the row field that holds the difference


def test_counts(xml_path: str | None) -> dict:
    if not xml_path or not Path(xml_path).is_file():
        return {}
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    total, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return dict(tests=total, passed=total - fail - err - skip, failed=fail + err, skipped=skip)


def model_file(preset: str, workdir: Path, drop_hf: bool = False) -> Path:
    """workdir/PRESET.atomflow, made (random HF directory workdir/PRESET, then quantized) unless
    already there. drop_hf: remove the HF directory once the file is written."""
    import make_tiny_model

    from atomflow.model.quantize import quantize

    out = workdir / f"{preset}.atomflow"
    hf = workdir / preset
    if not out.is_file():
        t = time.perf_counter()
        make_tiny_model.make_model(hf, preset=preset, seed=0)
        t_make = time.perf_counter() - t
        t = time.perf_counter()
        quantize(hf, out, progress=False, log=lambda s: None)
        print(f"{preset}: random HF model {t_make:.1f} s, quantize {time.perf_counter() - t:.1f} s", flush=True)
    if drop_hf and hf.is_dir():
        shutil.rmtree(hf)
    return out


def add_efficiency_vs_reference(models: dict) -> None:
    """Every "preset/mode" row other than llama-3.1-8b's gets VS_REFERENCE: its efficiency minus
    llama-3.1-8b's in the same mode (a fraction; +0.01 is one point better). Nothing is added
    when llama-3.1-8b is not in the run."""
    for name, r in models.items():
        preset, mode = name.rsplit("/", 1)
        ref = models.get(f"{REFERENCE_PRESET}/{mode}")
        if ref is not None and preset != REFERENCE_PRESET:
            r[VS_REFERENCE] = r["efficiency"] - ref["efficiency"]


def decode_row(eng, prompt: int, gen: int, bandwidth_gbs: float) -> dict:
    """`gen` greedy tokens after `prompt` tokens in the cache, timed by atomflow bench's own loop
    (one repetition after a warm-up): the bench row (TPOT p50/p90/p99, bytes per token, GB/s,
    efficiency) plus tokens_per_s = 1 / TPOT p50."""
    from atomflow.bench.engine import run_engine_tests
    from atomflow.bench.plan import BenchOptions, BenchTest

    test = BenchTest("tg", 0, gen, depth=prompt)
    opts = BenchOptions(model=str(eng.model.path), repetitions=1, tests=(test,))
    (row,) = run_engine_tests(eng, opts, bandwidth_gbs, log=lambda m: None)
    row["tokens_per_s"] = 1e3 / row["tpot_ms_p50"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--presets", default="llama-3.2-3b,llama-3.1-8b")
    ap.add_argument("--workdir", default="/tmp/atomflow-models")
    ap.add_argument("--drop-hf", action="store_true", help="remove each random HF directory once it is quantized")
    ap.add_argument("--make-only", action="store_true", help="make and quantize the presets' files, time nothing")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="KV cache length (default prompt + gen + 64); the attention grid is sized by it",
    )
    ap.add_argument("--tests-xml", default=None)
    a = ap.parse_args()
    max_context = a.max_context or a.prompt + a.gen + 64
    if max_context < a.prompt + a.gen:
        ap.error(f"--max-context {max_context} does not hold prompt + gen = {a.prompt + a.gen}")
    import make_tiny_model

    presets = [p for p in a.presets.split(",") if p]
    unknown = [p for p in presets if p not in make_tiny_model.PRESETS]
    if unknown:
        ap.error(f"--presets: unknown {', '.join(unknown)} (known: {', '.join(sorted(make_tiny_model.PRESETS))})")
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if a.make_only:
        for preset in presets:
            model_file(preset, workdir, a.drop_hf)
        return 0

    from atomflow import Engine, _core, runinfo
    from atomflow.bench.bandwidth import read_bandwidth_gbs

    bw = read_bandwidth_gbs()
    summary = dict(
        commit=runinfo.commit(),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        device=_core.device_info(),
        max_context=max_context,
        build=_core.build_info(),
        read_bandwidth_gbs=bw,
        tests=test_counts(a.tests_xml),
        models={},
    )
    for preset in presets:
        path = model_file(preset, workdir, a.drop_hf)
        for mode in ("graph", "eager"):
            eng = Engine.load(path, backend="cuda", max_context=max_context, eager=(mode == "eager"))
            r = decode_row(eng, a.prompt, a.gen, bw)
            r.update(load_s=eng.stats.load_s, core_load_s=eng.backend.load_seconds, plan=eng.backend.plan)
            summary["models"][f"{preset}/{mode}"] = r
            del eng
    add_efficiency_vs_reference(summary["models"])
    Path(a.out).write_text(json.dumps(summary, indent=2))

    print(
        f"\natomflow gpu_check  commit {summary['commit']}  {summary['device'].get('name')}  "
        f"read bandwidth {bw:.0f} GB/s  tests {summary['tests'] or 'not run'}"
    )
    print(table(summary["models"]))
    return 0


def table(models: dict) -> str:
    """The summary's rows, one line each; `vs 8B`: efficiency minus llama-3.1-8b's (same mode), in points."""
    head = f"{'model/mode':<24} {'TPOT p50':>9} {'p99':>7} {'tok/s':>7} {'MB/token':>9} {'GB/s':>6} {'eff':>5}"
    lines = [head + f" {'vs 8B':>6} {'load':>6}"]
    for name, r in models.items():
        delta = f"{100 * r[VS_REFERENCE]:+6.1f}" if VS_REFERENCE in r else " " * 6
        lines.append(
            f"{name:<24} {r['tpot_ms_p50']:7.3f}ms {r['tpot_ms_p99']:6.3f} {r['tokens_per_s']:7.1f} "
            f"{r['bytes_per_token'] / 1e6:9.1f} {r['achieved_gbs']:6.0f} {r['efficiency']:5.1%} {delta} {r['core_load_s']:5.2f}s"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
