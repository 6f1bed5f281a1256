"""Decode timing and efficiency: bytes a token must move / TPOT / the read bandwidth measured in
the same process by a streaming-read kernel. The one ratio that means something on any GPU."""
from __future__ import annotations

import time

import numpy as np

from .engine import Engine
from .sampling import SamplingParams


def read_bandwidth_gbs(n_bytes: int = 2 << 30, iters: int = 20) -> float:
    """Median GB/s of the streaming-read kernel over a buffer much larger than L2."""
    from . import _core
    return float(_core.ops.stream_read_bandwidth(n_bytes, iters))


def bytes_per_token(eng: Engine, context: float) -> float:
    """Weights at their stored precision (+ scales, norms; one embedding row) + the KV cache read
    at `context` tokens + the new token's K and V written."""
    s = eng.spec
    kv_row = 2 * s.num_layers * s.kv_dim * 2  # K and V, bf16, all layers
    return eng.model.weight_bytes + s.hidden_size * 2 + kv_row * context + kv_row


def decode_benchmark(eng: Engine, prompt_len: int = 128, gen_tokens: int = 256, seed: int = 0,
                     bandwidth_gbs: float | None = None) -> dict:
    """Greedy decode of `gen_tokens` after a random `prompt_len`-token prompt (EOS ignored).
    TPOT = intervals between consecutive tokens as the host receives them (steady state)."""
    ids = np.random.default_rng(seed).integers(0, eng.spec.vocab_size, prompt_len).astype(np.int32)
    params = SamplingParams(temperature=0.0, max_new_tokens=gen_tokens, ignore_eos=True)
    list(eng.generate_tokens(ids, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)))  # warm-up
    stamps = []
    t0 = time.perf_counter()
    for _ in eng.generate_tokens(ids, params):
        stamps.append(time.perf_counter())
    gaps = np.diff(np.array(stamps)) * 1e3
    tpot = float(np.median(gaps))
    nbytes = bytes_per_token(eng, prompt_len + gen_tokens / 2)
    out = dict(prompt_tokens=prompt_len, generated_tokens=len(stamps), ttft_ms=(stamps[0] - t0) * 1e3,
               tpot_ms_p50=tpot, tpot_ms_p90=float(np.percentile(gaps, 90)),
               tpot_ms_p99=float(np.percentile(gaps, 99)), tokens_per_s=1e3 / tpot,
               bytes_per_token=nbytes, achieved_gbs=nbytes / tpot / 1e6)
    if bandwidth_gbs:
        out.update(read_bandwidth_gbs=bandwidth_gbs, efficiency=out["achieved_gbs"] / bandwidth_gbs)
    return out
