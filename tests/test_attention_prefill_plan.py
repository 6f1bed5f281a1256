"""The prefill attention's plan (kernels.h plan_attention_prefill, through ops.attention_prefill_plan with
sm_count given): no GPU needed. A chunk deep in a context splits the wgmma kernel's key tiles where the split
blocks' waves and the merge cost less than one pass; its partials must fit the scratch the engine reserves
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


def split_cost(blocks, key_tiles, splits, sms):
    """kernels.h prefill_attn_split_cost, in 1 / (2 sms) of one block's pass over a key tile."""
    waves, run = -(-blocks * splits // sms), -(-key_tiles // splits)
    if splits == 1:
        return 2 * sms * waves * run
    return 2 * sms * waves * (run + 1) + 2 * splits * blocks + sms


def want_splits(blocks, key_tiles, sms):
    """The fewest splits of the least cost: at most 32, two key tiles a split, four waves of split blocks."""
    best, pick = split_cost(blocks, key_tiles, 1, sms), 1
    for s in range(2, 33):
        if 2 * s > key_tiles or blocks * s > 4 * sms:
            break
        c = split_cost(blocks, key_tiles, s, sms)
        if c < best:
            best, pick = c, s
    return pick


@pytest.mark.parametrize("sms", [78, 114, 132])
def test_splits_follow_the_cost_and_fit_the_scratch(sms):
    cap = ops.attention_prefill_scratch_max(128, sms)
    assert cap == 4 * sms * 128 * (128 + 2) * 4  # four waves of 128-row blocks: fp32 O, max and sum a row
    for H, Hkv in SHAPES:
        for M in ROWS:
            for prior in PRIORS:
                p = ops.attention_prefill_plan(M, H, Hkv, 128, prior=prior, sm_count=sms)
                what = f"M={M} prior={prior} H={H} Hkv={Hkv} sms={sms}: {p}"
                key_tiles = math.ceil((prior + M) / 128)  # of the chunk's last block
                assert p["blocks"] == math.ceil(M * (H // Hkv) / 128) * Hkv, what
                assert p["splits"] == want_splits(p["blocks"], key_tiles, sms), what
                if p["splits"] > 1:  # two key tiles a split at least, at most four waves of blocks
                    assert 2 * p["splits"] <= key_tiles and p["blocks"] * p["splits"] <= 4 * sms, what
                    assert p["kernel"] == f"attention_prefill_wgmma<D=128> x {p['splits']} splits", what
                assert (p["scratch_bytes"] == 0) == (p["splits"] == 1), what
                assert p["scratch_bytes"] <= cap, what


# The fastest split count measured on an H200 (132 SMs; `ops.time_attention_prefill(M, prior, H, 8, 128,
# kernel="wgmma", splits=s)`, docs/design/attention_prefill.md "Splits") and the plan's pick, where they
# agree or the pick is within 3.5% of it: (H, M, prior) -> pick
MEASURED_PICKS = {
    (24, 64, 512): 2,
    (24, 128, 4096): 5,
    (24, 256, 4096): 5,
    (24, 512, 4096): 4,
    (24, 512, 16384): 4,
    (24, 512, 512): 1,
    (24, 1024, 4096): 2,
    (24, 1024, 16384): 2,
    (24, 64, 16384): 8,
    (32, 128, 4096): 4,
    (32, 256, 16384): 2,
    (32, 384, 4096): 4,
    (32, 512, 4096): 1,
    (32, 768, 4096): 2,
    (32, 1024, 4096): 1,
}


def test_splits_on_a_132_sm_gpu():
    """The 3B's and 8B's attention (24 and 32 / 8 heads) on 132 SMs: the measured fastest splits; 32 rows
    after 4096 keys are 8 blocks over 33 key tiles, 11 runs of 3; any chunk at the start, none."""
    plan = lambda H, M, prior: ops.attention_prefill_plan(M, H, 8, 128, prior=prior, sm_count=132)  # noqa: E731
    for (H, M, prior), splits in MEASURED_PICKS.items():
        assert plan(H, M, prior)["splits"] == splits, (H, M, prior)
    assert plan(24, 32, 4096)["splits"] == 11 and plan(24, 32, 4096)["blocks"] == 8
    for M in [2, 32, 512, 4096]:
        assert plan(24, M, 0)["splits"] == 1 and plan(32, M, 0)["splits"] == 1


def test_the_mma_kernel_never_splits():
    assert ops.attention_prefill_scratch_max(64, 132) == 0
    for M, prior in [(32, 4096), (64, 16384)]:
        p = ops.attention_prefill_plan(M, 8, 2, 64, prior=prior, sm_count=132)
        assert p["splits"] == 1 and p["scratch_bytes"] == 0 and p["kernel"].startswith("attention_prefill<D=64")
