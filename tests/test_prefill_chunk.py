"""The default prompt chunk by the model's width (step_plan.h, StepPlan::prefill_chunk_for, through
_core.prefill_chunk_for): no GPU needed.

MEASURED holds the chunk that prefilled long prompts faster on an H100 (`python tools/prefill_profile.py MODEL -p
8192,16384|32768 --chunk 2048,4096`, docs/perf-log.md 2026-11-28 a). What moves it is which products the sm90 GEMM
runs on its 256-token tile (kernels.h sm90_tile_for, ~10% less time per FLOP than the 128-token tile when its waves
are full): the faster chunk is the one that puts more of a layer's FLOPs on it, the smaller on a tie."""

from __future__ import annotations

import pytest
from conftest import load_tool

_core = pytest.importorskip("atomflow._core", reason="the CUDA core is not built")
ops = _core.ops

H100_SMS = 132

# The chunk that prefilled long prompts faster, by preset (ms at 2048 / 4096 rows).
MEASURED = {
    "llama-3.2-1b": 4096,  # pp8192 64.08 / 62.63, pp16384 185.47 / 178.94
    "llama-3.2-3b": 4096,  # pp8192 133.81 / 125.57, pp32768 906.1 / 874.2
    "qwen2.5-7b": 2048,  # pp8192 236.26 / 251.24, pp16384 556.20 / 578.05
    "llama-3.1-8b": 2048,  # pp8192 261.43 / 266.27, pp32768 1614.0 / 1625.3
}


@pytest.mark.parametrize("model", MEASURED)
def test_default_chunk_is_the_measured_faster_one(model):
    assert _core.prefill_chunk_for(load_tool("make_tiny_model").PRESETS[model].hidden) == MEASURED[model]


def xwide_share(rows, p):
    """The share of a layer's product FLOPs (N x K each) that sm90_tile_for puts on the 256-token tile."""
    q_dim, kv_dim = p.heads * p.head_dim, 2 * p.kv_heads * p.head_dim
    products = [(q_dim + kv_dim, p.hidden), (p.hidden, q_dim), (2 * p.intermediate, p.hidden), (p.hidden, p.intermediate)]
    total = sum(n * k for n, k in products)
    return sum(n * k for n, k in products if ops.sm90_tile_for(rows, n, H100_SMS) == "xwide") / total


@pytest.mark.parametrize("model", MEASURED)
def test_the_faster_chunk_puts_more_flops_on_the_256_token_tile(model):
    p = load_tool("make_tiny_model").PRESETS[model]
    small, large = xwide_share(2048, p), xwide_share(4096, p)
    assert (4096 if large > small else 2048) == MEASURED[model], f"{model}: xwide share {small:.2f} at 2048, {large:.2f} at 4096"


def test_rejects_a_width_below_one():
    with pytest.raises(Exception, match="hidden_size must be >= 1"):
        _core.prefill_chunk_for(0)
