"""What a speculative verify step costs against a decode step: for k = 1..8 drafts, the time of one
verify of k + 1 rows (the backend's verify(): the small-M chunk and the logits of every row, as
speculative decoding runs it) against the decode TPOT of the pipelined generate path, on one engine
loaded for speculation (the engine's default activations). Random token ids; the cache holds
--context tokens before each verify, rolled back after it.

    python tools/verify_cost.py MODEL [--context 256] [--reps 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--kmax", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from atomflow import Engine, SamplingParams

    eng = Engine.load(a.model, backend="cuda", max_context=a.context + 256, speculate="ngram")
    be = eng.backend
    rng = np.random.default_rng(0)
    vocab = eng.spec.vocab_size
    ids = rng.integers(0, vocab, a.context + 1).astype(np.int32)

    # Decode TPOT: the pipelined generate path (host-observed, as `atomflow bench` tg).
    params = SamplingParams(temperature=0, max_new_tokens=129, ignore_eos=True)
    list(eng.generate_tokens(ids, params, speculate="off"))
    stamps = [time.perf_counter() for _ in eng.generate_tokens(ids, params, speculate="off")]
    tpot = 1e3 * float(np.median(np.diff(stamps)))
    # One decode step waited for (Engine.decode: graph replay + logits to the host).
    eng.reset()
    eng.prefill(ids[:-1])
    dec = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        be.decode(int(ids[-1]))
        dec.append(time.perf_counter() - t0)
        be.rollback(a.context)
    decode_ms = 1e3 * float(np.median(dec))

    rows = []
    print(f"{eng.model.path.name}: decode TPOT (pipelined) {tpot:.3f} ms, one decode step waited for {decode_ms:.3f} ms")
    print(f"{'k':>3}{'rows':>6}{'verify ms':>11}{'x TPOT':>8}{'x step':>8}")
    for k in range(1, a.kmax + 1):
        chunk = rng.integers(0, vocab, k + 1).astype(np.int32)
        be.verify(chunk)  # warm
        be.rollback(a.context)
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            be.verify(chunk)
            ts.append(time.perf_counter() - t0)
            be.rollback(a.context)
        ms = 1e3 * float(np.median(ts))
        rows.append(dict(k=k, rows=k + 1, verify_ms=ms, x_tpot=ms / tpot, x_step=ms / decode_ms))
        print(f"{k:>3}{k + 1:>6}{ms:>11.3f}{ms / tpot:>8.2f}{ms / decode_ms:>8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model=str(eng.model.path), tpot_ms=tpot, decode_ms=decode_ms, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
