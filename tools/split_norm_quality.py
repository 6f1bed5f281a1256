"""What a prompt's RMSNorm rounding costs in perplexity, emulated on the CPU reference (no GPU): the reference's
fp32 norms against the CUDA prompt paths' roundings of the qkv / gate_up input, each scored on real text with
llama-perplexity's windows (atomflow/perplexity.py):

    f16    f16(x * r * w)          the rmsnorm launch (a prompt chunk's default before the split norm)
    split  bf16(x * w) * r         the skinny GEMM's split RMSNorm (PlanOptions::skinny_norm: the AddResidual
                                   product writes bf16(x * w), the next product scales its sums by r)
    bf16   bf16(x * r * w)

r = 1 / rms(x) in fp32; the final norm stays fp32 (the head's GEMV fuses its own). Everything else is the
reference's fp32.

    python tools/split_norm_quality.py [MODEL] [--text FILE ...] [--ctx 512] [--max-windows N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LICENSES = [f"/usr/share/common-licenses/{n}" for n in ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3")]


def rounding(kind: str, orig, skip):
    """rmsnorm(x, w, eps) with the norm's output rounded as `kind` says, except where skip(x, w)."""
    import ml_dtypes

    def norm(x, w, eps):
        if kind == "fp32" or skip(x, w):
            return orig(x, w, eps)
        if kind == "split":
            var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
            r = np.float32(1) / np.sqrt(var + np.float32(eps))
            return (x * w).astype(ml_dtypes.bfloat16).astype(np.float32) * r
        dtype = np.float16 if kind == "f16" else ml_dtypes.bfloat16
        return orig(x, w, eps).astype(dtype).astype(np.float32)

    return norm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a .atomflow file (default: the default model)")
    ap.add_argument("--text", action="append", default=None, help="text files (default: Debian's license texts)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None)
    a = ap.parse_args(argv)

    import atomflow.model.reference as ref_mod
    from atomflow import Engine
    from atomflow.model.default import default_model
    from atomflow.perplexity import engine_logits_fn, read_text, score

    eng = Engine.load(a.model or str(default_model()), backend="cpu", max_context=a.ctx)
    tokens = np.asarray(eng.tokenizer.encode(read_text(a.text or LICENSES)), np.int64)
    ref = eng.backend.ref
    d, final = ref.spec.hidden_size, ref.final_norm
    orig = ref_mod.rmsnorm
    results = {}
    try:
        for kind in ("fp32", "f16", "split", "bf16"):
            ref_mod.rmsnorm = rounding(kind, orig, lambda x, w: w is final or x.ndim != 2 or x.shape[-1] != d)
            r = results[kind] = score(kind, tokens, a.ctx, None, engine_logits_fn(eng), max_windows=a.max_windows)
            print(f"{kind:6s} ppl {r.ppl:.4f} +- {r.stderr:.4f} over {r.scored_tokens} tokens ({r.seconds:.0f} s)", flush=True)
    finally:
        ref_mod.rmsnorm = orig
    for kind in ("split", "bf16"):
        print(f"{kind} / f16: {100 * (results[kind].ppl / results['f16'].ppl - 1):+.4f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
