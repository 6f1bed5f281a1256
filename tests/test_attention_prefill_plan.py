"""The prefill attention's plan (kernels.h plan_attention_prefill, through ops.attention_prefill_plan with
sm_count given): no GPU needed. A short chunk deep in a context splits the wgmma kernel's key tiles over the
SMs its blocks leave idle; its partials must fit the scratch the engine reserves
(attention_prefill_scratch_max), whatever the chunk and the context."""

from __future__ import annotations

import math

import pytest

_core = pytest.importorskip("atomflow._core", reason="the CUDA core is not built")
ops = _core.ops

# (query heads, kv heads): the Llama 3 shapes, a 1-kv-head model, ratio 7 and 16
SHAPES = [(24, 8), (32, 8), (4, 1), (28, 4), (64, 8), (16, 1)]
ROWS = [1, 2, 5, 16, 31, 32, 33, 64, 100, 128, 255, 256, 511, 512, 1000, 2048, 4096]
PRIORS = [0, 1, 127, 128, 255, 256, 1000, 4096, 16384, 131072]


@pytest.mark.parametrize("sms", [78, 114, 132])
def test_splits_fill_the_idle_sms_and_fit_the_scratch(sms):
    cap = ops.attention_prefill_scratch_max(128, sms)
    assert cap == sms * 128 * (128 + 2) * 4  # the SMs' worth of 128-row blocks: fp32 O, max and sum a row
    for H, Hkv in SHAPES:
        for M in ROWS:
            for prior in PRIORS:
                p = ops.attention_prefill_plan(M, H, Hkv, 128, prior=prior, sm_count=sms)
                what = f"M={M} prior={prior} H={H} Hkv={Hkv} sms={sms}: {p}"
                key_tiles = math.ceil((prior + M) / 128)  # of the chunk's last block
                assert p["splits"] == max(1, min(32, key_tiles // 2, sms // p["blocks"])), what
                if p["splits"] > 1:  # two key tiles a split at least, never more blocks than SMs
                    assert 2 * p["splits"] <= key_tiles and p["blocks"] * p["splits"] <= sms, what
                    assert p["kernel"] == f"attention_prefill_wgmma<D=128> x {p['splits']} splits", what
                assert (p["scratch_bytes"] == 0) == (p["splits"] == 1), what
                assert p["scratch_bytes"] <= cap, what


def test_splits_on_an_h100():
    """The 3B's attention (24 / 8 heads) on 132 SMs: 32 rows after 4096 keys are 8 blocks over 33 key tiles
    (16 splits); 256 rows after 4096, 48 blocks (2); 512 rows or any chunk at the start, none."""
    plan = lambda M, prior: ops.attention_prefill_plan(M, 24, 8, 128, prior=prior, sm_count=132)  # noqa: E731
    assert plan(32, 4096)["splits"] == 16 and plan(32, 4096)["blocks"] == 8
    assert plan(256, 4096)["splits"] == 2
    assert plan(512, 4096)["splits"] == 1 and plan(32, 0)["splits"] == 1 and plan(4096, 0)["splits"] == 1


def test_the_mma_kernel_never_splits():
    assert ops.attention_prefill_scratch_max(64, 132) == 0
    for M, prior in [(32, 4096), (64, 16384)]:
        p = ops.attention_prefill_plan(M, 8, 2, 64, prior=prior, sm_count=132)
        assert p["splits"] == 1 and p["scratch_bytes"] == 0 and p["kernel"].startswith("attention_prefill<D=64")
