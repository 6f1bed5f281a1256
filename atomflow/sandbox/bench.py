"""The sandbox's measurements (`atomflow sandbox bench`, written up in docs/SANDBOX.md): what do
paging and batching cost, and when do they pay?

  attention  decode-attention latency, contiguous vs paged (blocks scattered at random over the
             pool), over context x batch x block size; the paging overhead as a ratio; KV GB/s and
             the fraction of the streaming-read ceiling measured in the same run.
  decode     batched decode throughput for B concurrent sequences of mixed lengths (PagedModel,
             the real FP8 weights) vs single-stream decode with the core engine (CUDA graph + PDL).
  memory     KV bytes of a paged pool vs contiguous preallocation for the same sequences (CPU).
  prefix     prefix-cache hit rate on a shared-system-prompt workload (CPU), and the prefill time
             it saves (GPU).
Every part returns plain dicts (JSON-ready); format_* turn them into tables.
"""

from __future__ import annotations

import math
import time

import numpy as np

from atomflow.sandbox.model import FakeModel, SandboxModel, ext

# The 3B model's attention shape: 24 query heads, 8 KV heads, head_dim 128.
DEFAULT_SHAPE = dict(H=24, Hkv=8, D=128)


def ceiling_gbs(n_bytes: int = 1 << 30) -> float:
    return float(ext().stream_read_gbs(n_bytes, 10))


# ---------------------------------------------------------------------------------------
def bench_attention(contexts, batches, block_sizes, H=24, Hkv=8, D=128, iters=20, scatter=True, ceiling=None, log=print) -> dict:
    """Microseconds per decode-attention call (split + merge), each of B sequences at `context` keys."""
    sb = ext()
    _, _, free = sb.device_info()
    ceiling = ceiling or ceiling_gbs()
    rows = []
    for c in contexts:
        for B in batches:
            kv_bytes = 2 * B * c * Hkv * D * 2  # K and V, bf16, read once
            if kv_bytes * 1.3 > 0.45 * free:
                log(f"  skip context {c} batch {B}: {kv_bytes / 2**30:.1f} GiB of KV does not fit twice")
                continue
            lens = [int(c)] * B
            base = sb.time_attention("contiguous", lens, H, Hkv, D, 16, False, iters, 0)
            rows.append(_attn_row("contiguous", c, B, 0, base, base, kv_bytes, ceiling))
            for bs in block_sizes:
                us = sb.time_attention("paged", lens, H, Hkv, D, bs, scatter, iters, 1)
                rows.append(_attn_row("paged", c, B, bs, us, base, kv_bytes, ceiling))
            log(
                f"  context {c:>6} batch {B:>3}: contiguous {base:9.1f} us, paged "
                + ", ".join(
                    f"bs{r['block_size']} x{r['overhead']:.3f}"
                    for r in rows
                    if r["layout"] == "paged" and r["context"] == c and r["batch"] == B
                )
            )
    return dict(shape=dict(H=H, Hkv=Hkv, D=D), scatter=scatter, iters=iters, ceiling_gbs=ceiling, rows=rows)


def _attn_row(layout, c, B, bs, us, base, kv_bytes, ceiling) -> dict:
    gbs = kv_bytes / (us * 1e3)
    return dict(
        layout=layout,
        context=int(c),
        batch=int(B),
        block_size=int(bs),
        us=us,
        kv_bytes=kv_bytes,
        gbs=gbs,
        frac_ceiling=gbs / ceiling,
        overhead=us / base,
    )


def format_attention(res: dict) -> str:
    out = [
        f"decode attention, H {res['shape']['H']} / Hkv {res['shape']['Hkv']} / D {res['shape']['D']}, "
        f"blocks {'scattered' if res['scatter'] else 'in order'}; ceiling {res['ceiling_gbs']:.0f} GB/s",
        f"{'context':>8} {'batch':>5} {'layout':>10} {'bs':>4} {'us':>10} {'GB/s':>8} {'of ceil':>8} {'paged/contig':>12}",
    ]
    for r in res["rows"]:
        out.append(
            f"{r['context']:>8} {r['batch']:>5} {r['layout']:>10} {r['block_size'] or '-':>4} {r['us']:>10.1f} "
            f"{r['gbs']:>8.0f} {100 * r['frac_ceiling']:>7.1f}% {r['overhead']:>12.3f}"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
def mixed_lengths(B: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed + B).integers(lo, hi + 1, B).tolist()


def synthetic_decode(model, lens, steps: int, warmup: int = 3) -> dict:
    """`steps` decode iterations of B sequences already holding `lens` tokens. Their KV is whatever
    the pool holds (zeros): the cost of a step depends on the lengths, not on the values, so no
    prefill is needed. Returns wall and device milliseconds per step (medians)."""
    sb = ext()
    bm = sb.BlockManager(model.num_blocks, model.block_size, False)
    rng = np.random.default_rng(0)
    B, vocab = len(lens), model.vocab_size
    for i, n in enumerate(lens):
        bm.allocate(i, rng.integers(0, vocab, n).tolist())
        bm.commit(i, n)
    tokens = rng.integers(0, vocab, B).astype(np.int32)
    wall, dev = [], []
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        slots = np.array([bm.append(i, int(tokens[i]))[0] for i in range(B)], np.int32)
        n_tok = np.array([bm.num_tokens(i) for i in range(B)], np.int32)
        stride = int(-(-n_tok.max() // model.block_size))
        tables = bm.table_array(list(range(B)), stride)
        tokens = model.step(tokens, n_tok - 1, slots, B, tables, n_tok, None, 0, np.arange(B, dtype=np.int32))
        if s >= warmup:
            wall.append(1e3 * (time.perf_counter() - t0))
            dev.append(model.last_step_ms)
    return dict(step_ms=float(np.median(wall)), device_ms=float(np.median(dev)))


def core_tpot_ms(model_path, context: int, steps: int) -> float:
    """Single-stream decode with the core engine (CUDA graph + PDL) at `context`: ms per token."""
    from atomflow.engine import Engine
    from atomflow.sampling import SamplingParams

    eng = Engine.load(model_path, backend="cuda", max_context=context + steps + 8)
    ids = np.random.default_rng(1).integers(0, eng.spec.vocab_size, context).astype(np.int32)
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 1, ignore_eos=True, seed=0)
    list(eng.generate_tokens(ids, params))
    list(eng.generate_tokens(ids, params))  # the second run is the measured one (warm)
    return eng.stats.ms_per_token


def bench_decode(
    model_path, batches, lo: int, hi: int, block_size: int = 16, steps: int = 32, core: bool = True, ceiling=None, log=print
) -> dict:
    """Tokens/s of batched decode (B sequences, lengths uniform in [lo, hi]) vs single-stream."""
    Bmax = max(batches)
    all_lens = {B: mixed_lengths(B, lo, hi) for B in batches}
    blocks = max(sum(-(-(n + steps + 8) // block_size) for n in lens) for lens in all_lens.values())
    model = SandboxModel.load(
        model_path, block_size=block_size, max_batch=Bmax, prefill_chunk=1, max_context=hi + steps + 8, num_blocks=blocks
    )
    spec = model.spec
    ceiling = ceiling or ceiling_gbs()
    weight_bytes = model.impl.weight_bytes - spec.vocab_size * spec.hidden_size * 2  # one embedding row is read
    rows = []
    for B in batches:
        lens = all_lens[B]
        t = synthetic_decode(model, lens, steps)
        kv = (sum(lens) + B) * spec.kv_bytes_per_token()
        row = dict(
            batch=B,
            mean_context=float(np.mean(lens)),
            **t,
            tokens_per_s=1e3 * B / t["step_ms"],
            bytes_per_step=weight_bytes + kv,
            gbs=(weight_bytes + kv) / (t["device_ms"] * 1e6),
        )
        row["frac_ceiling"] = row["gbs"] / ceiling
        rows.append(row)
        log(f"  batch {B:>3}: {t['step_ms']:.3f} ms/step ({t['device_ms']:.3f} on the device), {row['tokens_per_s']:.0f} tok/s")
    res = dict(model=str(model_path), block_size=block_size, lengths=[lo, hi], steps=steps, ceiling_gbs=ceiling, rows=rows)
    del model
    if core:
        mean_ctx = int(round(np.mean([r["mean_context"] for r in rows])))
        tpot = core_tpot_ms(model_path, mean_ctx, steps)
        res["core"] = dict(context=mean_ctx, tpot_ms=tpot, tokens_per_s=1e3 / tpot)
        for r in rows:
            r["speedup_vs_core"] = r["tokens_per_s"] / res["core"]["tokens_per_s"]
            r["latency_vs_core"] = r["step_ms"] / tpot
        log(f"  core single-stream at context {mean_ctx}: {tpot:.3f} ms/token")
    return res


def format_decode(res: dict) -> str:
    core = res.get("core")
    out = [
        f"batched decode, {res['model']}, block size {res['block_size']}, lengths uniform in "
        f"{res['lengths'][0]}..{res['lengths'][1]}"
        + (f"; core single-stream {core['tpot_ms']:.3f} ms/token at context {core['context']}" if core else ""),
        f"{'batch':>5} {'mean ctx':>8} {'ms/step':>8} {'device':>8} {'tok/s':>9} {'GB/s':>7} {'of ceil':>8} "
        f"{'x core tok/s':>12} {'x core latency':>14}",
    ]
    for r in res["rows"]:
        out.append(
            f"{r['batch']:>5} {r['mean_context']:>8.0f} {r['step_ms']:>8.3f} {r['device_ms']:>8.3f} "
            f"{r['tokens_per_s']:>9.0f} {r['gbs']:>7.0f} {100 * r['frac_ceiling']:>7.1f}% "
            f"{r.get('speedup_vs_core', float('nan')):>12.2f} {r.get('latency_vs_core', float('nan')):>14.2f}"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
def bench_memory(
    kv_bytes_per_token: int, batches, max_context: int, lo: int, hi: int, block_sizes, budget_gib: float = 40.0
) -> dict:
    """KV bytes for B sequences of lengths uniform in [lo, hi]: contiguous preallocation reserves
    max_context per sequence, a paged pool rounds each up to a block. Also: how many such sequences
    fit in `budget_gib`."""
    rows = []
    for B in batches:
        lens = np.array(mixed_lengths(B, lo, hi))
        contiguous = B * max_context * kv_bytes_per_token
        row = dict(batch=B, tokens=int(lens.sum()), contiguous_bytes=contiguous, paged={})
        for bs in block_sizes:
            reserved = int((-(-lens // bs) * bs).sum())
            row["paged"][bs] = dict(
                bytes=reserved * kv_bytes_per_token,
                ratio=reserved * kv_bytes_per_token / contiguous,
                waste=(reserved - lens.sum()) / reserved,
            )
        rows.append(row)
    budget = budget_gib * 2**30
    mean = (lo + hi) / 2
    fits = dict(
        contiguous=int(budget // (max_context * kv_bytes_per_token)),
        paged={bs: int(budget // (math.ceil(mean / bs) * bs * kv_bytes_per_token)) for bs in block_sizes},
    )
    return dict(
        kv_bytes_per_token=kv_bytes_per_token,
        max_context=max_context,
        lengths=[lo, hi],
        rows=rows,
        budget_gib=budget_gib,
        sequences_that_fit=fits,
    )


def format_memory(res: dict) -> str:
    bss = list(res["rows"][0]["paged"]) if res["rows"] else []
    out = [
        f"KV memory, {res['kv_bytes_per_token'] / 1024:.0f} KiB per token, contiguous reserves max_context "
        f"{res['max_context']}; lengths uniform in {res['lengths'][0]}..{res['lengths'][1]}",
        f"{'batch':>5} {'tokens':>8} {'contig GiB':>10} "
        + " ".join(f"{'bs' + str(b) + ' GiB':>10} {'of contig':>9} {'waste':>6}" for b in bss),
    ]
    for r in res["rows"]:
        out.append(
            f"{r['batch']:>5} {r['tokens']:>8} {r['contiguous_bytes'] / 2**30:>10.2f} "
            + " ".join(
                f"{r['paged'][b]['bytes'] / 2**30:>10.2f} {100 * r['paged'][b]['ratio']:>8.1f}% "
                f"{100 * r['paged'][b]['waste']:>5.1f}%"
                for b in bss
            )
        )
    f = res["sequences_that_fit"]
    out.append(
        f"sequences that fit in {res['budget_gib']:.0f} GiB: contiguous {f['contiguous']}, paged "
        + ", ".join(f"bs{b} {n}" for b, n in f["paged"].items())
    )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
def prefix_workload(n_requests: int, system_len: int, user_len: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, system_len).tolist()
    return [system + rng.integers(0, vocab, user_len).tolist() for _ in range(n_requests)]


def _run_prefix(model, prompts, new_tokens: int, caching: bool, chunk: int) -> dict:
    from atomflow.sandbox.scheduler import Scheduler

    model.clear()
    sch = Scheduler(model, prefill_chunk=chunk, prefix_caching=caching)
    for p in prompts:
        sch.add(p, new_tokens)
    t0, rows = time.perf_counter(), 0
    while sch.has_work:
        rows += sch.step().n_prefill
    wall = time.perf_counter() - t0
    ttft = [r.t_first - t0 for r in sch.finished.values()]
    return dict(wall_s=wall, prefill_rows=rows, mean_ttft_s=float(np.mean(ttft)), stats=sch.bm.stats)


def bench_prefix(
    model_path, n_requests=32, system_len=1024, user_len=64, new_tokens=16, block_size=16, max_batch=16, chunk=256, log=print
) -> dict:
    """Shared system prompt + a unique question per request, through the scheduler with the prefix
    cache off and on. Without a model path (or a GPU), FakeModel gives the hit rate alone."""
    gpu = model_path is not None
    vocab = 1000
    if gpu:
        model = SandboxModel.load(
            model_path,
            block_size=block_size,
            max_batch=max_batch,
            prefill_chunk=chunk,
            max_context=system_len + user_len + new_tokens + 8,
            num_blocks=max_batch * math.ceil((system_len + user_len + new_tokens + 8) / block_size),
        )
        vocab = model.vocab_size
    else:
        model = FakeModel(
            max_batch * math.ceil((system_len + user_len + new_tokens + 8) / block_size),
            block_size,
            vocab,
            max_batch=max_batch,
            prefill_chunk=chunk,
            max_context=system_len + user_len + new_tokens + 8,
        )
    prompts = prefix_workload(n_requests, system_len, user_len, vocab)
    if gpu:
        _run_prefix(model, prompts[:2], 2, False, chunk)  # warm-up
    off, on = _run_prefix(model, prompts, new_tokens, False, chunk), _run_prefix(model, prompts, new_tokens, True, chunk)
    st = on["stats"]
    res = dict(
        gpu=gpu,
        n_requests=n_requests,
        system_len=system_len,
        user_len=user_len,
        new_tokens=new_tokens,
        block_size=block_size,
        hit_rate=st["cached_tokens"] / max(1, st["prompt_tokens"]),
        prefill_rows_off=off["prefill_rows"],
        prefill_rows_on=on["prefill_rows"],
    )
    if gpu:
        res.update(
            wall_s_off=off["wall_s"],
            wall_s_on=on["wall_s"],
            time_saved=1 - on["wall_s"] / off["wall_s"],
            mean_ttft_s_off=off["mean_ttft_s"],
            mean_ttft_s_on=on["mean_ttft_s"],
        )
    log(f"  prefix cache: hit rate {100 * res['hit_rate']:.1f}%, prefill rows {off['prefill_rows']} -> {on['prefill_rows']}")
    return res


def format_prefix(res: dict) -> str:
    out = [
        f"prefix caching, {res['n_requests']} requests = {res['system_len']}-token shared system prompt + "
        f"{res['user_len']} own tokens, {res['new_tokens']} generated, block size {res['block_size']}",
        f"  hit rate {100 * res['hit_rate']:.1f}% of prompt tokens; prefill rows computed "
        f"{res['prefill_rows_off']} -> {res['prefill_rows_on']}",
    ]
    if res["gpu"]:
        out.append(
            f"  wall {res['wall_s_off']:.3f} s -> {res['wall_s_on']:.3f} s ({100 * res['time_saved']:.1f}% saved); "
            f"mean time to first token {1e3 * res['mean_ttft_s_off']:.1f} -> {1e3 * res['mean_ttft_s_on']:.1f} ms"
        )
    else:
        out.append("  time saved: to be measured on a GPU (run with --model)")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
def plot_all(results: dict, out_dir) -> list[str]:
    """PNG plots of whatever parts ran; [] with a note in results['notes'] when matplotlib is missing."""
    from pathlib import Path

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results.setdefault("notes", []).append("plots skipped: matplotlib is not importable")
        return []
    out, written = Path(out_dir), []
    out.mkdir(parents=True, exist_ok=True)

    def save(fig, name: str) -> None:
        fig.tight_layout()
        written.append(str(out / name))
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    if "attention" in results:
        rows = results["attention"]["rows"]
        batches = sorted({r["batch"] for r in rows})
        fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5), squeeze=False)
        for ax, B in zip(axes[0], batches):
            for bs in sorted({r["block_size"] for r in rows if r["layout"] == "paged"}):
                pts = [
                    (r["context"], r["overhead"])
                    for r in rows
                    if r["batch"] == B and r["block_size"] == bs and r["layout"] == "paged"
                ]
                ax.plot(*zip(*pts), marker="o", label=f"block {bs}")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set(xscale="log", title=f"batch {B}", xlabel="context", ylabel="paged / contiguous time")
            ax.legend(fontsize=7)
        save(fig, "attention_overhead.png")
    if "decode" in results:
        rows = results["decode"]["rows"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["batch"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label="sandbox, batched")
        if "core" in results["decode"]:
            ax.axhline(results["decode"]["core"]["tokens_per_s"], color="red", ls="--", label="core, single stream")
        ax.set(xscale="log", yscale="log", xlabel="concurrent sequences", ylabel="tokens / s")
        ax.legend()
        save(fig, "decode_throughput.png")
    if "memory" in results:
        rows = results["memory"]["rows"]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["batch"] for r in rows], [r["contiguous_bytes"] / 2**30 for r in rows], marker="o", label="contiguous")
        for bs in rows[0]["paged"]:
            ax.plot(
                [r["batch"] for r in rows],
                [r["paged"][bs]["bytes"] / 2**30 for r in rows],
                marker=".",
                label=f"paged, block {bs}",
            )
        ax.set(xscale="log", yscale="log", xlabel="sequences", ylabel="KV GiB")
        ax.legend(fontsize=7)
        save(fig, "kv_memory.png")
    return written
