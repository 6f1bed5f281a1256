"""Decode timings on random Llama-shaped models, for scripts/gpu_check.sh.

    python tools/gpu_bench.py --out summary.json [--presets llama-3.2-3b,llama-3.1-8b]
        [--workdir /tmp/atomflow-models] [--prompt 128] [--gen 256] [--max-context N] [--tests-xml gpu_tests.xml]

Per preset: makes the random HF directory and quantizes it (both cached in --workdir), loads it
on the CUDA backend, and measures TPOT p50/p99, tokens/s, bytes per token and efficiency
against the read bandwidth measured in the same run (atomflow bench's timing loop). Writes one JSON summary, prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def test_counts(xml_path: str | None) -> dict:
    if not xml_path or not Path(xml_path).is_file():
        return {}
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    total, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return dict(tests=total, passed=total - fail - err - skip, failed=fail + err, skipped=skip)


def model_file(preset: str, workdir: Path) -> Path:
    import make_tiny_model

    from atomflow.model.quantize import quantize

    out = workdir / f"{preset}.atomflow"
    if not out.is_file():
        hf = workdir / preset
        t = time.perf_counter()
        make_tiny_model.make_model(hf, preset=preset, seed=0)
        t_make = time.perf_counter() - t
        t = time.perf_counter()
        quantize(hf, out, progress=False, log=lambda s: None)
        print(f"{preset}: random HF model {t_make:.1f} s, quantize {time.perf_counter() - t:.1f} s", flush=True)
    return out


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

    from atomflow import Engine, _core, runinfo
    from atomflow.bench.bandwidth import read_bandwidth_gbs

    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
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
    for preset in [p for p in a.presets.split(",") if p]:
        path = model_file(preset, workdir)
        for mode in ("graph", "eager"):
            eng = Engine.load(path, backend="cuda", max_context=max_context, eager=(mode == "eager"))
            r = decode_row(eng, a.prompt, a.gen, bw)
            r.update(load_s=eng.stats.load_s, core_load_s=eng.backend.load_seconds, plan=eng.backend.plan)
            summary["models"][f"{preset}/{mode}"] = r
            del eng
    Path(a.out).write_text(json.dumps(summary, indent=2))

    print(
        f"\natomflow gpu_check  commit {summary['commit']}  {summary['device'].get('name')}  "
        f"read bandwidth {bw:.0f} GB/s  tests {summary['tests'] or 'not run'}"
    )
    print(f"{'model/mode':<24} {'TPOT p50':>9} {'p99':>7} {'tok/s':>7} {'MB/token':>9} {'GB/s':>6} {'eff':>5} {'load':>6}")
    for name, r in summary["models"].items():
        print(
            f"{name:<24} {r['tpot_ms_p50']:7.3f}ms {r['tpot_ms_p99']:6.3f} {r['tokens_per_s']:7.1f} "
            f"{r['bytes_per_token'] / 1e6:9.1f} {r['achieved_gbs']:6.0f} {r['efficiency']:5.1%} {r['core_load_s']:5.2f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
