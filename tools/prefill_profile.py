"""A prompt's prefill broken down by kernel, on the device: every kernel the engine launches during
Engine.prefill of P random tokens (from an empty cache), recorded by the CUDA profiling interface
through torch.profiler, summed by kernel family, next to the call's wall time without the profiler
(a wall time well above the kernels' sum: the host's launches are the bound). For each family:
launches, device time, share of the kernel time, and for the GEMM families TFLOP/s over the linear
layers' FLOPs (2 M N K per product, the head on the last row only). Needs torch (a tool, never the
engine). Kernels launched with programmatic dependent launch count their wait for the previous one.

    python tools/prefill_profile.py MODEL [-p 32,512,8192] [--chunk 1024] [--recipe w8a16,w8a8]
        [--option NAME=0|1 ...] [--reps 3] [--json OUT]

--chunk sets the engine's prefill chunk (rows per pass; the arena's activation buffers follow it),
so chunk sizes can be compared in one run: --chunk 256,512,1024 loads the model once per value.
--recipe w8a8 runs the sm90 chunks on the FP8 recipe (PlanOptions::prefill_fp8: activations quantized
per token per 128 columns); w8a16 is the default recipe. --option gemm_pdl=0 adds an engine with that plan
option after the default one, per recipe and chunk (a schedule's A/B in one process).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import numpy as np

# Kernel name -> family, first match wins (names as the profiler reports them, demangled).
FAMILIES = [
    ("gemm_sm90", r"cutlass|GemmUniversal|device_kernel"),
    ("act_quant", r"quantize_rows"),
    ("scale_transpose", r"scale_transpose"),
    ("swiglu_rows", r"swiglu_rows"),
    ("gemm_skinny", r"gemm_skinny"),
    ("gemm_w8a16", r"gemm_w8a16|gemm_kernel"),
    ("gemv_m", r"gemv_w8a16_m|gemv_m"),
    ("gemv", r"gemv"),
    ("attention_prefill", r"attention_prefill|prefill_attn"),
    ("attention", r"attention|attn|merge"),
    ("rope_kv_append", r"rope"),
    ("rmsnorm", r"rmsnorm"),
    ("embedding", r"embed"),
]


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name, re.IGNORECASE):
            return fam
    return "other: " + name[:60]


def device_us(e) -> float:
    """A kernel event's device time (the attribute's name changed across torch versions)."""
    for name in ("device_time_total", "cuda_time_total"):  # the first this torch has (the other warns)
        if hasattr(type(e), name) or hasattr(e, name):
            return float(getattr(e, name) or 0.0)
    return 0.0


def linear_flops(spec, rows: int) -> float:
    d, f = spec.hidden_size, spec.intermediate_size
    per_row = 2 * (d * spec.qkv_dim + spec.q_dim * d + d * 2 * f + f * d) * spec.num_layers
    return float(per_row * rows + 2 * d * spec.vocab_size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-p", "--prompts", default="32,512,8192", help="prompt lengths, comma-separated")
    ap.add_argument("--chunk", default="1024", help="prefill chunk rows, comma-separated (one engine each)")
    ap.add_argument("--recipe", default="w8a16", help="w8a16 and/or w8a8, comma-separated (one engine each)")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=0|1",
        help="a plan option (atomflow/backends/cuda.py PLAN_OPTIONS) for a second engine of each recipe and chunk, "
        "run after the default one: a same-call A/B (repeat for more engines)",
    )
    ap.add_argument("--reps", type=int, default=3, help="profiled prefills per prompt length (median per family)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    prompts = [int(x) for x in a.prompts.split(",")]
    chunks = [int(x) for x in a.chunk.split(",")]
    recipes = [r for r in a.recipe.split(",") if r]
    if set(recipes) - {"w8a16", "w8a8"}:
        ap.error(f"--recipe: w8a16 or w8a8, got {a.recipe}")
    from atomflow.backends.cuda import plan_option

    variants: list[dict[str, bool]] = [{}]
    for o in a.option:
        try:
            variants.append(dict([plan_option(o)]))
        except ValueError as e:
            ap.error(str(e))

    import torch
    from torch.profiler import ProfilerActivity, profile

    from atomflow.backends.cuda import _core_module, engine_options
    from atomflow.model.fileformat import AtomflowFile

    core = _core_module()
    model = AtomflowFile(a.model)
    spec = model.spec
    torch.zeros(1, device="cuda")  # the primary context, shared with the engine
    out = []
    for recipe, chunk, variant in [(r, c, v) for r in recipes for c in chunks for v in variants]:
        ctx = max(prompts) + 8
        label = ",".join(f"{k}={int(v)}" for k, v in variant.items()) or "default plan"
        eng = core.Engine(
            str(model.path),
            spec.to_dict(),
            model.tensor_table(),
            np.ascontiguousarray(spec.rope_inv_freq(), dtype=np.float32),
            ctx,
            prefill_chunk=chunk,
            verbose=False,
            **engine_options(prefill_fp8=recipe == "w8a8", **variant),
        )
        rng = np.random.default_rng(0)
        for p in prompts:
            ids = rng.integers(0, spec.vocab_size, p).astype(np.int32)
            eng.reset()
            eng.prefill(ids)  # warm
            plain = []  # without the profiler: the TTFT a user sees from this call
            for _ in range(max(a.reps, 5)):
                eng.reset()
                t0 = time.perf_counter()
                eng.prefill(ids)
                plain.append(time.perf_counter() - t0)
            walls, fams = [], []
            for _ in range(a.reps):
                eng.reset()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    t0 = time.perf_counter()
                    eng.prefill(ids)  # returns once the logits are on the host
                    walls.append(time.perf_counter() - t0)
                    torch.cuda.synchronize()
                sums: dict[str, list[float]] = {}
                for e in prof.events():
                    us = device_us(e)
                    if str(getattr(e, "device_type", "")).endswith("CUDA") and us > 0:
                        s = sums.setdefault(family(e.name), [0, 0.0])
                        s[0] += 1
                        s[1] += us
                fams.append(sums)
            names = sorted({k for s in fams for k in s})
            med = {k: float(np.median([s.get(k, [0, 0.0])[1] for s in fams])) for k in names}
            cnt = {k: max(s.get(k, [0, 0])[0] for s in fams) for k in names}
            total = sum(med.values())
            wall = 1e3 * float(np.median(walls))
            wall_plain = 1e3 * float(np.median(plain))
            flops = linear_flops(spec, p)
            gemm_us = sum(v for k, v in med.items() if k in ("gemm_sm90", "gemm_skinny", "gemm_w8a16", "gemv_m", "gemv"))
            print(
                f"\n{model.path.name} prefill {p} tokens, chunk {chunk}, {recipe}, {label}: "
                f"wall {wall_plain:.2f} ms ({wall:.2f} profiled), "
                f"kernels {total / 1e3:.2f} ms, "
                f"linears {flops / 1e12:.2f} TFLOP -> {flops / (gemm_us * 1e6) if gemm_us else 0:.0f} TFLOP/s in the products"
            )
            print(f"  {'family':<22}{'launches':>9}{'us':>11}{'share':>8}")
            for k in sorted(names, key=lambda k: -med[k]):
                print(f"  {k:<22}{cnt[k]:>9}{med[k]:>11.1f}{100 * med[k] / total:>7.1f}%")
            out.append(
                dict(
                    prompt=p,
                    chunk=chunk,
                    recipe=recipe,
                    options=variant,
                    wall_ms=wall_plain,
                    wall_profiled_ms=wall,
                    kernel_us=total,
                    families=med,
                    launches=cnt,
                    flops=flops,
                )
            )
        del eng
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model=str(model.path), device=torch.cuda.get_device_name(), rows=out), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
