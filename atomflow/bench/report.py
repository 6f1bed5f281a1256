"""Render an `atomflow bench` result (result.py) as markdown (llama-bench's table plus TPOT
percentiles, bytes and efficiency, then our speedups), JSON (everything, every sample) or CSV
(one line per engine and test)."""

from __future__ import annotations

import csv
import io
import json

CSV_COLUMNS = (
    "engine",
    "test",
    "status",
    "reason",
    "n_prompt",
    "n_gen",
    "depth",
    "tokens_per_s_avg",
    "tokens_per_s_std",
    "tpot_ms_p50",
    "tpot_ms_p90",
    "tpot_ms_p99",
    "ttft_ms",
    "bytes_per_token",
    "achieved_gbs",
    "efficiency",
    "speedup",
    "gpu",
    "read_bandwidth_gbs",
    "commit",
    "recipe",
    "compile_s",
    "prefill_compile_s",
)


def render(result: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(result, indent=2)
    if fmt == "csv":
        return to_csv(result)
    if fmt == "md":
        return to_markdown(result)
    raise ValueError(f"output format must be md, json or csv, got {fmt!r}")


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _gpu(result: dict) -> str:
    return (result.get("device") or {}).get("name") or "unknown GPU"


def to_markdown(result: dict) -> str:
    model = result["model"]
    opts = result["options"]
    lines = [
        f"atomflow bench: {model['name']} | {_gpu(result)} | read bandwidth "
        f"{_num(result.get('read_bandwidth_gbs'), '.0f')} GB/s | commit {result.get('commit')} | "
        f"{opts['repetitions']} repetitions",
        "",
        "| engine | test | t/s | TPOT p50 ms | p90 | p99 | TTFT ms | MB/token | GB/s | eff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows, shown_skip = result["rows"], set()
    for r in rows:
        if r["status"] != "ok":
            same = [x for x in rows if x["engine"] == r["engine"]]
            if all(x["status"] != "ok" and x["reason"] == r["reason"] for x in same):  # one line for all
                if r["engine"] not in shown_skip:
                    shown_skip.add(r["engine"])
                    lines.append(f"| {r['engine']} | all | skipped: {r['reason']} | | | | | | | |")
                continue
            lines.append(f"| {r['engine']} | {r['test']} | skipped: {r['reason']} | | | | | | | |")
            continue
        tps = f"{r['tokens_per_s_avg']:.2f} ± {r['tokens_per_s_std']:.2f}"
        mb = None if r["bytes_per_token"] is None else r["bytes_per_token"] / 1e6
        eff = "-" if r["efficiency"] is None else f"{100 * r['efficiency']:.1f}%"
        lines.append(
            f"| {r['engine']} | {r['test']} | {tps} | {_num(r['tpot_ms_p50'], '.3f')} | "
            f"{_num(r['tpot_ms_p90'], '.3f')} | {_num(r['tpot_ms_p99'], '.3f')} | "
            f"{_num(r['ttft_ms'], '.2f')} | {_num(mb, '.1f')} | {_num(r['achieved_gbs'], '.0f')} | {eff} |"
        )
    lines += [
        "",
        "pp: prompt tokens/s, TTFT = prefill + first token; its bytes/efficiency are a floor "
        "(prefill is compute-bound). tg: TPOT percentiles over every gap; GB/s = bytes / TPOT p50.",
    ]
    spec_rows = [r for r in rows if r["status"] == "ok" and "tpot_effective_ms" in r]
    if spec_rows:
        lines += [
            "",
            "--speculate (one engine; effective TPOT = generation time / (N - 1))",
            "",
            "| engine | test | t/s | effective TPOT ms | tokens/step | tokens/verify | verify ms | acceptance |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in spec_rows:
            acc = r.get("acceptance")
            lines.append(
                f"| {r['engine']} | {r['test']} | {_num(r['tokens_per_s_avg'], '.2f')} | {_num(r['tpot_effective_ms'], '.3f')} | "
                f"{_num(r.get('tokens_per_step'), '.2f')} | {_num(r.get('accepted_per_verify'), '.2f')} | "
                f"{_num(r.get('verify_ms'), '.3f')} | {'-' if acc is None else f'{100 * acc:.0f}%'} |"
            )
    lines += recipes(rows)
    ups = result.get("speedups") or []
    # One table per engine of ours with speedups ("atomflow", then e.g. "atomflow w8a8"); "atomflow"'s
    # also when every baseline was skipped.
    for ours in dict.fromkeys(["atomflow"] + [u.get("ours", "atomflow") for u in ups]) if result.get("baselines") else []:
        mine = [u for u in ups if u.get("ours", "atomflow") == ours]
        if ours != "atomflow" and not mine:
            continue
        tests = [t for t in dict.fromkeys(r["test"] for r in result["rows"] if r["engine"] == ours)]
        lines += [
            "",
            f"Speedup of {ours} (tg: baseline TPOT p50 / ours; pp: our prompt t/s / the baseline's)",
            "",
            "| baseline | " + " | ".join(tests) + " |",
            "|---|" + "---:|" * len(tests),
        ]
        for b in result["baselines"]:
            cells = []
            for t in tests:
                s = next((u for u in mine if u["baseline"] == b and u["test"] == t), None)
                cells.append(f"{s['speedup']:.2f}x" if s else "-")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recipes(rows: list[dict]) -> list[str]:
    """How each baseline ran: its recipe, then its compile times per test (compiles happen in
    untimed warm-up runs: decode at each cache length, prefill at each prompt length)."""
    out = []
    for engine in dict.fromkeys(r["engine"] for r in rows if r.get("recipe")):
        mine = [r for r in rows if r["engine"] == engine and r.get("recipe")]
        times = [
            f"{r['test']}: "
            + ", ".join(
                f"{what} {r[key]:.1f} s"
                for what, key in (("decode", "compile_s"), ("prefill", "prefill_compile_s"))
                if r.get(key) is not None
            )
            for r in mine
            if r.get("compile_s") is not None or r.get("prefill_compile_s") is not None
        ]
        out.append(
            f"- {engine}: {mine[0]['recipe']}"
            + (f". Compile (untimed warm-up, compiles included): {'; '.join(times)}" if times else "")
        )
    return ["", "How each baseline ran:", "", *out] if out else []


def to_csv(result: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    mine = [u for u in result.get("speedups") or [] if u.get("ours", "atomflow") == "atomflow"]
    ups = {(u["baseline"], u["test"]): u["speedup"] for u in mine}
    for r in result["rows"]:
        w.writerow(
            {
                **{k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS},
                "speedup": ups.get((r["engine"], r["test"]), ""),
                "gpu": _gpu(result),
                "read_bandwidth_gbs": result.get("read_bandwidth_gbs") or "",
                "commit": result.get("commit"),
            }
        )
    return buf.getvalue()
