"""`atomflow sandbox ...`: the sandbox's subcommands. atomflow/cli.py wires them with one line:

    from atomflow.sandbox.cli import register; register(sub)

  atomflow sandbox bench [--model M.atomflow] [--parts attention,decode,memory,prefix] [--quick] ...
  atomflow sandbox test-blocks [--ops N] [--runs N] ...

Until then: python -m atomflow.sandbox.cli bench ... (the same arguments after `sandbox`).
"""

from __future__ import annotations

import json
import sys

QUICK = dict(contexts="1024,8192,32768", batches="1,8,64", block_sizes="16,128", iters=10, steps=16, prefix="16,1024,64,8")
FULL = dict(
    contexts="512,1024,2048,4096,8192,16384,32768",
    batches="1,2,4,8,16,32,64",
    block_sizes="16,32,64,128",
    iters=20,
    steps=32,
    prefix="32,1024,64,16",
)
# Llama-3.2-3B: 28 layers x 8 KV heads x 128 x (K, V) x 2 bytes, when no --model gives the spec.
KV_BYTES_3B = 28 * 8 * 128 * 2 * 2


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected a comma list of integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{what}: expected positive integers, got {text!r}")
    return vals


def cmd_bench(a) -> int:
    from atomflow.sandbox import bench as sbb
    from atomflow.sandbox.model import cuda_status

    d = QUICK if a.quick else FULL
    pick = lambda v, k: v if v is not None else d[k]  # noqa: E731
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = set(parts) - {"attention", "decode", "memory", "prefix"}
    if bad:
        raise ValueError(f"--parts: unknown {sorted(bad)} (attention, decode, memory, prefix)")
    lo, hi = _ints(a.lengths.replace(":", ","), "--lengths")
    contexts, batches = _ints(pick(a.contexts, "contexts"), "--contexts"), _ints(pick(a.batches, "batches"), "--batches")
    block_sizes = _ints(pick(a.block_sizes, "block_sizes"), "--block-sizes")
    n_req, sys_len, user_len, new = _ints(pick(a.prefix, "prefix"), "--prefix")
    iters, steps = pick(a.iters, "iters"), pick(a.steps, "steps")

    gpu, why = cuda_status()
    res: dict = dict(device=None, notes=[])
    if gpu:
        from atomflow.sandbox.model import ext

        name, total, _ = ext().device_info()
        res["device"] = dict(name=name, memory_gib=total / 2**30)
        res["ceiling_gbs"] = sbb.ceiling_gbs()
        print(f"device {name}, streaming-read ceiling {res['ceiling_gbs']:.0f} GB/s")
    else:
        res["notes"].append(f"no GPU ({why}): attention, decode and prefix timings are to be measured on a GPU")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    if "attention" in parts and gpu:
        log("attention: contiguous vs paged")
        res["attention"] = sbb.bench_attention(
            contexts, batches, block_sizes, iters=iters, scatter=not a.in_order, ceiling=res["ceiling_gbs"], log=log
        )
        print(sbb.format_attention(res["attention"]) + "\n")
    if "decode" in parts and gpu:
        if a.model is None:
            res["notes"].append("decode skipped: needs --model")
        else:
            log("decode: batched vs single-stream")
            res["decode"] = sbb.bench_decode(
                a.model, batches, lo, hi, block_sizes[0], steps, core=not a.no_core, ceiling=res["ceiling_gbs"], log=log
            )
            print(sbb.format_decode(res["decode"]) + "\n")
    if "memory" in parts:
        kvpt, src = KV_BYTES_3B, "Llama-3.2-3B shape"
        if a.model is not None:
            from atomflow.model.fileformat import AtomflowFile

            with AtomflowFile(a.model) as f:
                kvpt, src = f.spec.kv_bytes_per_token(), str(a.model)
        res["memory"] = sbb.bench_memory(kvpt, batches, a.max_context, lo, hi, block_sizes)
        res["memory"]["source"] = src
        print(sbb.format_memory(res["memory"]) + "\n")
    if "prefix" in parts:
        log("prefix: shared system prompt, cache off vs on")
        res["prefix"] = sbb.bench_prefix(a.model if gpu else None, n_req, sys_len, user_len, new, block_sizes[0], log=log)
        print(sbb.format_prefix(res["prefix"]) + "\n")
    if a.plots:
        for path in sbb.plot_all(res, a.plots):
            log(f"wrote {path}")
    for note in res["notes"]:
        print(f"note: {note}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=2, default=str)
        log(f"wrote {a.json}")
    return 0


def cmd_test_blocks(a) -> int:
    from atomflow.sandbox.selftest import stress_block_manager, stress_scheduler

    r = stress_block_manager(a.num_blocks, a.block_size, a.ops, a.seed, not a.no_prefix_caching)
    print(
        f"block manager: {a.ops} random operations on {a.num_blocks} blocks of {a.block_size}: "
        f"{r['allocate']} allocate, {r['append']} append, {r['fork']} fork, {r['free']} free, "
        f"{r['out_of_blocks']} clean out-of-blocks, {r['copies']} copy-on-write copies; "
        f"prefix hits {r['stats']['cached_tokens']} of {r['stats']['prompt_tokens']} prompt tokens, "
        f"{r['stats']['evictions']} evictions; every invariant held, nothing leaked"
    )
    s = stress_scheduler(a.runs, a.seed)
    print(
        f"scheduler: {a.runs} random workloads, {s['requests']} requests in {s['steps']} steps "
        f"({s['preemptions']} preemptions, {s['cached_tokens']} prefix-cached tokens, {s['cow_copies']} copies): "
        f"every request (forks included) equals single-stream generation"
    )
    return 0


def register(subparsers) -> None:
    """Adds `sandbox bench` and `sandbox test-blocks` to the atomflow command."""
    sp = subparsers.add_parser(
        "sandbox",
        help="paged KV + batching sandbox: measurements and self-tests",
        description="The sandbox (docs/SANDBOX.md): what paging and batching cost, and when they pay.",
    )
    sub = sp.add_subparsers(dest="sandbox_command", required=True)
    b = sub.add_parser(
        "bench",
        help="contiguous vs paged attention, batched vs single-stream decode, KV memory, "
        "prefix caching; tables + JSON (+ PNG plots)",
    )
    b.add_argument("--model", default=None, help=".atomflow file (decode and prefix timings need one; fp8 lm_head)")
    b.add_argument("--parts", default="attention,decode,memory,prefix", help="comma list of parts to run")
    b.add_argument("--quick", action="store_true", help="a smaller grid (a few minutes of GPU time at most)")
    b.add_argument("--contexts", default=None, help="attention: context lengths, comma list")
    b.add_argument("--batches", default=None, help="sequences per call, comma list (attention, decode, memory)")
    b.add_argument("--block-sizes", default=None, help="paged block sizes, comma list (the first one for decode)")
    b.add_argument("--lengths", default="128:2048", help="decode / memory: sequence lengths uniform in LO:HI")
    b.add_argument("--max-context", type=int, default=8192, help="memory: what contiguous preallocation reserves")
    b.add_argument("--iters", type=int, default=None, help="attention: timed batches of 10 calls")
    b.add_argument("--steps", type=int, default=None, help="decode: timed steps per batch size")
    b.add_argument("--prefix", default=None, help="prefix workload: REQUESTS,SYSTEM_TOKENS,USER_TOKENS,NEW_TOKENS")
    b.add_argument("--in-order", action="store_true", help="attention: paged blocks in order, not scattered")
    b.add_argument("--no-core", action="store_true", help="decode: skip the core engine's single-stream baseline")
    b.add_argument("--json", default=None, help="write every number here")
    b.add_argument("--plots", default=None, help="directory for PNG plots (needs matplotlib)")
    b.set_defaults(fn=cmd_bench)
    t = sub.add_parser("test-blocks", help="randomized self-test of the block manager and the scheduler (no GPU)")
    t.add_argument("--num-blocks", type=int, default=48)
    t.add_argument("--block-size", type=int, default=4)
    t.add_argument("--ops", type=int, default=20000, help="random block-manager operations")
    t.add_argument("--runs", type=int, default=50, help="random scheduler workloads")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--no-prefix-caching", action="store_true")
    t.set_defaults(fn=cmd_test_blocks)


def main(argv: list[str] | None = None) -> int:
    """`python -m atomflow.sandbox.cli bench ...` until atomflow/cli.py wires register()."""
    import argparse

    p = argparse.ArgumentParser(prog="atomflow")
    register(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(["sandbox"] + list(sys.argv[1:] if argv is None else argv))
    try:
        return a.fn(a)
    except (ValueError, RuntimeError, OSError) as e:
        print(
            f"atomflow sandbox: error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}", file=sys.stderr
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
