"""One `atomflow bench` result: a plain dict (JSON as is) holding every sample, and the rows the
report renders. A row is one (engine, test): our engine or a baseline, ok or skipped.

Row fields: engine, test, kind, n_prompt, n_gen, depth, status ("ok" | "skipped"), reason,
tokens_per_s_avg/std (over repetitions), tpot_ms_p50/p90/p99 (pooled over every gap of every
repetition; None for pp), ttft_ms (pp only: prefill + first token, mean), bytes_per_token,
achieved_gbs (bytes / p50 TPOT, or bytes x tokens/s for pp), efficiency (achieved / read
bandwidth), samples {tokens_per_s: [...], tpot_ms: [[...] per repetition], ttft_ms: [...]}.
"""

from __future__ import annotations

import math

import numpy as np

from atomflow.bench.plan import BenchTest

SCHEMA = "atomflow-bench-1"


def _f(x) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def measured_row(
    engine: str,
    test: BenchTest,
    tokens_per_s: list[float],
    tpot_ms: list[list[float]] | None = None,
    ttft_ms: list[float] | None = None,
    bytes_per_token: float | None = None,
    bandwidth_gbs: float | None = None,
    **extra,
) -> dict:
    """A measured row. tokens_per_s: one value per repetition; tpot_ms: each repetition's gaps
    between consecutive tokens (tg); ttft_ms: one per repetition (pp)."""
    tps = np.asarray(tokens_per_s, dtype=np.float64)
    row = _base(engine, test, "ok", None)
    row.update(tokens_per_s_avg=_f(tps.mean()), tokens_per_s_std=_f(tps.std(ddof=1) if len(tps) > 1 else 0.0))
    gaps = np.concatenate([np.asarray(g, dtype=np.float64) for g in tpot_ms]) if tpot_ms else np.empty(0)
    if gaps.size:
        p50, p90, p99 = np.percentile(gaps, [50, 90, 99])
        row.update(tpot_ms_p50=_f(p50), tpot_ms_p90=_f(p90), tpot_ms_p99=_f(p99))
    if ttft_ms:
        row["ttft_ms"] = _f(np.mean(ttft_ms))
    if bytes_per_token:
        row["bytes_per_token"] = float(bytes_per_token)
        per_s = 1e3 / row["tpot_ms_p50"] if row["tpot_ms_p50"] else row["tokens_per_s_avg"]
        row["achieved_gbs"] = _f(bytes_per_token * per_s / 1e9)
        if bandwidth_gbs and row["achieved_gbs"] is not None:
            row["efficiency"] = row["achieved_gbs"] / bandwidth_gbs
    row["samples"] = dict(
        tokens_per_s=[float(x) for x in tps],
        tpot_ms=[[float(x) for x in g] for g in (tpot_ms or [])],
        ttft_ms=[float(x) for x in (ttft_ms or [])],
    )
    row.update(extra)
    return row


def skipped_row(engine: str, test: BenchTest | None, reason: str) -> dict:
    """A baseline (test=None: all of it) or one of its tests that could not run, and why."""
    return _base(engine, test, "skipped", reason)


def _base(engine: str, test: BenchTest | None, status: str, reason: str | None) -> dict:
    return dict(
        engine=engine,
        test=test.name if test else "-",
        kind=test.kind if test else None,
        n_prompt=test.n_prompt if test else None,
        n_gen=test.n_gen if test else None,
        depth=test.depth if test else None,
        status=status,
        reason=reason,
        tokens_per_s_avg=None,
        tokens_per_s_std=None,
        tpot_ms_p50=None,
        tpot_ms_p90=None,
        tpot_ms_p99=None,
        ttft_ms=None,
        bytes_per_token=None,
        achieved_gbs=None,
        efficiency=None,
    )


OURS = "atomflow"  # our engines: "atomflow", and "atomflow <variant>" (--speculate, --prefill-fp8)


def is_ours(engine: str) -> bool:
    return engine == OURS or engine.startswith(OURS + " ")


def speedups(rows: list[dict], ours: str = OURS) -> list[dict]:
    """The speedup of our engine `ours` over each baseline on each test both ran: baseline TPOT p50 /
    ours for tg, our prompt tokens/s / the baseline's for pp. Our other engines are never baselines."""
    mine = {r["test"]: r for r in rows if r["engine"] == ours and r["status"] == "ok"}
    out = []
    for r in rows:
        m = mine.get(r["test"])
        if is_ours(r["engine"]) or r["status"] != "ok" or m is None:
            continue
        if r["kind"] == "tg" and r["tpot_ms_p50"] and m["tpot_ms_p50"]:
            speedup = r["tpot_ms_p50"] / m["tpot_ms_p50"]
            out.append(dict(ours=ours, baseline=r["engine"], test=r["test"], metric="tpot_p50", speedup=speedup))
        elif r["kind"] == "pp" and r["tokens_per_s_avg"] and m["tokens_per_s_avg"]:
            out.append(
                dict(
                    ours=ours,
                    baseline=r["engine"],
                    test=r["test"],
                    metric="prompt_tokens_per_s",
                    speedup=m["tokens_per_s_avg"] / r["tokens_per_s_avg"],
                )
            )
    return out
