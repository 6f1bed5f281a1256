"""Where a decode step's time goes, kernel by kernel, as the GPU really runs it (CUDA graph, PDL
overlap included): the kernels of N graph-replayed decode steps are recorded through CUPTI (by
torch.profiler, the one CUPTI client on our machines; the engine itself runs without torch), and
each kernel is charged the time by which it moved the step's finish line:

    charged_i = max(0, end_i - max(end_j for j < i))       (kernels in start order)

so the charges of one step add up to the step's span exactly, whatever overlaps. Also shown: the
kernel's own duration (start to end, PDL wait included) and the gap from the previous kernel's end
to its start (negative: it started early under PDL).

With --verify K each step is a speculative verify of K + 1 rows instead (the backend's verify(): the
small-M chunk, its attention rows, the head once for every row, greedy tokens on the device), rolled
back after it, on an engine loaded for speculation (as speculative decoding runs);
the small-M GEMV's launches are named by their place in the layer (qkv, o, gate_up, down; the last
odd one the head). With --prefill N each step is a prompt of N tokens from an empty cache
(Engine.prefill, as `atomflow bench`'s ppN runs it, the host's launches included); the skinny GEMM's
launches are named by their epilogue (qkv+rope, o / down, gate_up).

    python tools/timeline.py MODEL [--steps 16] [--context 128] [--max-context N] [--verify K | --prefill N]
        [--option NAME=0|1 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import numpy as np

# gemv_w8a16_kernel<Ep, In, whole, tail, bias>: Ep 0 Store, 1 AddResidual, 2 SwiGLU, 3 RopeKV; In 2 = fused
# RMSNorm; whole: K a multiple of 512 (the variant without the clamp at a row's end); tail: K % 128 == 64;
# bias: RopeKV with Qwen2's q/k/v biases.
GEMV = re.compile(
    r"gemv_w8a16_kernel<\(atomflow::kernels::Ep\)(\d), \(atomflow::kernels::In\)(\d)"
    r"(?:, (?:true|false))*>"
)


def label(name: str, seen_add: int) -> str:
    m = GEMV.search(name)
    if m:
        ep, inp = int(m.group(1)), int(m.group(2))
        return {
            3: "gemv qkv+norm+rope",
            2: "gemv gate_up+norm",
            0: "lm_head" if inp == 2 else "gemv store",
            1: "gemv o" if seen_add % 2 == 0 else "gemv down",
        }[ep]
    short = re.sub(r"^void |\(.*$|<.*$", "", name.replace("(anonymous namespace)::", "")).split("::")[-1]
    return short


GEMV_M_PRODUCTS = ("gemv_m qkv", "gemv_m o", "gemv_m gate_up", "gemv_m down")
# gemm_skinny_kernel<NT, Epilogue, ...>: Epilogue 0 Store, 1 AddResidual (o, then down), 2 SwiGLU, 3 RopeKV.
SKINNY = re.compile(r"gemm_skinny_kernel<\d+, \(atomflow::kernels::Epilogue\)(\d)")


def charge(kernels: list[tuple[float, float, str]]) -> list[dict]:
    """kernels: (start_us, end_us, name) of one step -> rows with label, charged, duration, gap."""
    rows, frontier, prev_end, adds = [], None, None, 0
    n_m = sum("gemv_w8a16_m_kernel" in k[2] for k in kernels)
    seen_m = 0
    skinny_adds = 0
    for start, end, name in sorted(kernels):
        lab = label(name, adds)
        if lab in ("gemv o", "gemv down"):
            adds += 1
        m = SKINNY.search(name)
        if m:
            ep = int(m.group(1))
            lab = {0: "skinny store", 1: "skinny o" if skinny_adds % 2 == 0 else "skinny down", 2: "skinny gate_up"}.get(
                ep, "skinny qkv+rope"
            )
            skinny_adds += ep == 1
        if "gemv_w8a16_m_kernel" in name:  # a layer's four products in order; an odd last one is the head
            lab = "gemv_m head" if n_m % 4 == 1 and seen_m == n_m - 1 else GEMV_M_PRODUCTS[seen_m % 4]
            seen_m += 1
        charged = end - start if frontier is None else max(0.0, end - frontier)
        gap = 0.0 if prev_end is None else start - prev_end
        rows.append(dict(label=lab, charged=charged, duration=end - start, gap=gap))
        frontier = end if frontier is None else max(frontier, end)
        prev_end = end
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="KV cache length (default: just what the steps need; `atomflow run` uses 8192)",
    )
    ap.add_argument("--verify", type=int, default=0, metavar="K", help="time a verify of K + 1 rows, not a decode step")
    ap.add_argument("--prefill", type=int, default=0, metavar="N", help="time a prompt of N tokens, not a decode step")
    ap.add_argument("--json", help="also write the per-label table here")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=0|1",
        help="a step plan option (atomflow/backends/cuda.py PLAN_OPTIONS) for the engine timed, e.g. skinny_norm=0",
    )
    a = ap.parse_args(argv)
    if a.steps < 1 or a.context < 0 or a.verify < 0 or a.prefill < 0:
        ap.error("--steps must be >= 1, --context, --verify and --prefill >= 0")
    if a.prefill and a.verify:
        ap.error("--prefill and --verify time different steps: give one")
    if a.prefill:
        a.context = 0  # a prompt from an empty cache
    from atomflow.backends.cuda import plan_option

    plan = {}
    for o in a.option:
        try:
            plan.update([plan_option(o)])
        except ValueError as e:
            ap.error(str(e))
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("timeline: needs torch (its profiler records the kernels through CUPTI)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("timeline: no usable GPU", file=sys.stderr)
        return 2
    torch.cuda.init()

    from atomflow import Engine

    need = a.context + (a.verify + 1 if a.verify else a.prefill or a.steps) + 8
    if a.max_context is not None and a.max_context < need:
        ap.error(f"--max-context must be >= {need} (context + the steps' rows + 8)")
    extra = dict(speculate="ngram") if a.verify else {}
    eng = Engine.load(a.model, backend="cuda", max_context=a.max_context or need, plan=plan, **extra)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, eng.spec.vocab_size, a.context + 1).astype(np.int32)
    eng.reset()
    if a.context:
        eng.prefill(ids[: a.context])
    token = int(ids[a.context])
    if a.prefill:
        prompt = rng.integers(0, eng.spec.vocab_size, a.prefill).astype(np.int32)

        def step() -> None:
            eng.reset()
            eng.prefill(prompt)  # returns once the last row's logits are on the host
            time.sleep(0.002)  # an idle gap the split below finds: the host's launches may leave shorter ones
    elif a.verify:
        be = eng.backend
        if a.verify + 1 > be.verify_rows:
            ap.error(f"--verify: this engine verifies at most {be.verify_rows - 1} drafts")
        chunk = rng.integers(0, eng.spec.vocab_size, a.verify + 1).astype(np.int32)

        def step() -> None:
            be.verify(chunk)  # returns once the rows' tokens are on the host: steps never overlap
            be.rollback(a.context)
    else:

        def step() -> None:
            nonlocal token
            token = int(np.argmax(eng.decode(token)))  # each step waited for: steps never overlap

    for _ in range(3):  # warm-up: graph capture, module loading
        step()

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
    events = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()
    ]
    if not events:
        print("timeline: the profiler recorded no kernels (CUPTI unavailable?)", file=sys.stderr)
        return 1
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    # Split into steps where the GPU went idle: the host waits for each step before the next.
    idle_us = 1000.0 if a.prefill else 20.0
    steps, cur = [], []
    for k in kernels:
        if cur and k[0] - max(c[1] for c in cur) > idle_us:
            steps.append(cur)
            cur = []
        cur.append(k)
    steps.append(cur)
    steps = [s for s in steps if len(s) > 1]

    spans = [max(k[1] for k in s) - min(k[0] for k in s) for s in steps]
    per: dict[str, dict[str, list[float]]] = {}
    for s in steps:
        step_sum: dict[str, dict[str, float]] = {}
        for r in charge(s):
            d = step_sum.setdefault(r["label"], dict(n=0, charged=0.0, duration=0.0, gap=0.0))
            d["n"] += 1
            for key in ("charged", "duration", "gap"):
                d[key] += r[key]
        for lab, d in step_sum.items():
            p = per.setdefault(lab, dict(n=[], charged=[], duration=[], gap=[]))
            for key in d:
                p[key].append(d[key])
    span = statistics.median(spans)
    table = []
    for lab, p in per.items():
        n = statistics.median(p["n"])
        table.append(
            dict(
                label=lab,
                per_step=n,
                charged_us=statistics.median(p["charged"]),
                charged_each_us=statistics.median(p["charged"]) / n,
                duration_each_us=statistics.median(p["duration"]) / n,
                gap_each_us=statistics.median(p["gap"]) / n,
            )
        )
    table.sort(key=lambda r: -r["charged_us"])
    what = (
        f"prompts of {a.prefill} tokens"
        if a.prefill
        else f"graph verify steps of {a.verify + 1} rows"
        if a.verify
        else "graph decode steps"
    )
    print(f"timeline: {len(steps)} {what} at context {a.context} (max_context {eng.max_context}), step span p50 {span:.1f} us")
    print(f"{'kernel':<24}{'per step':>9}{'charged us':>12}{'share':>8}{'each us':>9}{'own us':>8}{'gap us':>8}")
    for r in table:
        print(
            f"{r['label']:<24}{r['per_step']:>9.0f}{r['charged_us']:>12.1f}{100 * r['charged_us'] / span:>7.1f}%"
            f"{r['charged_each_us']:>9.2f}{r['duration_each_us']:>8.2f}{r['gap_each_us']:>8.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(step_span_us=span, steps=len(steps), context=a.context, kernels=table), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
