"""Speculative decoding on real prompts: each prompt of tools/speculate_prompts.json (copy-heavy, chat
that refers back, open-ended) generated greedily with and without --speculate on one engine loaded
for it, and (unless --no-default-run) a plain run on an engine loaded without it as a second reference.
Prints per kind: acceptance, tokens per step, tokens/s of each run and the speedups; checks that
the speculative tokens equal the plain ones (exit 1 if any prompt differs).

  python tools/speculate_bench.py [MODEL.atomflow] [--speculate ngram] [--config plain_run=1,...] [-n 256] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

from atomflow import Engine, SamplingParams
from atomflow.speculate import parse_speculate, with_keywords

PROMPTS = Path(__file__).with_name("speculate_prompts.json")


def encode(eng: Engine, item: dict) -> list[int]:
    if eng.tokenizer.has_chat_template:
        text = eng.tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True)
        return eng.tokenizer.encode(text, add_special_tokens=False)
    text = "\n\n".join(m["content"] for m in item["messages"])
    return eng.tokenizer.encode(text, add_special_tokens=True)


def timed(eng: Engine, ids: list[int], n: int, speculate: str, ignore_eos: bool) -> tuple[list[int], float]:
    """(tokens, seconds from the first token to the last)."""
    p = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=ignore_eos)
    list(eng.generate_tokens(ids, p, speculate=speculate))  # warm (and the same cache state each time)
    stamps, tokens = [], []
    for t in eng.generate_tokens(ids, p, speculate=speculate):
        stamps.append(time.perf_counter())
        tokens.append(t)
    return tokens, (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a .atomflow file (default: the default model)")
    ap.add_argument("--speculate", default="ngram")
    ap.add_argument("--config", default="", help="SpecConfig keywords over --speculate's, e.g. plain_run=1,n_min=1")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=256)
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--kinds", default="copy,chat,open")
    ap.add_argument("--stop-at-eos", action="store_true", help="stop at EOS (default: ignore it, N tokens each)")
    ap.add_argument("--no-default-run", action="store_true", help="skip the default-precision plain run")
    ap.add_argument("--json", default=None, help="write every run here")
    a = ap.parse_args(argv)
    try:
        spec = parse_speculate(a.speculate)
        if spec is None:
            raise ValueError("speculation is off")
        spec = with_keywords(spec, a.config)
    except (ValueError, TypeError) as e:
        ap.error(f"bad --speculate or --config: {e}")
    if a.model is None:
        from atomflow.model.default import default_model

        a.model = str(default_model())
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    kinds = [k for k in a.kinds.split(",") if k]
    ignore_eos = not a.stop_at_eos

    default_tps: dict[tuple[str, int], float] = {}
    if not a.no_default_run:  # the engine as users run it without --speculate (fp16 activations on CUDA)
        eng = Engine.load(a.model, backend=a.backend, max_context=a.max_context)
        for kind in kinds:
            for i, item in enumerate(prompts[kind]):
                toks, s = timed(eng, encode(eng, item), a.max_new_tokens, "off", ignore_eos)
                default_tps[(kind, i)] = (len(toks) - 1) / s
        del eng
        gc.collect()

    eng = Engine.load(a.model, backend=a.backend, max_context=a.max_context, speculate=spec)
    runs, mismatches = [], 0
    for kind in kinds:
        for i, item in enumerate(prompts[kind]):
            ids = encode(eng, item)
            plain, s_plain = timed(eng, ids, a.max_new_tokens, "off", ignore_eos)
            got, s_spec = timed(eng, ids, a.max_new_tokens, spec, ignore_eos)
            st = eng.stats.speculation
            same = plain == got
            mismatches += not same
            runs.append(
                dict(
                    kind=kind,
                    prompt=i,
                    prompt_tokens=len(ids),
                    tokens=len(got),
                    equal=same,
                    first_diff=None if same else next((j for j, (x, y) in enumerate(zip(plain, got)) if x != y), None),
                    plain_tps=(len(plain) - 1) / s_plain,
                    spec_tps=(len(got) - 1) / s_spec,
                    default_tps=default_tps.get((kind, i)),
                    drafted=st.drafted,
                    accepted=st.accepted,
                    verify_steps=st.verify_steps,
                    plain_steps=st.plain_steps,
                    tokens_per_step=st.tokens_per_step,
                    verify_ms=st.verify_ms,
                    pauses=st.pauses,
                )
            )
            print(f"{kind}[{i}]: {runs[-1]}", file=sys.stderr)

    print(f"\n{a.model} | backend {eng.backend_name} | --speculate {spec} {a.config} | {a.max_new_tokens} tokens per prompt\n")
    print(
        "| kind | prompts | acceptance | tokens/step | verify ms | plain t/s | speculative t/s | speedup "
        "| default t/s | speedup vs default | equal |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for kind in kinds:
        rs = [r for r in runs if r["kind"] == kind]
        drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
        steps = sum(r["verify_steps"] + r["plain_steps"] for r in rs)
        tps_plain = float(np.mean([r["plain_tps"] for r in rs]))
        tps_spec = float(np.mean([r["spec_tps"] for r in rs]))
        dflt = [r["default_tps"] for r in rs if r["default_tps"]]
        tps_default = float(np.mean(dflt)) if dflt else float("nan")
        verify = [r["verify_ms"] for r in rs if r["verify_steps"]]
        print(
            f"| {kind} | {len(rs)} | {100 * accepted / max(drafted, 1):.0f}% | "
            f"{(accepted + steps) / max(steps, 1):.2f} | {np.mean(verify) if verify else float('nan'):.3f} | "
            f"{tps_plain:.1f} | {tps_spec:.1f} | {tps_spec / tps_plain:.2f}x | {tps_default:.1f} | "
            f"{tps_spec / tps_default:.2f}x | {sum(r['equal'] for r in rs)}/{len(rs)} |"
        )
    print(
        "\nspeedup: mean speculative t/s / mean plain t/s on the same engine; vs default: against an engine "
        "loaded without --speculate (the same activations: the two plain rates should agree)."
    )
    if a.json:
        Path(a.json).write_text(json.dumps(dict(model=str(a.model), speculate=str(spec), config=a.config, runs=runs), indent=1))
    if mismatches:
        print(f"speculate_bench: {mismatches} prompt(s) generated other tokens with speculation", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
