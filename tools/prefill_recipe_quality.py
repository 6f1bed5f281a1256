"""Perplexity of the two prefill recipes on real text: W8A16 (the default: activations in 16 bits) and
W8A8 (PlanOptions::prefill_fp8: activations quantized to FP8 per token per 128 columns), every scored
position's logits from prefill chunks (Engine.prefill_rows; --chunk rows each, default the window),
llama-perplexity's windows (atomflow/perplexity.py). The issue's bar for a W8A8 default: within 0.5% of W8A16.
--option NAME=0|1 adds a W8A16 engine with that plan option (a prompt's rounding, e.g. skinny_norm=0 with
--chunk 32: the skinny GEMM's RMSNorm launches against the split norm), against the default.

    python tools/prefill_recipe_quality.py MODEL --text tools/corpus.txt [--ctx 512] [--max-windows N]
        [--chunk 32] [--option NAME=0|1 ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=512, help="window tokens (even, <= 1024: one prefill chunk)")
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=None, help="rows a prefill chunk (default: the window)")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=0|1", help="another W8A16 engine's plan option")
    a = ap.parse_args(argv)
    if not 2 <= a.ctx <= 1024 or a.ctx % 2:
        ap.error("--ctx must be even and in [2, 1024]")
    chunk = a.chunk or a.ctx
    if not 1 <= chunk <= a.ctx:
        ap.error("--chunk must be in [1, ctx]")
    from atomflow.backends.cuda import plan_option

    variants = [("w8a16", {}), ("w8a8", {"prefill_fp8": True})]
    for o in a.option:
        try:
            variants.append((f"w8a16 {o}", dict([plan_option(o)])))
        except ValueError as e:
            ap.error(str(e))

    from atomflow.backends.cuda import CudaBackend
    from atomflow.model.fileformat import AtomflowFile
    from atomflow.perplexity import score

    model = AtomflowFile(a.model)
    tok = model.tokenizer()
    tokens = np.asarray(tok.encode(Path(a.text).read_text(), add_special_tokens=False), dtype=np.int64)
    results = {}
    for name, kw in variants:
        be = CudaBackend(model, a.ctx, verbose=False, prefill_chunk=chunk, f16_activations=False, **kw)

        def logits_fn(ids: np.ndarray, first: int, be=be) -> np.ndarray:
            be.reset()
            x = ids[:-1].astype(np.int32)  # row i predicts token i + 1
            rows = np.concatenate([be.engine.prefill_rows(x[c : c + chunk]) for c in range(0, len(x), chunk)])
            return rows[first - 1 :]

        results[name] = score(name, tokens, a.ctx, a.ctx // 2, logits_fn, max_windows=a.max_windows)
        r = results[name]
        print(f"{name}: ppl {r.ppl:.4f} +- {r.stderr:.4f} over {r.scored_tokens} tokens ({r.seconds:.1f} s)")
        del be
    for name in list(results)[1:]:
        ratio = results[name].ppl / results["w8a16"].ppl
        print(f"{name} / w8a16: {ratio:.5f} ({100 * (ratio - 1):+.3f}%; the bar for a default: within 0.5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
