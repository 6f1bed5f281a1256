"""Kernel micro-benchmarks: one table per kernel with the shape, the time per launch (median over
batches of back-to-back launches), the bytes it must move, GB/s, and the fraction of the
streaming-read ceiling measured in the same run. Weights and KV caches are rotated through more
memory than the L2 holds, so the numbers are DRAM numbers.

    python tools/bench_kernels.py [--iters 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

MODELS = {  # Llama 3.2 3B and 3.1 8B
    "3B": dict(d=3072, ffn=8192, H=24, Hkv=8, D=128, layers=28),
    "8B": dict(d=4096, ffn=14336, H=32, Hkv=8, D=128, layers=32),
}
VOCAB = 128256
STORE, ADD, SWIGLU = 0, 1, 2
SECTIONS = (
    "gemv",
    "gemv_m",
    "gemv_m_products",
    "attention",
    "attention_qkv",
    "attention_prefill",
    "gemm",
    "gemm_sm90",
    "gemm_w8a8",
    "gemm_skinny",
    "gemm_skinny_splits",
    "sample",
)


def linear_shapes(m: dict):
    """(name, N, K, epilogue) of each linear layer, with the epilogue the engine uses."""
    qkv = (m["H"] + 2 * m["Hkv"]) * m["D"]
    return [
        ("qkv", qkv, m["d"], STORE),
        ("o", m["d"], m["H"] * m["D"], ADD),
        ("gate_up", 2 * m["ffn"], m["d"], SWIGLU),
        ("down", m["d"], m["ffn"], ADD),
        ("lm_head", VOCAB, m["d"], STORE),
    ]


def gemv_bytes(N: int, K: int, ep: int) -> int:
    """Weights + scales + x in, and the output written (read too for AddResidual)."""
    out = {STORE: 4 * N, ADD: 8 * N, SWIGLU: 2 * (N // 2)}[ep]
    return N * K + N * (K // 128) * 4 + 2 * K + out


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50, help="timed launches per shape (median reported)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument(
        "--rows",
        default="16,32,64,128,256,512,1024,2048",
        help="chunk rows of the gemm_sm90 and gemm_w8a8 sections (comma-separated)",
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument(
        "--prefill-kernels",
        default="wgmma,mma",
        help="attention_prefill section: the kernels timed (wgmma, mma or both; the mma.sync kernel is slow deep in a context)",
    )
    args = ap.parse_args(argv)
    prefill_kernels = args.prefill_kernels.split(",")
    if not prefill_kernels or set(prefill_kernels) - {"wgmma", "mma"}:
        ap.error(f"--prefill-kernels takes wgmma, mma or both, not {args.prefill_kernels!r}")
    run = set(args.sections.split(","))
    chunk_rows = [int(r) for r in args.rows.split(",")]
    if run - set(SECTIONS):
        ap.error(f"unknown section(s) {','.join(sorted(run - set(SECTIONS)))}; known: {','.join(SECTIONS)}")
    try:
        from atomflow import _core
    except ImportError as e:
        print(f"bench_kernels: atomflow._core is not importable ({e})", file=sys.stderr)
        return 2
    ok, why = _core.cuda_available()
    if not ok:
        print(f"bench_kernels: no usable GPU ({why})", file=sys.stderr)
        return 2
    ops, info = _core.ops, _core.device_info()
    results: dict = {"device": info["name"], "sm_count": info["sm_count"]}

    ceiling = ops.stream_read_bandwidth(1 << 30, 20)
    results["stream_read_GBps"] = ceiling
    print(f"{info['name']} ({info['sm_count']} SMs): streaming read {ceiling:.0f} GB/s (1 GiB)")
    pct = lambda gbs: f"{100 * gbs / ceiling:.1f}%"

    if "gemv" in run:
        # GEMV: every linear layer of the decode step, with its real epilogue.
        rows, results["gemv"] = [], []
        for model, m in MODELS.items():
            step_us = step_bytes = 0.0
            for name, N, K, ep in linear_shapes(m):
                us = ops.time_gemv(N, K, iters=args.iters, epilogue=ep)
                nbytes = gemv_bytes(N, K, ep)
                gbs = nbytes / us / 1e3
                per_step = 1 if name == "lm_head" else m["layers"]
                step_us += us * per_step
                step_bytes += nbytes * per_step
                rows.append([model, name, f"{N}x{K}", f"{us:.2f}", f"{nbytes / 2**20:.1f}", f"{gbs:.0f}", pct(gbs)])
                results["gemv"].append(dict(model=model, layer=name, N=N, K=K, us=us, bytes=nbytes, GBps=gbs))
            gbs = step_bytes / step_us / 1e3
            rows.append([model, "all linears / token", "", f"{step_us:.0f}", f"{step_bytes / 2**20:.0f}", f"{gbs:.0f}", pct(gbs)])
        table("gemv_w8a16 (M = 1)", ["model", "layer", "N x K", "us", "MiB", "GB/s", "of ceiling"], rows)

    if "gemv_m" in run:
        # Small-M GEMV (gemv_w8a16_m): each weight byte read once for M rows of x. Every linear of a layer
        # at M = 1..64 against the M = 1 GEMV (x = the layer's time over the decode GEMV's) and the prefill
        # GEMM at the same M, so the crossovers can be read off one run. Bytes: weights + scales + x + out.
        rows, results["gemv_m"] = [], []
        for model in ("3B", "8B"):
            m = MODELS[model]
            layer = linear_shapes(m)[:4]
            m1_us = sum(ops.time_gemv(N, K, iters=args.iters, epilogue=ep) for _, N, K, ep in layer)
            for M in [1, 2, 4, 5, 8, 16, 32, 64]:
                us = tiles_us = gemm_us = 0.0
                nbytes = 0
                for _, N, K, ep in layer:
                    us += ops.time_gemv_m(M, N, K, iters=args.iters, epilogue=ep)
                    tiles_us += ops.time_gemv_m(M, N, K, iters=args.iters, epilogue=ep, kernel="tiles")
                    gemm_us += ops.time_gemm(M, N, K, iters=max(5, args.iters // 5), epilogue=ep)
                    out = {STORE: 4 * N, ADD: 8 * N, SWIGLU: 2 * (N // 2)}[ep] * M
                    nbytes += N * K + N * (-(-K // 128)) * 4 + 2 * K * M + out
                gbs = nbytes / us / 1e3
                chosen = [ops.gemv_m_plan(M, N, K, ep) for _, N, K, ep in layer]
                plans = " ".join("cols" if p["cols"] else f"{p['nc']}" for p in chosen)
                mib = f"{nbytes / 2**20:.1f}"
                rows.append(
                    [
                        model,
                        str(M),
                        f"{us:.1f}",
                        f"{us / m1_us:.2f}",
                        f"{tiles_us:.1f}",
                        f"{gemm_us:.1f}",
                        mib,
                        f"{gbs:.0f}",
                        pct(gbs),
                        plans,
                    ]
                )
                results["gemv_m"].append(
                    dict(model=model, M=M, us=us, m1_us=m1_us, tiles_us=tiles_us, gemm_us=gemm_us, bytes=nbytes, GBps=gbs)
                )
        table(
            "gemv_w8a16_m (one layer's qkv + o + gate_up + down; us: the table's kernel, tiles us: the tile kernel)",
            ["model", "M", "us", "x M=1 gemv", "tiles us", "gemm us", "MiB", "GB/s", "of ceiling", "qkv/o/gu/down"],
            rows,
        )
    if "gemv_m_products" in run:
        # The products as a verify chunk runs them (qkv and gate_up on the residual stream, RMSNorm fused;
        # o and down on fp16 x), per product: the decode GEMV, the tile kernel, the token columns.
        rows, results["gemv_m_products"] = [], []
        for model in ("3B", "8B"):
            layer = linear_shapes(MODELS[model])
            for (name, N, K, ep), x_in in zip(layer, ("norm", "f16", "norm", "f16", "norm")):
                m1 = ops.time_gemv(N, K, iters=args.iters, epilogue=ep)
                for M in (2, 3, 4, 5):
                    tiles = ops.time_gemv_m(M, N, K, iters=args.iters, epilogue=ep, x_in=x_in, kernel="tiles")
                    try:  # the token columns wherever they fit (4 rows at most)
                        cols = ops.time_gemv_m(M, N, K, iters=args.iters, epilogue=ep, x_in=x_in, kernel="cols")
                    except ValueError:
                        cols = None
                    table_cols = ops.gemv_m_plan(M, N, K, ep, x_in)["cols"]
                    rows.append(
                        [
                            model,
                            name,
                            x_in,
                            str(M),
                            f"{m1:.1f}",
                            f"{tiles:.1f}",
                            "-" if cols is None else f"{cols:.1f}",
                            f"{min(tiles, cols or tiles) / m1:.2f}",
                            "cols" if table_cols else "tiles",
                        ]
                    )
                    results["gemv_m_products"].append(
                        dict(model=model, layer=name, x_in=x_in, M=M, m1_us=m1, tiles_us=tiles, cols_us=cols, table=table_cols)
                    )
        table("small-M products (us)", ["model", "layer", "x", "M", "M=1 gemv", "tiles", "cols", "best x M=1", "table"], rows)

    if "attention" in run:
        # Decode attention: KV read = 2 (K, V) x context x Hkv x D x 2 B per layer.
        rows, results["attention"] = [], []
        for model, m in MODELS.items():
            H, Hkv, D = m["H"], m["Hkv"], m["D"]
            for ctx in [128, 512, 2048, 4096, 8192, 32768]:
                us = ops.time_attention(ctx, H, Hkv, D, M=1, iters=args.iters)
                # The decode step's mode: the cached rows read before the PDL wait (GB/s on this one).
                us_early = ops.time_attention(ctx, H, Hkv, D, M=1, iters=args.iters, early=True)
                nbytes = 2 * ctx * Hkv * D * 2 + 2 * H * D * 2
                gbs = nbytes / us_early / 1e3
                rows.append(
                    [
                        model,
                        f"H={H} Hkv={Hkv} D={D}",
                        str(ctx),
                        f"{us:.2f}",
                        f"{us_early:.2f}",
                        f"{nbytes / 2**20:.2f}",
                        f"{gbs:.0f}",
                        pct(gbs),
                    ]
                )
                results["attention"].append(dict(model=model, context=ctx, us=us, us_early=us_early, bytes=nbytes, GBps=gbs))
        table(
            "attention (M = 1, one layer)",
            ["model", "heads", "context", "us", "us (decode step's mode)", "MiB", "GB/s", "of ceiling"],
            rows,
        )

    if "attention_qkv" in run:
        # The split-QKV decode step's attention (attention_qkv: the raw QKV row in, each block making its
        # query heads and the new K / V row): an 8B-shaped layer (H 32, Hkv 8, D 128) without and with
        # Qwen3's per-head q/k RMSNorm, each plain and halved (AttnPlan::halved: two blocks of 2 heads
        # per kv head), by the keys the step sees.
        rows, results["attention_qkv"] = [], []
        H, Hkv, D = 32, 8, 128
        for ctx in [64, 128, 256, 384, 512, 1024, 2048, 4096]:
            row = [str(ctx)]
            for qk_norm in (False, True):
                for halved in (False, True):
                    us = ops.time_attention_qkv(ctx, H, Hkv, D, qk_norm=qk_norm, halved=halved, iters=args.iters)
                    row.append(f"{us:.2f}")
                    results["attention_qkv"].append(dict(context=ctx, qk_norm=qk_norm, halved=halved, us=us))
            rows.append(row)
        table(
            "attention_qkv (M = 1, one layer, H 32 / Hkv 8 / D 128), us",
            ["context", "plain", "halved", "q/k norm", "q/k norm, halved"],
            rows,
        )

    if "attention_prefill" in run:
        # Prefill attention of one chunk of M rows after `prior` cached tokens: the warpgroup-MMA kernel
        # against the mma.sync one, and the plan's choice. FLOPs count the visible keys only:
        # 4 H D (M prior + M (M + 1) / 2) (Q K^T and P V, 2 per multiply-add).
        rows, results["attention_prefill"] = [], []
        iters = max(5, args.iters // 5)
        for name in ["3B", "8B"]:
            m = MODELS[name]
            H, Hkv, D = m["H"], m["Hkv"], m["D"]
            for M in [32, 64, 128, 256, 512, 1024, 2048, 4096]:  # 2048 / 4096: the plan's prompt chunks
                for prior in [0, 4096, 16384] + ([32768] if M >= 1024 else []):
                    flops = 4 * H * D * (M * prior + M * (M + 1) // 2)
                    planned = ops.attention_prefill_plan(M, H, Hkv, D, prior=prior)
                    plan, splits = planned["kernel"], planned["splits"]
                    us = {k: ops.time_attention_prefill(M, prior, H, Hkv, D, iters=iters, kernel=k) for k in prefill_kernels}
                    cells = []
                    for k in ("wgmma", "mma"):
                        cells += [f"{us[k]:.1f}", f"{flops / us[k] / 1e6:.0f}"] if k in us else ["", ""]
                    ratio = f"{us['mma'] / us['wgmma']:.2f}x" if len(us) == 2 else ""
                    kind = ("wgmma" if "wgmma" in plan else "mma") + (f" x {splits}" if splits > 1 else "")
                    rows.append([name, str(M), str(prior), *cells, ratio, kind])
                    results["attention_prefill"].append(
                        dict(
                            model=name,
                            M=M,
                            prior=prior,
                            flops=flops,
                            plan=plan,
                            splits=splits,
                            **{f"us_{k}": v for k, v in us.items()},
                        )
                    )
        table(
            "prefill attention (one chunk, one layer): wgmma against mma.sync, and the plan's kernel (x its key splits)",
            ["model", "M", "prior", "us (wgmma)", "TFLOP/s", "us (mma)", "TFLOP/s", "mma / wgmma", "plan"],
            rows,
        )

    if "gemm" in run:
        # Prefill GEMM: compute-bound, so TFLOP/s; the last row is one 512-token prefill's linears.
        rows, results["gemm"] = [], []
        M = 512
        for model, m in MODELS.items():
            total_us = 0.0
            for name, N, K, ep in linear_shapes(m)[:4]:  # the head runs on the last row only (GEMV)
                us = ops.time_gemm(M, N, K, iters=max(5, args.iters // 5), epilogue=ep)
                tflops = 2 * M * N * K / us / 1e6
                total_us += us * m["layers"]
                rows.append([model, name, f"{M}x{N}x{K}", f"{us:.1f}", f"{tflops:.0f}"])
                results["gemm"].append(dict(model=model, layer=name, M=M, N=N, K=K, us=us, TFLOPs=tflops))
            rows.append([model, f"{m['layers']} layers", f"{M} tokens", f"{total_us:.0f}", ""])
        table("gemm_w8a16 (prefill)", ["model", "layer", "M x N x K", "us", "TFLOP/s"], rows)

    if "gemm_sm90" in run:
        # The Hopper GEMM (gemm_w8a16_sm90: scale transpose + CUTLASS TMA/wgmma GEMM (+ SwiGLU)) next to
        # gemm_w8a16, per layer product and per layer, at the chunk sizes the step plan may route to it.
        # Each of its tile kinds is timed (xwide / wide / narrow tokens per tile, with and without stream-K) and
        # the one its launcher picks by M (auto), so the table is the data behind sm90_tile_for.
        kinds = ("xwide", "wide", "narrow", "wide-streamk", "narrow-streamk", "auto")
        rows, results["gemm_sm90"] = [], []
        if not ops.gemm_sm90_built():
            print("\ngemm_w8a16_sm90: not in this build (nvidia-cutlass missing at build time)")
        for model in ("3B", "8B") if ops.gemm_sm90_built() else ():
            m = MODELS[model]
            for M in chunk_rows:
                it = max(5, args.iters // 5)
                layer = {k: 0.0 for k in ("gemm", *kinds)}
                flops_layer = 0.0
                for name, N, K, ep in linear_shapes(m)[:4]:
                    us = {"gemm": ops.time_gemm(M, N, K, iters=it, epilogue=ep)}
                    for kind in kinds:
                        us[kind] = ops.time_gemm_sm90(M, N, K, iters=it, epilogue=ep, x_dtype="bf16", tile=kind)
                    flops = 2 * M * N * K
                    flops_layer += flops
                    for k, v in us.items():
                        layer[k] += v
                    best = min(kinds[:-1], key=lambda k: us[k])
                    rows.append(
                        [
                            model,
                            str(M),
                            name,
                            *(f"{us[k]:.1f}" for k in ("gemm", *kinds)),
                            best,
                            f"{flops / us['auto'] / 1e6:.0f}",
                        ]
                    )
                    results["gemm_sm90"].append(
                        dict(model=model, M=M, layer=name, N=N, K=K, us=us, TFLOPs_auto=flops / us["auto"] / 1e6)
                    )
                best = min(kinds[:-1], key=lambda k: layer[k])
                rows.append(
                    [
                        model,
                        str(M),
                        "layer",
                        *(f"{layer[k]:.1f}" for k in ("gemm", *kinds)),
                        best,
                        f"{flops_layer / layer['auto'] / 1e6:.0f}",
                    ]
                )
        if rows:
            table(
                "gemm_w8a16_sm90 by tile kind vs gemm_w8a16 (bf16 x; us per launch; TFLOP/s of auto)",
                ["model", "M", "product", "gemm", *kinds, "best", "TFLOP/s"],
                rows,
            )

    if "gemm_w8a8" in run:
        # The FP8 recipe (gemm_w8a8_sm90: activation quantization + FP8 blockwise-scaled GEMM (+ SwiGLU))
        # against the W8A16 GEMM's kind for the rows, per product and per layer.
        rows, results["gemm_w8a8"] = [], []
        for model in ("3B", "8B") if ops.gemm_sm90_built() else ():
            m = MODELS[model]
            for M in chunk_rows:
                it = max(5, args.iters // 5)
                a16 = a8 = a8sk = flops_layer = 0.0
                for name, N, K, ep in linear_shapes(m)[:4]:
                    t16 = ops.time_gemm_sm90(M, N, K, iters=it, epilogue=ep, x_dtype="bf16")
                    t8 = ops.time_gemm_sm90_w8a8(M, N, K, iters=it, epilogue=ep)
                    t8sk = ops.time_gemm_sm90_w8a8(M, N, K, iters=it, epilogue=ep, streamk=True)
                    flops = 2 * M * N * K
                    a16, a8, a8sk, flops_layer = a16 + t16, a8 + t8, a8sk + t8sk, flops_layer + flops
                    best = min(t8, t8sk)
                    rows.append([model, str(M), name, f"{t16:.1f}", f"{t8:.1f}", f"{t8sk:.1f}"])
                    rows[-1] += [f"{flops / best / 1e6:.0f}", f"{t16 / best:.2f}"]
                    results["gemm_w8a8"].append(
                        dict(model=model, M=M, layer=name, N=N, K=K, us_w8a16=t16, us_w8a8=t8, us_w8a8_streamk=t8sk)
                    )
                best = min(a8, a8sk)
                rows.append([model, str(M), "layer", f"{a16:.1f}", f"{a8:.1f}", f"{a8sk:.1f}"])
                rows[-1] += [f"{flops_layer / best / 1e6:.0f}", f"{a16 / best:.2f}"]
        if rows:
            table(
                "gemm_w8a8_sm90 (data-parallel, stream-K) vs gemm_w8a16_sm90 (us per launch; TFLOP/s and speedup of the faster)",
                ["model", "M", "product", "w8a16 us", "w8a8 us", "w8a8 stream-K us", "TFLOP/s", "speedup"],
                rows,
            )

    if "gemm_skinny" in run:
        # The skinny GEMM (gemm_w8a16_skinny) on the chunk sizes between the small-M GEMV and the sm90 GEMM,
        # per product with the epilogue and input type the engine gives it, and per layer; the decode GEMV
        # (M = 1, bf16 x) for reference. Bytes: weights + scales + x + out; GB/s and the ceiling's fraction
        # are the skinny GEMM's. Every kernel streams rotated weights (each launch reads them from DRAM).
        rows, results["gemm_skinny"] = [], []
        kinds = ("skinny", "gemv_m", "sm90") if ops.gemm_sm90_built() else ("skinny", "gemv_m")
        x_of = {"qkv": "f16", "o": "bf16", "gate_up": "f16", "down": "bf16"}
        fmt = lambda us, k: f"{us[k]:.1f}" if k in us else "-"
        for model in ("3B", "8B"):
            layer = linear_shapes(MODELS[model])[:4]
            m1 = {name: ops.time_gemv(N, K, iters=args.iters, epilogue=ep) for name, N, K, ep in layer}
            for M in (17, 24, 32, 48, 64):
                it = max(5, args.iters // 5)
                total = dict.fromkeys((*kinds, "m1"), 0.0)
                total_bytes = 0
                for name, N, K, ep in layer:
                    x = x_of[name]
                    us = {
                        "skinny": ops.time_gemm_skinny(M, N, K, iters=args.iters, epilogue=ep, x_dtype=x),
                        "gemv_m": ops.time_gemv_m(M, N, K, iters=args.iters, epilogue=ep, x_in=x),
                    }
                    if "sm90" in kinds:
                        us["sm90"] = ops.time_gemm_sm90(M, N, K, iters=it, epilogue=ep, x_dtype=x, rotate=True)
                    us["m1"] = m1[name]
                    out = {STORE: 4 * N, ADD: 8 * N, SWIGLU: 2 * (N // 2)}[ep] * M
                    nbytes = N * K + N * (-(-K // 128)) * 4 + 2 * K * M + out
                    gbs = nbytes / us["skinny"] / 1e3
                    plan = ops.gemm_skinny_plan(M, N, K, ep, x)
                    for k, v in us.items():
                        total[k] += v
                    total_bytes += nbytes
                    rows.append([model, str(M), name, x, f"{N}x{K}", f"{us['skinny']:.1f}", f"{gbs:.0f}", pct(gbs)])
                    rows[-1] += [f"{plan['splits']}x{plan['kg']}", fmt(us, "gemv_m"), fmt(us, "sm90"), fmt(us, "m1")]
                    rows[-1] += [min(kinds, key=lambda k: us[k])]
                    results["gemm_skinny"].append(
                        dict(model=model, M=M, layer=name, x=x, N=N, K=K, bytes=nbytes, GBps=gbs, plan=plan, us=us)
                    )
                gbs = total_bytes / total["skinny"] / 1e3
                rows.append([model, str(M), "layer", "", "", f"{total['skinny']:.1f}", f"{gbs:.0f}", pct(gbs), ""])
                rows[-1] += [fmt(total, "gemv_m"), fmt(total, "sm90"), fmt(total, "m1"), min(kinds, key=lambda k: total[k])]
        table(
            "gemm_w8a16_skinny vs gemv_w8a16_m and gemm_w8a16_sm90 (us per launch, weights rotated past L2)",
            ["model", "M", "product", "x", "N x K", "skinny us", "GB/s", "of ceiling", "splits x kg", "gemv_m us"]
            + ["sm90 us", "M=1 gemv us", "fastest"],
            rows,
        )

    if "gemm_skinny_splits" in run:
        # Every split of the scale groups the skinny GEMM takes for each 3B / 8B product (its clusters of 1..8
        # blocks), at the rows of a prompt chunk: the plan's choice (plan_gemm_skinny) marked, the fastest named.
        rows, results["gemm_skinny_splits"] = [], []
        x_of = {"qkv": "f16", "o": "bf16", "gate_up": "f16", "down": "bf16"}
        for model in ("3B", "8B"):
            for M in (8, 16, 32):
                for name, N, K, ep in linear_shapes(MODELS[model])[:4]:
                    x, G = x_of[name], -(-K // 128)
                    splits = sorted({-(-G // -(-G // s)) for s in range(-(-G // 24), min(8, G) + 1)})
                    us = {s: ops.time_gemm_skinny(M, N, K, iters=args.iters, epilogue=ep, x_dtype=x, splits=s) for s in splits}
                    plan = ops.gemm_skinny_plan(M, N, K, ep, x)["splits"]
                    best = min(us, key=us.get)
                    cells = " ".join(f"s{s} {t:.1f}{'*' if s == plan else ''}" for s, t in us.items())
                    rows.append([model, str(M), name, f"s{plan} {us[plan]:.1f}", f"s{best} {us[best]:.1f}", cells])
                    results["gemm_skinny_splits"].append(dict(model=model, M=M, layer=name, plan=plan, us=us))
        table(
            "gemm_w8a16_skinny by split (us per launch, weights rotated past L2; * the plan's)",
            ["model", "M", "product", "plan", "fastest", "every split"],
            rows,
        )

    if "sample" in run:
        # Sampling over the Llama 3 vocabulary.
        rows, results["sample"] = [], []
        for label, t, k, p in [
            ("greedy", 0.0, 0, 1.0),
            ("temperature 0.8", 0.8, 0, 1.0),
            ("top_k 50", 0.8, 50, 1.0),
            ("top_p 0.9", 0.8, 0, 0.9),
            ("top_k 50 + top_p 0.9", 0.8, 50, 0.9),
        ]:
            us = ops.time_sample(VOCAB, t, k, p, iters=args.iters)
            rows.append([label, str(VOCAB), f"{us:.2f}"])
            results["sample"].append(dict(mode=label, vocab=VOCAB, us=us))
        table("sample", ["mode", "vocab", "us"], rows)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
