"""What efficiency is measured against: the bytes a token must move, and the read bandwidth
measured in the same process by a streaming-read kernel. Efficiency = bytes / TPOT / bandwidth,
the one ratio that means something on any GPU (the timing loops are in engine.py).

The byte counts are the minimum traffic of each token, the same for every engine (ours and the
baselines of `atomflow bench`), so efficiencies compare: weights at their stored precision
(+ scales, norms, one embedding row) + the KV cache read at the context + the new K and V row.
"""

from __future__ import annotations

import numpy as np

from atomflow.model.spec import ModelSpec

# Rows per prefill pass where the backend does not say (CudaBackend.prefill_chunk does, the step plan's
# default for the model, StepPlan::prefill_chunk_for): the CPU backend's byte counts.
PREFILL_CHUNK = 2048


def read_bandwidth_gbs(n_bytes: int = 2 << 30, iters: int = 20) -> float:
    """Median GB/s of the streaming-read kernel over a buffer much larger than L2."""
    from atomflow import _core

    return float(_core.ops.stream_read_bandwidth(n_bytes, iters))


def kv_row_bytes(spec: ModelSpec) -> int:
    """K and V of one token, bf16, all layers."""
    return 2 * spec.num_layers * spec.kv_dim * 2


def token_bytes(spec: ModelSpec, weight_bytes: float, context: float) -> float:
    """One decode token: weights read once (weight_bytes: everything but the embedding table)
    + one embedding row + KV read at `context` keys + the new token's K and V written."""
    return weight_bytes + spec.hidden_size * 2 + kv_row_bytes(spec) * (context + 1)


def prompt_bytes_per_token(spec: ModelSpec, weight_bytes: float, head_bytes: float, n: int, chunk: int = PREFILL_CHUNK) -> float:
    """Prefill of n tokens in chunks: the layer weights once per chunk, the head (final norm +
    lm_head) once for the last row, each token's embedding row and K/V write, and each chunk's
    attention reading the cache up to its end. Divided by n. Prefill is compute-bound, so an
    efficiency from these bytes is a floor, not the measure of a prompt test."""
    chunks = -(-n // chunk)
    ends = np.minimum(np.arange(1, chunks + 1) * chunk, n)
    total = (
        (weight_bytes - head_bytes) * chunks
        + head_bytes
        + n * spec.hidden_size * 2
        + kv_row_bytes(spec) * (n + float(ends.sum()))
    )
    return total / n


def dense_weight_bytes(spec: ModelSpec, weight_dtype: str) -> int:
    """Weight bytes a decode step of an unquantized (bf16) or int8 weight-only model reads,
    counted like AtomflowFile.weight_bytes: every linear (lm_head included, tied or not) and the
    norms; int8 adds a bf16 scale per output row (gpt-fast's WeightOnlyInt8Linear)."""
    d, f, L = spec.hidden_size, spec.intermediate_size, spec.num_layers
    rows = L * (spec.qkv_dim + d + 2 * f + d) + spec.vocab_size  # output rows of every linear
    params = L * (d * spec.qkv_dim + spec.q_dim * d + 3 * d * f) + spec.vocab_size * d
    norms = (2 * L + 1) * d * 2
    if weight_dtype == "bf16":
        return params * 2 + norms
    if weight_dtype == "int8":
        return params + rows * 2 + norms
    raise ValueError(f"weight_dtype must be bf16 or int8, got {weight_dtype!r}")
