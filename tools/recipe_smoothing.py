"""Would smoothing the activations into the weights (SmoothQuant) let the FP8 prefill recipe keep
W8A16's perplexity? On the CPU reference (atomflow/model/reference.py): per product input channel j,
s_j = amax(x_j)^alpha / amax(W[:, j])^(1 - alpha) from a calibration text's activations; x / s folds
into what makes x (the RMSNorm weights for qkv and gate_up, V's rows for o, up's rows for down), W * s
is requantized to FP8 per row per 128 columns as the quantizer does. Then perplexity with w8a16 and w8a8
on the smoothed weights, against w8a16 on the file's (llama-perplexity's windows, atomflow/perplexity.py).
An estimate of the recipe's arithmetic, not the engine's bits.

    python tools/recipe_smoothing.py [MODEL] --calib tools/corpus.txt --text FILE [...] [--alpha 0.5]
        [--ctx 512] [--max-windows N]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a .atomflow file (default: the default model)")
    ap.add_argument("--calib", required=True, help="UTF-8 calibration text (its activations set s)")
    ap.add_argument("--text", required=True, action="append", help="UTF-8 text file to score (repeatable)")
    ap.add_argument("--alpha", type=float, action="append", help="migration strength (repeatable; default 0.5)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None)
    a = ap.parse_args(argv)

    import ml_dtypes

    from atomflow.engine import Engine
    from atomflow.model import reference as R
    from atomflow.model.fileformat import dequantize_rows
    from atomflow.model.quantize import quantize_rows
    from atomflow.perplexity import engine_logits_fn, read_text, score

    if a.model is None:
        from atomflow.model.default import default_model

        a.model = default_model(progress=False)
    ctx = max(a.ctx, R.W8A8_MIN_ROWS)
    eng = Engine.load(a.model, backend="cpu", max_context=ctx, verbose=False, prefill_recipe="w8a8")
    ref, logits_fn, tok, spec = eng.backend.ref, engine_logits_fn(eng), eng.tokenizer, eng.spec
    original = [dict(L) for L in ref.layers]

    # Per layer and product, each input channel's largest magnitude over the calibration text (the
    # products' inputs in call order: per chunk, per layer, qkv / o / gate_up / down).
    amax = [{p: 0.0 for p in R.FP8_PRODUCTS} for _ in original]
    calls = [0]
    quantize = R.quantize_fp8_rows

    def record(v: np.ndarray, group: int = R.FP8_GROUP) -> np.ndarray:  # the quantizer's signature
        k = calls[0]
        calls[0] += 1
        p, i = R.FP8_PRODUCTS[k % 4], (k // 4) % spec.num_layers
        amax[i][p] = np.maximum(amax[i][p], np.abs(v).max(axis=0))
        return v

    ids = np.asarray(tok.encode(read_text([a.calib]), add_special_tokens=False), dtype=np.int64)
    R.quantize_fp8_rows = record
    try:
        for s0 in range(0, len(ids) - R.W8A8_MIN_ROWS + 1, ctx):
            ref.pos = 0
            ref.forward(ids[s0 : s0 + ctx])
    finally:
        R.quantize_fp8_rows = quantize

    def requant(w: np.ndarray) -> np.ndarray:
        return dequantize_rows(*quantize_rows(w.astype(np.float32)))

    def bf16(x: np.ndarray) -> np.ndarray:  # the norm weights are stored in bf16
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)

    def factors(x_amax: np.ndarray, w: np.ndarray, alpha: float) -> np.ndarray:
        w_amax = np.abs(w).max(axis=0)
        s = np.power(np.maximum(x_amax, 1e-5), alpha) / np.power(np.maximum(w_amax, 1e-5), 1 - alpha)
        return np.clip(s, 1e-3, 1e3).astype(np.float32)

    G, D, qd, kvd, f = spec.group_size, spec.head_dim, spec.q_dim, spec.kv_dim, spec.intermediate_size

    def smooth(alpha: float) -> None:
        for L0, L, st in zip(original, ref.layers, amax):
            s = factors(st["qkv"], L0["wqkv"], alpha)
            # o's input channel (query head hq, dim j) comes from V's row (kv head hq // G, j): one s per
            # V row, the largest of its query heads' channels.
            xo = st["o"].reshape(spec.num_kv_heads, G, D).max(axis=1)
            wo = np.abs(L0["wo"]).max(axis=0).reshape(spec.num_kv_heads, G, D).max(axis=1)
            sv = factors(xo.reshape(-1), wo.reshape(1, -1), alpha)  # [kv_dim]
            so = np.repeat(sv.reshape(spec.num_kv_heads, 1, D), G, axis=1).reshape(-1)  # [q_dim]
            wqkv = L0["wqkv"] * s
            wqkv[qd + kvd :] /= sv[:, None]
            L["attn_norm"], L["wqkv"] = bf16(L0["attn_norm"] / s), requant(wqkv)
            if "bqkv" in L0:
                L["bqkv"] = L0["bqkv"].copy()
                L["bqkv"][qd + kvd :] /= sv
            L["wo"] = requant(L0["wo"] * so)
            s = factors(st["gate_up"], L0["w13"], alpha)
            L["mlp_norm"], w13 = bf16(L0["mlp_norm"] / s), L0["w13"] * s
            sd = factors(st["down"], L0["w2"], alpha)
            w13[f:] /= sd[:, None]  # up's rows: SwiGLU's output is linear in up
            L["w13"], L["w2"] = requant(w13), requant(L0["w2"] * sd)

    tokens = np.asarray(tok.encode(read_text(a.text), add_special_tokens=False), dtype=np.int64)

    def run(name: str, products) -> float:
        ref.fp8_products = frozenset(products)
        r = score(name, tokens, a.ctx, None, logits_fn, max_windows=a.max_windows)
        print(f"{name}: ppl {r.ppl:.4f} +- {r.stderr:.4f}, {r.scored_tokens} tokens scored", flush=True)
        return r.ppl

    base = run("w8a16", ())
    rows = [("w8a16", base), ("w8a8", run("w8a8", R.FP8_PRODUCTS))]
    for alpha in a.alpha or [0.5]:
        smooth(alpha)
        rows.append((f"smoothed (alpha {alpha}), w8a16", run(f"smoothed {alpha}, w8a16", ())))
        rows.append((f"smoothed (alpha {alpha}), w8a8", run(f"smoothed {alpha}, w8a8", R.FP8_PRODUCTS)))
    print("\n| weights, recipe | perplexity | against w8a16 |\n|---|---|---|")
    for name, ppl in rows:
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
