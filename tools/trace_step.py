"""Inside one graph decode step: when each GEMV warp and attention block of a layer reached its
events, and how fast weight bytes arrived, from the in-kernel trace (include/atomflow/trace.cuh).

Needs a trace build (`ATOMFLOW_TRACE=ON pip install --no-build-isolation --no-deps -e .`): the
kernels stamp %globaltimer at entry, past the PDL wait, once the input is staged, after each weight
iteration is summed (GEMV) or the key loop is done (attention, which also stamps when its cached rows
are issued, its partial written, its ticket taken and its merge written), and at exit. A weight iteration is 8 KB
(two rows x 4096 columns, less at a row's end); its stamp comes after its math, so the rate below
is the rate at which the warps finished summing bytes, a few hundred ns behind their arrival.
The staging of x is split further (input landed in the block, reduction done, x converted): see
trace.cuh.

    python tools/trace_step.py MODEL [--context 128] [--steps 4] [--pipelined] [--save trace.npz]
    python tools/trace_step.py --load trace.npz [--layer 13] [--bin 0.25]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from numpy.lib import recfunctions as rfn

REC = np.dtype(
    [
        ("id", "<u8"),
        ("kind", "<u4"),
        ("block", "<u4"),
        ("warp", "<u4"),
        ("smid", "<u4"),
        ("K", "<u4"),
        ("n", "<u4"),
        ("t", "<u8", (16,)),
    ]
)
assert REC.itemsize == 160
ENTRY, LANDED, WAITED, STAGED, ITER0, BARRIER, REDUCED, CONVERTED, ITERLAST, EXIT = 0, 1, 2, 3, 4, 10, 11, 12, 13, 15
ITER_SLOTS = BARRIER - ITER0  # iterations with a slot of their own; the later ones share ITERLAST
A_ENTRY, A_ISSUED, A_WAITED, A_LOOP, A_PARTIAL, A_TICKET, A_MERGED = range(7)
GEMV_NAMES = {(3, 2): "qkv", (1, 1): "o|down", (2, 2): "gate_up", (1, 0): "o|down", (0, 2): "lm_head"}


def _ready(model: str, context: int, max_context: int):
    """(engine, ops, the next token) with `context` random tokens prefilled, or exit without a trace build."""
    from atomflow import Engine
    from atomflow._core import ops

    if not ops.trace_built():
        sys.exit("trace_step: this build has no trace; reinstall with ATOMFLOW_TRACE=ON")
    eng = Engine.load(model, backend="cuda", max_context=max_context)
    ids = np.random.default_rng(0).integers(0, eng.spec.vocab_size, context + 1).astype(np.int32)
    eng.reset()
    if context:
        eng.prefill(ids[:context])
    return eng, ops, int(ids[context])


def record(model: str, context: int, steps: int, per_sm: int) -> tuple[np.ndarray, list[int]]:
    """Records of `steps` graph decode steps (each a separate reset + read), step number in `step`."""
    eng, ops, token = _ready(model, context, context + steps + 16)
    for _ in range(3):  # warm-up
        token = int(np.argmax(eng.decode(token)))
    ops.trace_arm(per_sm)
    out, dropped = [], []
    for _s in range(steps):
        ops.trace_reset()
        token = int(np.argmax(eng.decode(token)))
        raw, d = ops.trace_read()
        recs = np.frombuffer(raw, dtype=REC).copy()
        out.append(recs)
        dropped.append(int(d))
    ops.trace_arm(0)
    return np.concatenate([rfn.append_fields(r, "step", np.full(len(r), i), usemask=False) for i, r in enumerate(out)]), dropped


def record_pipelined(model: str, context: int, steps: int, per_sm: int) -> tuple[np.ndarray, list[int]]:
    """Records of `steps` graph decode steps enqueued back to back, as generate runs them (no host gap
    between one step's end and the next one's start), in one trace; split_steps numbers them."""
    eng, ops, token = _ready(model, context, context + steps + 16)
    core = eng.backend.engine
    core.begin(token)
    core.enqueue(3)  # warm-up
    core.wait(3)
    ops.trace_arm(per_sm * steps)
    ops.trace_reset()
    core.enqueue(steps)
    core.wait(steps)
    raw, d = ops.trace_read()
    ops.trace_arm(0)
    return split_steps(np.frombuffer(raw, dtype=REC).copy()), [int(d)]


def split_steps(recs: np.ndarray, gap_ns: int = 100_000) -> np.ndarray:
    """recs of consecutive decode steps, each numbered (field `step`) by the step whose first QKV
    launch (the first layer's weights) entered last before it: that launch's blocks enter within a
    few us, and a step takes a millisecond and more."""
    qkv = ((recs["kind"] & 0x100) == 0) & ((recs["kind"] & 0xF) == 3)
    t0 = recs["t"][:, ENTRY].astype(np.int64)
    first = recs["id"][qkv][np.argmin(t0[qkv])]
    e = np.sort(t0[qkv & (recs["id"] == first)])
    starts = e[np.r_[True, np.diff(e) > gap_ns]]
    step = np.searchsorted(starts, t0, side="right") - 1
    keep = step >= 0
    return rfn.append_fields(recs[keep], "step", step[keep], usemask=False)


def launches(recs: np.ndarray) -> list[dict]:
    """Groups one step's records by launch (same kind family and id), in order of first entry."""
    attn = (recs["kind"] & 0x100) != 0
    keys = np.where(attn, recs["id"] ^ np.uint64(1 << 63), recs["id"])
    out = []
    for key in np.unique(keys):
        r = recs[keys == key]
        t = r["t"].astype(np.int64)
        is_attn = bool(r["kind"][0] & 0x100)
        if is_attn:
            name = "attention"
        else:
            ep, inp = int(r["kind"][0] & 0xF), int(r["kind"][0] >> 4)
            name = GEMV_NAMES.get((ep, inp), f"gemv{ep}/{inp}")
        out.append(dict(name=name, attn=is_attn, recs=r, t=t, first=int(t[:, 0].min())))
    out.sort(key=lambda d: d["first"])
    adds = 0  # o and down share a kernel: o comes first in a layer
    for d in out:
        if d["name"] == "o|down":
            d["name"] = "o" if adds % 2 == 0 else "down"
            adds += 1
    return out


def weight_events(l: dict) -> tuple[np.ndarray, np.ndarray]:
    """(time, bytes) of every weight iteration summed in a GEMV launch."""
    times, sizes = [], []
    for rec, t in zip(l["recs"], l["t"]):
        K, n = int(rec["K"]), int(rec["n"])
        per_pair = -(-K // 4096)
        for i in range(n):
            j = i % per_pair
            b = 2 * min(4096, K - 4096 * j)
            if i < ITER_SLOTS:
                times.append(t[ITER0 + i])
                sizes.append(b)
            elif i == n - 1:  # the later ones share ITERLAST (the last): spread from the last own slot
                k = n - ITER_SLOTS
                last_own = t[ITER0 + ITER_SLOTS - 1]
                for q in range(k):
                    times.append(last_own + (t[ITERLAST] - last_own) * (q + 1) // k)
                    sizes.append(b)
    return np.asarray(times, dtype=np.int64), np.asarray(sizes, dtype=np.int64)


def summarize(step: list[dict], t0: int) -> list[dict]:
    rows = []
    us = lambda v: (v - t0) / 1e3  # noqa: E731
    for l in step:
        t = l["t"]
        if l["attn"]:
            merged = (l["recs"]["kind"] & 0x10) != 0
            rows.append(
                dict(
                    name=l["name"],
                    n=len(t),
                    entry=us(t[:, A_ENTRY].min()),
                    waited=us(np.median(t[:, A_WAITED])),
                    waited_last=us(t[:, A_WAITED].max()),
                    landed=us(np.median(t[:, A_PARTIAL])),
                    staged=us(np.median(t[:, A_LOOP])),
                    done=us(t[merged, A_MERGED].max()) if merged.any() else float("nan"),
                    exit=us(np.max(np.where(merged, t[:, A_MERGED], t[:, A_TICKET]))),
                )
            )
        else:
            rows.append(
                dict(
                    name=l["name"],
                    n=len(t),
                    entry=us(t[:, ENTRY].min()),
                    waited=us(np.median(t[:, WAITED])),
                    waited_last=us(t[:, WAITED].max()),
                    landed=us(np.median(t[:, LANDED])),
                    staged=us(np.median(t[:, STAGED])),
                    done=us(np.median(t[:, EXIT])),
                    exit=us(t[:, EXIT].max()),
                )
            )
    return rows


COLS = ("entry", "waited", "waited_last", "landed", "staged", "done", "exit")
A_PHASES = (
    ("entry>issued", A_ENTRY, A_ISSUED),
    ("issued>waited", A_ISSUED, A_WAITED),
    ("waited>loop", A_WAITED, A_LOOP),
    ("loop>partial", A_LOOP, A_PARTIAL),
    ("partial>ticket", A_PARTIAL, A_TICKET),
    ("ticket>merged", A_TICKET, A_MERGED),
)


def inner_layers(all_steps: list[list[dict]]):
    """(the launches of layer li, the next layer's first entry) for the inner layers 1 .. n - 2 of
    every step: a layer starts at its qkv launch."""
    for st in all_steps:
        q = [i for i, l in enumerate(st) if l["name"] == "qkv"]
        for li in range(1, len(q) - 1):
            yield st[q[li] : q[li + 1]], st[q[li + 1]]["first"]


def attention_phases(all_steps: list[list[dict]]) -> dict[int, dict[str, float]]:
    """Median us of each phase of an active attention block (ticket>merged: the merging blocks only),
    by how many blocks of its launch shared its SM, over every attention launch of the steps."""
    per: dict[int, dict[str, list[float]]] = {}
    for st in all_steps:
        for l in st:
            if not l["attn"]:
                continue
            _, where, counts = np.unique(l["recs"]["smid"], return_inverse=True, return_counts=True)
            for t, on_sm in zip(l["t"], counts[where].tolist()):
                d = per.setdefault(on_sm, {name: [] for name, _, _ in A_PHASES})
                for name, a, b in A_PHASES:
                    if t[a] > 0 and t[b] > 0:  # a stamp never taken is 0: A_MERGED in blocks that only exit
                        d[name].append((t[b] - t[a]) / 1e3)
    return {k: {name: float(np.median(v)) if v else float("nan") for name, v in d.items()} for k, d in sorted(per.items())}


def exit_spread(all_steps: list[list[dict]]) -> dict[str, dict]:
    """Per GEMV of a layer: its warps' exits, us after the launch's median wait (p10, median, p90,
    max; medians over the inner layers' launches), and the median exit by row-pair iterations."""
    per: dict[str, dict] = {}
    for layer, _ in inner_layers(all_steps):
        for l in layer:
            if l["attn"]:
                continue
            t = l["t"]
            ex = (t[:, EXIT] - np.median(t[:, WAITED])) / 1e3
            d = per.setdefault(l["name"], {"q": [], "by_n": {}})
            d["q"].append(np.percentile(ex, [10, 50, 90, 100]))
            n = l["recs"]["n"]
            for k in np.unique(n).tolist():
                d["by_n"].setdefault(int(k), []).append(float(np.median(ex[n == k])))
    return {
        name: {
            "q": np.median(np.array(d["q"]), axis=0).tolist(),
            "by_n": {k: float(np.median(v)) for k, v in sorted(d["by_n"].items())},
        }
        for name, d in per.items()
    }


def layer_table(all_steps: list[list[dict]]) -> tuple[list[str], list[dict], float]:
    """Kernel names of a layer, each one's event times (us from the layer's first qkv entry; median
    over steps and the inner layers 1 .. n - 2), and the median layer span."""
    per: dict[int, dict[str, list[float]]] = {}
    names: list[str] = []
    spans = []
    for layer, next_first in inner_layers(all_steps):
        t0 = layer[0]["first"]
        rows = summarize(layer, t0)
        names = [r["name"] for r in rows]
        spans.append((next_first - t0) / 1e3)
        for k, r in enumerate(rows):
            for c in COLS:
                per.setdefault(k, {c: [] for c in COLS})[c].append(r[c])
    med = [{c: float(np.nanmedian(per[k][c])) for c in COLS} for k in range(len(names))]
    return names, med, float(np.median(spans)) if spans else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--pipelined",
        action="store_true",
        help="the steps back to back in one trace, as generate runs them (default: one decode() each)",
    )
    ap.add_argument("--per-sm", type=int, default=4096, help="records per SM region and step")
    ap.add_argument("--save", help="write the raw records here (.npz) for --load")
    ap.add_argument("--load", help="analyze saved records instead of running a model")
    ap.add_argument("--layer", type=int, default=None, help="layer to draw (default: the middle one)")
    ap.add_argument("--bin", type=float, default=0.25, help="us per bin of the byte-rate profile")
    ap.add_argument("--bw", type=float, default=None, help="GB/s of the read ceiling, for the profile's %%")
    a = ap.parse_args(argv)
    if a.load:
        z = np.load(a.load)
        recs, dropped = z["recs"], list(z["dropped"])
        bw = a.bw or float(z["bw"])
    else:
        if not a.model:
            ap.error("MODEL or --load is required")
        recs, dropped = (record_pipelined if a.pipelined else record)(a.model, a.context, a.steps, a.per_sm)
        from atomflow._core import ops

        bw = a.bw or ops.stream_read_bandwidth(1 << 30, 20)
        if a.save:
            np.savez_compressed(a.save, recs=recs, dropped=np.asarray(dropped), bw=bw)
    if any(dropped):
        print(f"trace_step: {sum(dropped)} records dropped (raise --per-sm)", file=sys.stderr)
    ts = recs["t"][recs["t"] > 0]
    diffs = np.diff(np.unique(ts))
    print(
        f"trace_step: {len(recs)} records, {len(np.unique(recs['step']))} steps; globaltimer step "
        f"{int(diffs[diffs > 0].min()) if len(diffs) else 0} ns; read ceiling {bw:.0f} GB/s"
    )

    all_steps = []
    for s in np.unique(recs["step"]):
        step = launches(recs[recs["step"] == s])
        all_steps.append(step)
    # Layers: a qkv launch starts each.
    step = all_steps[-1]
    qkv = [i for i, l in enumerate(step) if l["name"] == "qkv"]
    n_layers = len(qkv)
    L = a.layer if a.layer is not None else n_layers // 2
    if not 0 <= L < n_layers - 1:
        ap.error(f"--layer must be in [0, {n_layers - 2}]")

    names, med, span = layer_table(all_steps)
    print(
        f"\nper layer (median over steps x layers 1..{n_layers - 2}), us from the layer's first qkv entry; "
        f"layer span {span:.2f} us"
    )
    print(f"{'kernel':<10}{'entry':>8}{'waited':>8}{'w.last':>8}{'landed':>8}{'staged':>8}{'done':>8}{'exit':>8}{'release':>9}")
    prev_exit = None
    for nm, m in zip(names, med):
        rel = m["waited"] - prev_exit if prev_exit is not None else float("nan")
        print(f"{nm:<10}" + "".join(f"{m[c]:>8.2f}" for c in COLS) + f"{rel:>9.2f}")
        prev_exit = m["exit"]
    print(
        "  entry: first block in; waited / w.last: median / last past the PDL wait; landed: median warp's\n"
        "  input arrived (attention: partial written); staged: input staged (attention: key loop done);\n"
        "  done: median exit (attention: merge written); exit: last; release: waited - previous exit"
    )

    print("\nattention phases, us (median per block), by the launch's blocks on the block's SM")
    print(f"{'on SM':>6}" + "".join(f"{name:>15}" for name, _, _ in A_PHASES))
    for k, d in attention_phases(all_steps).items():
        print(f"{k:>6}" + "".join(f"{d[name]:>15.2f}" for name, _, _ in A_PHASES))
    print("\nGEMV warps' exits, us after the launch's median wait (p10 / median / p90 / max; by iterations)")
    for name, d in exit_spread(all_steps).items():
        by_n = ", ".join(f"n={k}: {v:.2f}" for k, v in d["by_n"].items())
        print(f"{name:<10}" + " / ".join(f"{v:.2f}" for v in d["q"]) + f"   ({by_n})")

    # Byte-rate profile of layer L of the last step.
    t0 = step[qkv[L]]["first"]
    t1 = step[qkv[L + 1]]["first"]
    width = int(a.bin * 1e3)
    nb = (t1 - t0) // width + 1
    rate = {}
    for l in step[qkv[L] : qkv[L + 1] + 1]:
        if l["attn"]:
            continue
        tt, bb = weight_events(l)
        h = np.zeros(nb)
        ok = (tt >= t0) & (tt < t0 + nb * width)
        np.add.at(h, (tt[ok] - t0) // width, bb[ok])
        rate[l["name"] + ("'" if l is step[qkv[L + 1]] else "")] = h / width  # bytes/ns = GB/s
    total = sum(rate.values())
    print(f"\nlayer {L}: weight bytes summed per {a.bin} us (GB/s; % of {bw:.0f}), by kernel")
    print(f"{'us':>6} {'total':>6} {'%':>4}  " + " ".join(f"{k:>8}" for k in rate))
    for i in range(nb):
        if total[i] == 0:
            continue
        bar = "#" * int(round(40 * total[i] / bw))
        print(
            f"{i * a.bin:>6.2f} {total[i]:>6.0f} {100 * total[i] / bw:>4.0f}  "
            + " ".join(f"{rate[k][i]:>8.0f}" for k in rate)
            + f"  {bar}"
        )
    busy = total.sum() * width / ((t1 - t0) * bw)
    print(f"layer {L}: {(t1 - t0) / 1e3:.2f} us, weight bytes at {100 * busy:.1f}% of the ceiling on average")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
