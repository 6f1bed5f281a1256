"""`atomflow profile` without a GPU: the breakdown of synthetic profile entries, the bytes each
kernel group moves (from the file's shapes), the table and the plot."""

from __future__ import annotations

import pytest

from atomflow.bench.profile import LABELS, breakdown, format_table, kernel_bytes, per_layer, plot
from atomflow.model.fileformat import AtomflowFile

LAYER_US = {"gemv_qkv+norm+rope": 4.0, "attention": 6.0, "gemv_o": 3.0, "gemv_gate_up+norm": 8.0, "gemv_down": 5.0}
OTHER_US = {"lm_head": 20.0, "sample": 4.0}


def entries(steps: int, layers: int) -> list[tuple[str, int, float]]:
    """What Engine.profile_decode(mode="kernels") returns: launch order, one entry per group."""
    out = []
    for s in range(steps):
        for layer in range(layers):
            out += [(k, layer, v + 0.5 * s) for k, v in LAYER_US.items()]  # later steps a little slower
        out += [(k, -1, OTHER_US[k]) for k in ("lm_head", "sample")]
    return out


def test_breakdown():
    steps, layers = 4, 3
    nbytes = {"gemv_gate_up+norm": 8e6, "lm_head": 4e7}
    rows = breakdown(entries(steps, layers), steps, nbytes, bandwidth_gbs=4000.0)
    by = {r["label"]: r for r in rows}
    assert set(by) == set(LABELS)
    assert by["gemv_down"]["count_per_step"] == layers and by["lm_head"]["count_per_step"] == 1
    assert by["gemv_gate_up+norm"]["avg_us"] == pytest.approx(8.0 + 0.75)  # mean over steps 0..3
    assert by["gemv_gate_up+norm"]["step_us"] == pytest.approx(layers * 8.75)
    step = sum(OTHER_US.values()) + layers * sum(v + 0.75 for v in LAYER_US.values())
    assert sum(r["step_us"] for r in rows) == pytest.approx(step)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert by["lm_head"]["achieved_gbs"] == pytest.approx(4e7 / 20e3)  # bytes / ns = GB/s
    assert by["lm_head"]["efficiency"] == pytest.approx(2000 / 4000)
    assert by["sample"]["achieved_gbs"] is None  # no byte count given: no made-up rate
    assert [r["step_us"] for r in rows] == sorted((r["step_us"] for r in rows), reverse=True)
    layer_rows = per_layer(entries(steps, layers))
    assert len(layer_rows) == 5 * layers + 2
    assert {r["layer"] for r in layer_rows if r["label"] == "attention"} == set(range(layers))


def test_kernel_bytes_from_the_file(tiny_model_file):
    m = AtomflowFile(tiny_model_file)
    s, t = m.spec, m.tensors
    b = kernel_bytes(m, context=100)
    assert set(b) == set(LABELS) - {"sample"} | {"embedding"}  # the sampler's bytes depend on its settings
    wqkv = t["layers.0.wqkv"].nbytes + t["layers.0.wqkv.scale"].nbytes
    assert b["gemv_qkv+norm+rope"] >= wqkv and b["gemv_qkv+norm+rope"] - wqkv < 8 * (s.hidden_size + s.qkv_dim)
    assert b["gemv_gate_up+norm"] > t["layers.0.w13"].nbytes
    assert b["lm_head"] > t["lm_head"].nbytes
    kv = 2 * s.kv_dim * 2  # K and V rows of one layer
    assert kernel_bytes(m, context=1100)["attention"] - b["attention"] == pytest.approx(1000 * kv)
    assert b["embedding"] == s.hidden_size * 6


def fake_result(rows) -> dict:
    return dict(
        model="tiny.atomflow",
        device=dict(name="NVIDIA H200"),
        read_bandwidth_gbs=4500.0,
        context=128,
        steps=4,
        rows=rows,
        kernel_sum_us=sum(r["step_us"] for r in rows),
        eager_step_us=100.0,
        graph_step_us=90.0,
        tpot_ms=0.095,
        tpot_mode="graph",
        missing_labels=[],
    )


def test_table():
    rows = breakdown(entries(4, 3), 4, {"lm_head": 4e7}, 4500.0)
    text = format_table(fake_result(rows))
    for label in LABELS:
        assert label in text
    assert "NVIDIA H200" in text and "sum of kernels" in text and "eager step" in text
    assert "graph TPOT 0.095 ms" in text
    assert "warning" not in text


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "profile.png"
    plot(fake_result(breakdown(entries(2, 2), 2, {}, None)), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
