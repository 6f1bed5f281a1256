"""The default prompt chunk (step_plan.h, StepPlan::prefill_chunk_for, through _core.prefill_chunk_for): no GPU
needed.

The plan takes, of 2048 and 4096 rows, the chunk that puts more of a layer's product FLOPs on the sm90 GEMM's
256-token tile (kernels.h sm90_tile_for on the GPU's SMs; ~10% less time per FLOP than the 128-token tile when
its waves are full), the smaller on a tie. MEASURED holds the chunk that prefilled long prompts faster on an H100
(`python tools/prefill_profile.py MODEL -p 8192,16384|32768 --chunk 2048,4096`, docs/perf-log.md 2026-11-28 a):
the rule must pick each of them at the H100's 132 SMs."""

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


def chunk_for(p, sms):
    return _core.prefill_chunk_for(p.hidden, p.intermediate, p.heads, p.kv_heads, p.head_dim, sms)


@pytest.mark.parametrize("model", MEASURED)
def test_default_chunk_is_the_measured_faster_one(model):
    assert chunk_for(load_tool("make_tiny_model").PRESETS[model], H100_SMS) == MEASURED[model]


def xwide_flops(rows, p, sms):
    """A layer's product FLOPs (N x K of each launch; SwiGLU two of F rows or one of 2F, by
    ops.sm90_swiglu_halves) that sm90_tile_for puts on the 256-token tile, by the rules' own bindings: a
    second reading of the rule the plan's C++ applies."""
    q_dim, kv_dim = p.heads * p.head_dim, 2 * p.kv_heads * p.head_dim
    F = p.intermediate
    swiglu = [(F, p.hidden)] * 2 if ops.sm90_swiglu_halves(rows, F, sms) else [(2 * F, p.hidden)]
    products = [(q_dim + kv_dim, p.hidden), (p.hidden, q_dim), *swiglu, (p.hidden, p.intermediate)]
    return sum(n * k for n, k in products if ops.sm90_tile_for(rows, n, sms) == "xwide")


@pytest.mark.parametrize("sms", [66, 78, 114, 132])
@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.2-3b", "qwen2.5-7b", "llama-3.1-8b", "qwen3-8b", "tiny-tail"])
def test_chunk_is_the_one_with_more_flops_on_the_256_token_tile(model, sms):
    p = load_tool("make_tiny_model").PRESETS[model]
    small, large = xwide_flops(2048, p, sms), xwide_flops(4096, p, sms)
    assert chunk_for(p, sms) == (4096 if large > small else 2048), f"{model} at {sms} SMs: {small} / {large}"


def test_the_rule_depends_on_the_sm_count():
    """Not a table by width: the 3B's chunk moves with the GPU's SMs (its products' waves of tiles)."""
    p = load_tool("make_tiny_model").PRESETS["llama-3.2-3b"]
    assert len({chunk_for(p, sms) for sms in range(16, 264, 2)}) == 2


def test_rejects_sizes_below_one():
    p = load_tool("make_tiny_model").PRESETS["llama-3.2-3b"]
    with pytest.raises(Exception, match="every size and sm_count must be >= 1"):
        _core.prefill_chunk_for(p.hidden, p.intermediate, p.heads, p.kv_heads, p.head_dim, 0)
    with pytest.raises(Exception, match="every size and sm_count must be >= 1"):
        _core.prefill_chunk_for(0, p.intermediate, p.heads, p.kv_heads, p.head_dim, H100_SMS)
