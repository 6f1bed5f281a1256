"""Which products cost the FP8 prefill recipe its perplexity: the w8a8 recipe emulated on the CPU
reference (atomflow/model/reference.py, ReferenceModel.fp8_products) with every product's input
quantized, then with each product in turn left in 16 bits, against w8a16; llama-perplexity's windows,
every scored position's logits from one pass (atomflow/perplexity.py). No GPU: the recipe's arithmetic,
not the engine's bits (docs/design/gemm_w8a8_sm90.md compares the two).

    python tools/recipe_attribution.py [MODEL] --text FILE [--text FILE ...] [--ctx 512] [--max-windows N]
        [--groups 128,64,32,16]

--groups: instead of the products one by one, every product quantized with activation scales over groups
of each of these column counts (the recipe's is 128).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a .atomflow file (default: the default model)")
    ap.add_argument("--text", required=True, action="append", help="UTF-8 text file (repeatable: joined)")
    ap.add_argument("--ctx", type=int, default=512, help="window tokens (default 512)")
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--groups", default=None, help="comma-separated activation group sizes (columns per scale)")
    a = ap.parse_args(argv)
    try:
        groups = [int(g) for g in a.groups.split(",")] if a.groups else []
    except ValueError:
        ap.error(f"--groups takes comma-separated integers, got {a.groups!r}")
    if any(g < 1 for g in groups):
        ap.error("--groups: every group size must be >= 1")

    from atomflow.engine import Engine
    from atomflow.model.recipe import W8A8_MIN_ROWS
    from atomflow.model.reference import FP8_PRODUCTS
    from atomflow.perplexity import engine_logits_fn, read_text, score

    if a.ctx < W8A8_MIN_ROWS:
        ap.error(f"--ctx must be >= {W8A8_MIN_ROWS}: shorter calls keep 16 bits in the recipe")
    if a.model is None:
        from atomflow.model.default import default_model

        a.model = default_model(progress=False)
    eng = Engine.load(a.model, backend="cpu", max_context=a.ctx, verbose=False, prefill_recipe="w8a8")
    ref, logits_fn = eng.backend.ref, engine_logits_fn(eng)
    tokens = np.asarray(eng.tokenizer.encode(read_text(a.text), add_special_tokens=False), dtype=np.int64)

    group = ref.fp8_group
    variants = [("w8a16", (), group)]
    if groups:
        variants += [(f"w8a8, groups of {g} columns", FP8_PRODUCTS, g) for g in groups]
    else:
        variants += [("w8a8", FP8_PRODUCTS, group)]
        variants += [(f"w8a8, {p} in 16 bits", tuple(q for q in FP8_PRODUCTS if q != p), group) for p in FP8_PRODUCTS]
    rows, base = [], None
    for name, products, g in variants:
        ref.fp8_products, ref.fp8_group = frozenset(products), g
        r = score(name, tokens, a.ctx, None, logits_fn, max_windows=a.max_windows)
        base = base if base is not None else r.ppl
        rows.append((name, r.ppl, r.stderr, 100 * (r.ppl / base - 1), r.scored_tokens))
        print(f"{name}: ppl {r.ppl:.4f} +- {r.stderr:.4f} ({rows[-1][3]:+.2f}%), {r.scored_tokens} tokens scored", flush=True)
    print("\n| recipe | perplexity | against w8a16 |\n|---|---|---|")
    for name, ppl, err, change, _ in rows:
        print(f"| {name} | {ppl:.4f} +- {err:.4f} | {change:+.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
