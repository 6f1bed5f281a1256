"""gemm_w8a16_sm90's tile kind by chunk (kernels.h sm90_tile_for, through ops.sm90_tile_for): no GPU needed.

Past 256 rows the kind follows the product's waves of tiles over the SMs. The table is the H100's
measurement behind kSm90XWideTileCost (`python tools/bench_kernels.py --sections gemm_sm90 --rows
512,1024,2048`, docs/design/gemm_w8a16_sm90.md): of wide (128 tokens a tile) and xwide (256), the faster kind
of every 3B and 8B product, but the one product where the rule takes the other (3B gate_up at 512 rows,
xwide 5% slower)."""

from __future__ import annotations

import pytest

_core = pytest.importorskip("atomflow._core", reason="the CUDA core is not built")
ops = _core.ops

H100_SMS = 132

# (model, product, M, N, faster of wide / xwide on the H100 (us, two runs))
MEASURED = [
    ("3B", "qkv", 512, 5120, "xwide"),  # 50.7 / 41.7
    ("3B", "o", 512, 3072, "wide"),  # 27.9 / 37.1
    ("3B", "down", 512, 3072, "wide"),  # 61.7 / 95.0 (K 8192)
    ("3B", "qkv", 1024, 5120, "wide"),  # 72.0 / 75.9
    ("3B", "o", 1024, 3072, "xwide"),  # 50.9 / 42.8
    ("3B", "gate_up", 1024, 16384, "xwide"),  # 207.9 / 186.4
    ("3B", "qkv", 2048, 5120, "wide"),  # 116.9 / 117.5
    ("3B", "o", 2048, 3072, "wide"),  # 78.9 / 85.8
    ("3B", "gate_up", 2048, 16384, "xwide"),  # 401.6 / 354.6
    ("8B", "qkv", 512, 6144, "xwide"),  # 65.1 / 60.9
    ("8B", "o", 512, 4096, "wide"),  # 36.5 / 51.8
    ("8B", "gate_up", 512, 28672, "wide"),  # 225.7 / 247.2
    ("8B", "qkv", 1024, 6144, "wide"),  # 91.2 / 102.3
    ("8B", "o", 1024, 4096, "xwide"),  # 67.3 / 63.5
    ("8B", "gate_up", 1024, 28672, "xwide"),  # 434.3 / 397.3
    ("8B", "qkv", 2048, 6144, "xwide"),  # 170.7 / 151.8
    ("8B", "o", 2048, 4096, "xwide"),  # 123.6 / 112.7
    ("8B", "gate_up", 2048, 28672, "xwide"),  # 856.3 / 764.1
]


@pytest.mark.parametrize("model,product,M,N,faster", MEASURED)
def test_auto_takes_the_measured_faster_kind(model, product, M, N, faster):
    assert ops.sm90_tile_for(M, N, H100_SMS) == faster, f"{model} {product} at {M} rows"


def test_the_one_product_it_misses():
    """3B gate_up at 512 rows: 256 xwide tiles in two waves against 512 wide ones in four, so the rule
    takes xwide (measured 109.5 / 114.6 us, wide faster)."""
    assert ops.sm90_tile_for(512, 16384, H100_SMS) == "xwide"


@pytest.mark.parametrize("M", [1, 17, 64])
def test_short_chunks_take_narrow_streamk(M):
    for N in (576, 3072, 28672):
        assert ops.sm90_tile_for(M, N, H100_SMS) == "narrow-streamk"


@pytest.mark.parametrize("M", [65, 128, 256])
def test_mid_chunks_take_wide_streamk(M):
    for N in (576, 3072, 28672):
        assert ops.sm90_tile_for(M, N, H100_SMS) == "wide-streamk"


def test_the_waves_follow_the_sm_count():
    """A product whose wide tiles fill whole waves keeps wide; with fewer SMs the same tiles spill into a
    partial wave that xwide's halved count avoids."""
    assert ops.sm90_tile_for(1024, 3072, H100_SMS) == "xwide"  # 192 wide tiles: 2 waves; 96 xwide: 1
    assert ops.sm90_tile_for(1024, 3072, 192) == "wide"  # 1 wave either way
    with pytest.raises(ValueError):
        ops.sm90_tile_for(0, 3072, H100_SMS)


# SwiGLU as two launches of F rows or one of 2F (kernels.h sm90_swiglu_halves), H100, the engine with the
# halves always taken against one launch always (perf-log 2026-11-28 c): `python tools/prefill_profile.py MODEL -p
# 512,8192`, GEMM + swiglu_rows kernels in ms, and `atomflow bench MODEL -p 768,1024,2048 -n 0 -r 3`, TTFT in ms
# (two rounds each). (model, M, F, halves measured faster)
SWIGLU_MEASURED = [
    ("3B", 512, 8192, False),  # kernels 6.05 / 6.29: a half is 128 xwide tiles, one partial wave
    ("3B", 768, 8192, False),  # 10.18-10.30 / 10.68-10.81: the halves on wide tiles, one launch on xwide
    ("3B", 1024, 8192, True),  # 13.44-13.47 / 12.91-13.17
    ("3B", 2048, 8192, True),  # 26.98-27.34 / 26.46-26.72
    ("3B", 4096, 8192, True),  # kernels of pp8192 in 4096-row chunks 79.3 / 76.2
    ("8B", 512, 14336, True),  # kernels 13.42 / 13.19 (224 xwide tiles a half)
    ("8B", 768, 14336, True),  # 23.54-23.73 / 22.94-22.96
    ("8B", 1024, 14336, False),  # 27.98-28.14 / 30.09-30.13: the halves on wide tiles, one launch on xwide
    ("8B", 2048, 14336, True),  # 55.29-55.43 / 54.32-54.37; kernels of pp8192 in 2048-row chunks 189.4 / 182.5
]


@pytest.mark.parametrize("model,M,F,halves", SWIGLU_MEASURED)
def test_swiglu_runs_the_measured_faster_way(model, M, F, halves):
    assert ops.sm90_swiglu_halves(M, F, H100_SMS) == halves, f"{model} at {M} rows"


@pytest.mark.parametrize("M", [1, 64, 256])
def test_swiglu_of_stream_k_chunks_is_one_launch(M):
    for F in (1536, 8192, 14336):
        assert not ops.sm90_swiglu_halves(M, F, H100_SMS)
