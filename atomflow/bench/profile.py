"""`atomflow profile`: the decode step broken down by kernel, timed on the device.

The engine's profile mode (csrc/core/profiler.cu) runs eager decode steps with a CUDA event after
each launch group, the whole step queued behind a gate so the GPU runs it at its own pace. Each
group's bytes come from the shapes (weights + scales from the file's tensor table, activations,
the KV cache at the profiled context), so every kernel gets GB/s and a fraction of the read
bandwidth measured in the same run. For comparison: the same eager step without events inside
(kernels keep their programmatic-dependent-launch overlap), the CUDA-graph step on the device,
and the graph TPOT as the host receives tokens.
"""

from __future__ import annotations

import time

import numpy as np

from atomflow import runinfo
from atomflow.bench.plan import prompt_ids
from atomflow.device import cuda_status
from atomflow.errors import BackendUnavailableError
from atomflow.model.fileformat import AtomflowFile
from atomflow.sampling import SamplingParams

# The launch groups of a decode step: the layers' five, the head, and the sampler that ends the step
# (ring, position, next embedding). An engine planned with fused_tail=False (include/atomflow/step_plan.h)
# also has "embedding" and "finish" groups.
LABELS = ("gemv_qkv+norm+rope", "attention", "gemv_o", "gemv_gate_up+norm", "gemv_down", "lm_head", "sample")
WARMUP_STEPS = 3
GRAPH_TOKENS = 64  # tokens of the pipelined run that gives the graph TPOT


def kernel_bytes(model: AtomflowFile, context: float) -> dict[str, float]:
    """Bytes one launch of each group reads + writes with `context` tokens in the cache (the
    step's own K/V row included in what attention reads). None for the sampler: what it reads
    depends on the settings (a greedy draw with an FP8 head reads the head's block maxima, not the
    logits), so it gets no rate."""
    s, t = model.spec, model.tensors
    d, f = s.hidden_size, s.intermediate_size

    def w(name: str) -> int:
        return t[name].nbytes + (t[name + ".scale"].nbytes if name + ".scale" in t else 0)

    kv_row = s.kv_dim * 2  # one layer's K (or V) row, bf16
    head = w("lm_head") if "lm_head" in t else t["embed"].nbytes
    norm_in = d * 2 + d * 4  # norm weights bf16 + the fp32 residual row, for the fused RMSNorm
    return {
        "embedding": d * 2 + d * 4,
        # RMSNorm in, RoPE + KV append out: q (bf16) and this token's K / V rows.
        "gemv_qkv+norm+rope": w("layers.0.wqkv") + norm_in + s.q_dim * 2 + 2 * kv_row,
        "attention": 2 * s.q_dim * 2 + 2 * kv_row * (context + 1),
        "gemv_o": w("layers.0.wo") + s.q_dim * 2 + 2 * d * 4,
        "gemv_gate_up+norm": w("layers.0.w13") + norm_in + f * 2,
        "gemv_down": w("layers.0.w2") + f * 2 + 2 * d * 4,
        "lm_head": head + norm_in + s.vocab_size * 4,
    }


def breakdown(
    entries: list[tuple[str, int, float]], steps: int, nbytes: dict[str, float], bandwidth_gbs: float | None
) -> list[dict]:
    """(label, layer, us) of `steps` steps -> one row per label, slowest first: launches per step,
    mean us per launch, us per step, share of the step, GB/s, fraction of the read bandwidth."""
    by: dict[str, list[float]] = {}
    for label, _layer, us in entries:
        by.setdefault(label, []).append(float(us))
    total = sum(sum(v) for v in by.values()) / steps
    rows = []
    for label, us in by.items():
        avg = float(np.mean(us))
        b = nbytes.get(label)
        gbs = b / (avg * 1e3) if b and avg > 0 else None
        rows.append(
            dict(
                label=label,
                count_per_step=len(us) / steps,
                avg_us=avg,
                step_us=sum(us) / steps,
                share=sum(us) / steps / total if total > 0 else None,
                bytes=b,
                achieved_gbs=gbs,
                efficiency=gbs / bandwidth_gbs if gbs and bandwidth_gbs else None,
            )
        )
    return sorted(rows, key=lambda r: -r["step_us"])


def per_layer(entries: list[tuple[str, int, float]]) -> list[dict]:
    by: dict[tuple[str, int], list[float]] = {}
    for label, layer, us in entries:
        by.setdefault((label, layer), []).append(float(us))
    return [dict(label=k[0], layer=k[1], avg_us=float(np.mean(v))) for k, v in by.items()]


def step_us(entries: list[tuple[str, int, float]]) -> float | None:
    return float(np.median([us for _, _, us in entries])) if entries else None


def preflight(model_path: str, steps: int, context: int) -> AtomflowFile:
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if context < 0:
        raise ValueError(f"--context must be >= 0, got {context}")
    model = AtomflowFile(model_path)
    need = context + max(steps + WARMUP_STEPS, GRAPH_TOKENS) + 1
    if need > model.spec.max_position_embeddings:
        raise ValueError(
            f"--context {context} with --steps {steps} needs {need} positions; the model supports "
            f"{model.spec.max_position_embeddings}"
        )
    ok, why = cuda_status()
    if not ok:
        raise BackendUnavailableError(f"cuda backend unavailable: {why}")
    return model


def run_profile(model_path: str, steps: int = 20, context: int = 128, seed: int = 0) -> dict:
    from atomflow.bench.bandwidth import read_bandwidth_gbs
    from atomflow.engine import Engine

    model = preflight(model_path, steps, context)
    bandwidth = read_bandwidth_gbs()
    eng = Engine.load(model_path, backend="cuda", max_context=context + max(steps + WARMUP_STEPS, GRAPH_TOKENS) + 1)
    core = eng.backend.engine
    ids = prompt_ids(model.spec.vocab_size, context + 1, seed)
    if context:
        eng.prefill(ids[:context])
    token = int(ids[context])

    def run(mode: str, n: int) -> list[tuple[str, int, float]]:
        out = core.profile_decode(token, n, mode)
        eng.backend.rollback(context)  # every mode sees the same contexts
        return [tuple(e) for e in out]

    run("kernels", WARMUP_STEPS)
    kernels = run("kernels", steps)
    eager = run("eager", steps)
    graph = run("graph", steps) if core.graph_enabled else []
    stamps = [
        time.perf_counter()
        for _ in eng.generate_tokens(ids, SamplingParams(temperature=0.0, max_new_tokens=GRAPH_TOKENS, ignore_eos=True))
    ]
    tpot_ms = float(np.median(np.diff(stamps))) * 1e3

    mean_context = context + (steps - 1) / 2
    rows = breakdown(kernels, steps, kernel_bytes(model, mean_context), bandwidth)
    missing = [label for label in LABELS if label not in {r["label"] for r in rows}]
    return dict(
        model=model_path,
        spec=model.spec.to_dict(),
        device=runinfo.device(),
        commit=runinfo.commit(),
        versions=runinfo.versions(),
        date=runinfo.now(),
        read_bandwidth_gbs=bandwidth,
        context=context,
        steps=steps,
        rows=rows,
        per_layer=per_layer(kernels),
        missing_labels=missing,
        kernel_sum_us=sum(r["step_us"] for r in rows),
        eager_step_us=step_us(eager),
        graph_step_us=step_us(graph),
        tpot_ms=tpot_ms,
        tpot_mode="graph" if core.graph_enabled else "eager",
    )


def format_table(result: dict) -> str:
    dev = (result.get("device") or {}).get("name", "unknown GPU")
    lines = [
        f"atomflow profile: {result['model']} | {dev} | read bandwidth {result['read_bandwidth_gbs']:.0f} GB/s | "
        f"context {result['context']} | {result['steps']} eager steps, a CUDA event after each launch group",
        "",
        f"{'kernel':<20} {'count/step':>10} {'avg us':>9} {'us/step':>9} {'% step':>7} {'GB/s':>7} {'eff':>6}",
    ]
    for r in result["rows"]:
        gbs = "-" if r["achieved_gbs"] is None else f"{r['achieved_gbs']:.0f}"
        eff = "-" if r["efficiency"] is None else f"{100 * r['efficiency']:.1f}%"
        lines.append(
            f"{r['label']:<20} {r['count_per_step']:>10g} {r['avg_us']:>9.2f} {r['step_us']:>9.1f} "
            f"{100 * r['share']:>6.1f}% {gbs:>7} {eff:>6}"
        )
    lines.append(f"{'sum of kernels':<20} {'':>10} {'':>9} {result['kernel_sum_us']:>9.1f} {100.0:>6.1f}%")
    lines.append("")

    def us(x):
        return "-" if x is None else f"{x:.1f} us"

    lines.append(f"eager step (no events inside, PDL overlap kept): {us(result['eager_step_us'])} on the GPU")
    lines.append(
        f"graph step: {us(result['graph_step_us'])} on the GPU | {result['tpot_mode']} TPOT "
        f"{result['tpot_ms']:.3f} ms p50 (tokens as the host receives them)"
    )
    if result.get("missing_labels"):
        lines.append(f"warning: no time recorded for {', '.join(result['missing_labels'])}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Horizontal bars of us per step by kernel group (matplotlib, imported here only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(reversed(result["rows"]))
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    ax.barh([r["label"] for r in rows], [r["step_us"] for r in rows], color="#4c72b0")
    for i, r in enumerate(rows):
        eff = "" if r["efficiency"] is None else f", {100 * r['efficiency']:.0f}% of read bw"
        ax.text(r["step_us"], i, f" {100 * r['share']:.1f}%{eff}", va="center", fontsize=8)
    ax.set_xlim(0, 1.4 * max((r["step_us"] for r in rows), default=1.0))  # room for the labels
    dev = (result.get("device") or {}).get("name", "")
    ax.set_xlabel("us per decode step (eager, CUDA events)")
    ax.set_title(f"{result['model']} on {dev}, context {result['context']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
