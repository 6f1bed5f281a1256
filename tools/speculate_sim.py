"""Speculation policies replayed on recorded greedy output, with a cost model: the real loop
(atomflow/speculate.py: drafter, adaptive k, pause rule) against a backend that answers from each
prompt's recorded greedy tokens, on a clock that advances by the modelled step and verify times. The
drafts a policy makes and how many the model confirms depend only on the greedy sequence, so a
policy's acceptance is exact and its speedup as good as the cost model; a GPU run
(tools/speculate_bench.py) checks the prediction.

    python tools/speculate_sim.py [MODEL] [--greedy FILE] [-n 128] [--step-ms 0.635] \\
        [--verify-ms 0.70,0.065 | --costs-from BENCH.json] [--config "n_min=1,min_accept=0.6"] ...

The greedy tokens of tools/speculate_prompts.json are generated once on the CPU backend (exact) and
kept in --greedy (default: next to the model, MODEL.greedy-N.json). --verify-ms A,B models a verify
step of k drafts as A + B k ms, --verify-table T1,T2,... as T_k ms (k = 1, 2, ...: `tools/verify_cost.py`'s
column), --step-ms a plain pipelined step; --costs-from fits the first two to a `speculate_bench.py --json`
run. Each --config is a SpecConfig (its keyword arguments); the defaults always run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import atomflow.speculate as speculate  # noqa: E402
from atomflow.speculate import SpecConfig, SpecStats, speculative_ids, with_keywords  # noqa: E402


class Clock:
    """Stands in for the time module inside atomflow.speculate: perf_counter() is the modelled time."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Replay:
    """The backend interface speculative_ids uses, answering from one prompt's recorded greedy tokens:
    a verify row's greedy token is the recorded one while the rows before it follow the recording (the
    loop reads no row past the first rejected draft); every call advances the clock by its model. runs and
    verifies log each run of plain steps' length and each verify's rows."""

    verify_rows = speculate.MAX_ROWS

    def __init__(self, prompt: list[int], output: list[int], clock: Clock, step_s: float, verify_s):
        self.seq = list(prompt) + list(output)
        self.n = len(prompt)
        self.max_context = len(self.seq) + 1
        self.clock, self.step_s, self.verify_s = clock, step_s, verify_s
        self.call_s = 0.0
        self.runs: list[int] = []
        self.verifies: list[int] = []
        self.position = 0
        self._run = None

    def spec_prefill(self, ids, start):
        self.position = self.n
        return self.seq[self.n]

    def verify(self, ids) -> np.ndarray:
        pos, rows = self.position, [int(t) for t in ids]
        self.verifies.append(len(rows))
        out = np.zeros(len(rows), np.int32)
        for i in range(len(rows)):
            out[i] = self.seq[pos + i + 1] if pos + i + 1 < len(self.seq) else 0
            if pos + i + 1 >= len(self.seq) or rows[i] != self.seq[pos + i]:
                break  # later rows follow a rejected draft: never read
        self.position = pos + len(rows)
        self.clock.now += self.verify_s(len(rows) - 1)
        return out

    def steps(self, token: int, n: int):
        self.runs.append(n)
        self.clock.now += self.call_s  # a run of plain steps waits for its last one: not pipelined across runs
        for _ in range(n):
            self.clock.now += self.step_s
            self.position += 1
            yield self.seq[self.position]

    def rollback(self, position: int) -> None:
        self.position = position

    def hold(self, keep: int):
        self._run = object()
        return self._run

    def hold_of(self):
        return self._run


def replay(item: dict, cfg: SpecConfig, step_ms: float, verify_ms, call_ms: float = 0.0) -> dict:
    """verify_ms: (A, B), a verify of k drafts A + B k ms, or a list, the k-th its time."""
    clock = Clock()
    if isinstance(verify_ms, list):
        table = verify_ms
        cost = lambda k: table[min(k, len(table)) - 1] / 1e3  # noqa: E731
    else:
        a, b = verify_ms
        cost = lambda k: (a + b * k) / 1e3  # noqa: E731
    be = Replay(item["prompt"], item["output"], clock, step_ms / 1e3, cost)
    be.call_s = call_ms / 1e3
    stats = SpecStats()
    saved, speculate.time = speculate.time, clock
    try:
        got = list(speculative_ids(be, np.asarray(item["prompt"], np.int32), len(item["output"]), 0, cfg, stats))
    finally:
        speculate.time = saved
    assert got == item["output"], "the replayed loop must yield the recorded tokens"
    plain_ms = (len(got) - 1) * step_ms  # the plain run: one step per token after the first
    return dict(stats=stats, speedup=plain_ms / (1e3 * clock.now))


def record(model: str, path: Path, n: int) -> list[dict]:
    from speculate_bench import PROMPTS, encode

    from atomflow import Engine, SamplingParams

    eng = Engine.load(model, backend="cpu", max_context=2048)
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    out = []
    for kind, items in prompts.items():
        for i, item in enumerate(items):
            ids = encode(eng, item)
            toks = list(eng.generate_tokens(ids, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)))
            out.append(dict(kind=kind, i=i, prompt=[int(t) for t in ids], output=[int(t) for t in toks]))
            print(f"recorded {kind}[{i}]: {len(ids)} prompt tokens, {len(toks)} greedy", file=sys.stderr, flush=True)
    path.write_text(json.dumps(dict(model=str(model), max_new_tokens=n, runs=out)))
    return out


def costs_from_bench(path: str) -> tuple[float, tuple[float, float]]:
    """(step ms, (A, B)) from a `speculate_bench.py --json` file: a plain step = 1 / the mean plain
    tokens/s; a verify of k drafts = A + B k, least squares over the prompts' (drafts per verify step,
    verify ms); B = 0 when the drafts per step hardly vary."""
    runs = json.loads(Path(path).read_text())["runs"]
    step_ms = 1e3 / float(np.mean([r["plain_tps"] for r in runs]))
    pts = [(r["drafted"] / r["verify_steps"], r["verify_ms"]) for r in runs if r.get("verify_steps")]
    if not pts:
        raise ValueError(f"{path}: no run made a verify step")
    k, ms = np.array(pts).T
    if np.ptp(k) < 0.5:
        return step_ms, (float(ms.mean()), 0.0)
    b, a = np.polyfit(k, ms, 1)
    return step_ms, (float(a), float(b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a .atomflow file (default: the default model)")
    ap.add_argument("--greedy", default=None, help="recorded greedy tokens (made on the CPU backend if missing)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=0.635, help="a plain step (default: SmolLM2, H100)")
    ap.add_argument("--verify-ms", default="0.70,0.065", help="A,B: a verify of k drafts costs A + B k ms")
    ap.add_argument("--verify-table", default=None, help="T1,T2,...: a verify of k drafts costs T_k ms")
    ap.add_argument("--call-ms", type=float, default=0.0, help="what a run of plain steps adds to its steps (its wait)")
    ap.add_argument("--config", action="append", default=[], help="SpecConfig keywords, e.g. n_min=1,min_accept=0.6")
    ap.add_argument("--costs-from", default=None, help="fit --step-ms and --verify-ms to a speculate_bench --json file")
    a = ap.parse_args(argv)
    try:
        verify_ms = tuple(float(x) for x in a.verify_ms.split(","))
        if len(verify_ms) != 2 or a.step_ms <= 0:
            raise ValueError
        configs = [SpecConfig()] + [with_keywords(SpecConfig(), c) for c in a.config]
        if a.costs_from:
            a.step_ms, verify_ms = costs_from_bench(a.costs_from)
        if a.verify_table:
            verify_ms = [float(x) for x in a.verify_table.split(",")]
            if not verify_ms or min(verify_ms) <= 0:
                raise ValueError("--verify-table needs positive times")
    except (ValueError, TypeError, KeyError, OSError) as e:
        ap.error(f"bad --verify-ms, --step-ms, --config or --costs-from: {e}")
    if a.model is None:
        from atomflow.model.default import default_model

        a.model = str(default_model())
    path = Path(a.greedy) if a.greedy else Path(f"{a.model}.greedy-{a.max_new_tokens}.json")
    if path.exists():
        runs = json.loads(path.read_text())["runs"]
    else:
        runs = record(a.model, path, a.max_new_tokens)
    model = (
        "table " + " ".join(f"{t:.3f}" for t in verify_ms)
        if isinstance(verify_ms, list)
        else f"{verify_ms[0]:.3f} + {verify_ms[1]:.3f} k"
    )
    print(f"{path.name}: {len(runs)} prompts | step {a.step_ms:.3f} ms, verify {model} ms")
    print("| config | kind | acceptance | tokens/step | pauses | predicted speedup |")
    print("|---|---|---:|---:|---:|---:|")
    for cfg in configs:
        label = ", ".join(f"{k}={getattr(cfg, k)}" for k in ("k_max", "n_min", "n_max", "min_accept", "pause_tokens"))
        for kind in dict.fromkeys(r["kind"] for r in runs):
            res = [replay(r, cfg, a.step_ms, verify_ms, a.call_ms) for r in runs if r["kind"] == kind]
            st = SpecStats.total([x["stats"] for x in res])
            speed = float(np.mean([x["speedup"] for x in res]))
            print(f"| {label} | {kind} | {st.acceptance:.0%} | {st.tokens_per_step:.2f} | {st.pauses} | {speed:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
