"""Decode steps for Nsight (scripts/profile.sh): load, fill the cache, warm up, then run the steps
inside a cudaProfilerStart/Stop range, so ncu (--profile-from-start off) and nsys
(--capture-range=cudaProfilerApi) record only them.

    python tools/profile_steps.py MODEL [--steps N] [--context N] [--eager] [--mode decode|generate]

decode:   N single decode steps (Engine.decode: one graph replay each, or the eager launches with
          --eager, which ncu and the per-layer NVTX ranges want), each waited for.
generate: one pipelined generation of N tokens from a --context-token prompt, as `atomflow run`
          does it (its prefill is inside the range too: the timeline shows TTFT as well).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--mode", choices=["decode", "generate"], default="decode")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.context < 0:
        ap.error("--steps must be >= 1 and --context >= 0")

    from atomflow import Engine, SamplingParams, _core

    eng = Engine.load(a.model, backend="cuda", max_context=a.context + a.steps + 8, eager=a.eager or None)
    ids = np.random.default_rng(0).integers(0, eng.spec.vocab_size, a.context + 1).astype(np.int32)
    params = SamplingParams(temperature=0.0, max_new_tokens=a.steps, ignore_eos=True)

    def fill() -> None:
        eng.reset()
        if a.context:
            eng.prefill(ids[: a.context])

    fill()
    for _ in range(2):  # warm-up: module loading and first-touch costs stay out of the range
        eng.decode(int(ids[a.context]))
    fill()
    _core.profiler_start()
    if a.mode == "decode":
        token = int(ids[a.context])
        for _ in range(a.steps):
            token = int(np.argmax(eng.decode(token)))
    else:
        n = sum(1 for _ in eng.generate_tokens(ids, params))
        assert n == a.steps, n
    _core.profiler_stop()
    print(
        f"profile_steps: {a.steps} {a.mode} steps at context {a.context} "
        f"({'eager' if a.eager else 'graph'}) on {eng.backend_name}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
