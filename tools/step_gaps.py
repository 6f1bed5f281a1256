"""Where a token's time goes on the device in the pipelined generate path: greedy tokens generated under
torch's profiler (the CUDA profiling interface records every kernel a replayed graph runs), cut into
decode steps at the kernel that ends each (the sampler; `finish_step` where the plan ends steps apart),
and per step: the span from its first kernel's start to its last kernel's end, and the gap from the
previous step's end to its first kernel (the boundary between two graph launches: no programmatic
launch crosses it). Next to them, the host-observed interval between tokens of the same run (what
`atomflow bench` reports as TPOT). Span + gap ~ the host-observed TPOT when the host keeps ahead; a
difference between two builds shows up in one or the other. Needs torch (a tool, never the engine).

    python tools/step_gaps.py MODEL [-n 128] [--context 128] [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

import numpy as np

STEP_END = [r"finish_step", r"sample_kernel"]  # the first that occurs in the trace ends each step


def kernels_of(trace_path: str) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel in a chrome trace, by start."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    out = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "")))
        for e in events
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"
    ]
    return sorted(out)


def steps_of(kernels: list[tuple[float, float, str]]) -> list[dict]:
    """Steps between consecutive step-ending kernels; the part before the first one (the prompt's
    prefill and its first token) is dropped."""
    pattern = next((p for p in STEP_END if any(re.search(p, k[2]) for k in kernels)), None)
    if pattern is None:
        return []
    ends = [i for i, k in enumerate(kernels) if re.search(pattern, k[2])]
    out = []
    for prev, end in zip(ends, ends[1:]):
        first = prev + 1
        if first > end:
            continue
        out.append(
            dict(
                span_us=kernels[end][1] - kernels[first][0],
                gap_us=kernels[first][0] - kernels[prev][1],
                kernels=end - first + 1,
                first=first,
            )
        )
    return out


def slots_of(kernels: list[tuple[float, float, str]], steps: list[dict]) -> list[dict]:
    """Per kernel slot of a step (steps of the most common kernel count): its name, and the medians over
    steps of its start after the step's first kernel's start and of its duration; where two builds
    part, the slot whose start moves first is the kernel boundary that changed."""
    n = int(np.median([s["kernels"] for s in steps]))
    same = [s for s in steps if s["kernels"] == n]
    out = []
    for j in range(n):
        ks = [kernels[s["first"] + j] for s in same]
        t0 = [kernels[s["first"]][0] for s in same]
        out.append(
            dict(
                name=ks[0][2][:80],
                start_us=float(np.median([k[0] - t for k, t in zip(ks, t0)])),
                dur_us=float(np.median([k[1] - k[0] for k in ks])),
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-n", "--tokens", type=int, default=128, help="tokens generated (default 128)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before them (default 128)")
    ap.add_argument("--rounds", type=int, default=5, help="unprofiled runs timed before the profiled one (default 5)")
    ap.add_argument("--json", help="also write the per-step rows and the per-kernel slots here")
    a = ap.parse_args(argv)
    if a.tokens < 3 or a.context < 1 or a.rounds < 1:
        ap.error("-n must be >= 3, --context >= 1 and --rounds >= 1")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from atomflow import Engine, SamplingParams

    torch.zeros(1, device="cuda")  # the primary context, shared with the engine
    eng = Engine.load(a.model, backend="cuda", max_context=a.context + a.tokens + 8)
    ids = np.random.default_rng(0).integers(0, eng.spec.vocab_size, a.context).astype(np.int32)
    params = SamplingParams(temperature=0, max_new_tokens=a.tokens, ignore_eos=True)
    list(eng.generate_tokens(ids, params))  # warm
    free = []  # the same run without the profiler: what it perturbs shows as a difference
    for _ in range(a.rounds):
        t = [time.perf_counter() for _ in eng.generate_tokens(ids, params)]
        free.append(np.median(np.diff(t)[1:]))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stamps = [time.perf_counter() for _ in eng.generate_tokens(ids, params)]
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        kernels = kernels_of(path)
        steps = steps_of(kernels)
    if not steps:
        print("step_gaps: no step-ending kernel in the trace (is this the CUDA backend?)", file=sys.stderr)
        return 1
    host = 1e3 * np.diff(stamps)[1:]  # the first interval includes the first decode step's launch
    span = np.array([s["span_us"] for s in steps])
    gap = np.array([s["gap_us"] for s in steps])
    print(f"{eng.model.path.name}: {len(steps)} decode steps of {int(np.median([s['kernels'] for s in steps]))} kernels")
    print(f"  span      p50 {np.median(span):8.1f} us   p90 {np.percentile(span, 90):8.1f}")
    print(f"  gap       p50 {np.median(gap):8.1f} us   p90 {np.percentile(gap, 90):8.1f}")
    print(f"  span+gap  p50 {np.median(span + gap):8.1f} us")
    print(f"  host TPOT p50 {1e3 * np.median(host):8.1f} us (profiled run)")
    print(f"  host TPOT p50 {1e6 * np.median(free):8.1f} us (without the profiler, median of {a.rounds} runs)")
    if a.json:
        with open(a.json, "w") as f:
            rows = dict(model=str(eng.model.path), steps=steps, slots=slots_of(kernels, steps), host_tpot_ms=host.tolist())
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
