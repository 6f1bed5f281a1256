"""tools/trace_step.py's bookkeeping on made-up trace records (recording needs a trace build and a GPU)."""

import sys
from pathlib import Path

import numpy as np
import numpy.lib.recfunctions  # noqa: F401
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import trace_step  # noqa: E402

QKV, GATE_UP, ADD, HEAD = 3 | 2 << 4, 2 | 2 << 4, 1 | 0 << 4, 0 | 2 << 4  # Ep | In << 4 (In: 0 bf16, 2 norm)
ATTN = 0x100


def rec(kind, ident, stamps, K=3072, n=1, merged=False):
    r = np.zeros(1, trace_step.REC)
    r["kind"] = kind | (0x10 if merged else 0)
    r["id"], r["K"], r["n"] = ident, K, n
    for slot, t in stamps.items():
        r["t"][0, slot] = t
    return r


def gemv(kind, ident, t0, K=3072, n=1, warps=4):
    """warps records of one GEMV launch: entry t0, waited +1000, landed +1200, staged +1500, iterations
    every 500 ns from +2000, exit 200 ns after the last."""
    out = []
    for w in range(warps):
        s = {0: t0 + w, 2: t0 + 1000, 1: t0 + 1200, 3: t0 + 1500}
        for i in range(n):
            s[4 + i if i < 6 else 13] = t0 + 2000 + 500 * i
        s[15] = t0 + 2000 + 500 * (n - 1) + 200 + w
        out.append(rec(kind, ident, s, K=K, n=n))
    return out


def attention(ident, t0, blocks=3):
    out = [
        rec(
            ATTN,
            ident,
            {0: t0, 1: t0 + 10, 2: t0 + 400, 3: t0 + 600, 4: t0 + 700, 5: t0 + 900, 6: t0 + 1300 if b == 0 else 0},
            merged=b == 0,
        )
        for b in range(blocks)
    ]
    return out


def step(layers=4):
    recs, t = [], 0
    for layer in range(layers):
        recs += gemv(QKV, 100 + layer, t)
        recs += attention(100 + layer, t + 2500)  # same id as the qkv weights: a different family
        recs += gemv(ADD, 200 + layer, t + 4000)
        recs += gemv(GATE_UP, 300 + layer, t + 6000, n=3)
        recs += gemv(ADD, 400 + layer, t + 9000, K=8192, n=2)
        t += 12000
    recs += gemv(HEAD, 999, t, n=30)
    r = np.concatenate(recs)
    return np.lib.recfunctions.append_fields(r, "step", np.zeros(len(r), dtype=np.int64), usemask=False)


def test_launches_are_grouped_named_and_ordered():
    ls = trace_step.launches(step(layers=2))
    assert [l["name"] for l in ls] == ["qkv", "attention", "o", "gate_up", "down"] * 2 + ["lm_head"]
    assert [len(l["t"]) for l in ls[:5]] == [4, 3, 4, 4, 4]
    assert [l["first"] for l in ls[:5]] == [0, 2500, 4000, 6000, 9000]


def test_weight_bytes_per_iteration():
    ls = trace_step.launches(step(layers=1))
    by = {l["name"]: trace_step.weight_events(l) for l in ls if not l["attn"]}
    t, b = by["down"]  # K = 8192: two iterations of 2 x 4096 bytes per row pair
    assert list(b) == [8192] * 8 and sorted(set(t.tolist())) == [11000, 11500]
    t, b = by["o"]  # K = 3072: one iteration of 2 x 3072 bytes
    assert list(b) == [6144] * 4
    t, b = by["lm_head"]  # 30 iterations: the 24 past the 6 own slots are spread up to the last stamp
    assert b.sum() == 4 * 30 * 6144 and t.max() == 12000 + 2000 + 500 * 29


def test_layer_table_times_from_the_layers_qkv():
    names, med, span = trace_step.layer_table([trace_step.launches(step(layers=4))])
    assert names == ["qkv", "attention", "o", "gate_up", "down"]
    assert span == pytest.approx(12.0)
    qkv, attn, o, gate_up, down = med
    assert (qkv["entry"], qkv["waited"], qkv["landed"], qkv["staged"]) == pytest.approx((0.0, 1.0, 1.2, 1.5))
    assert qkv["exit"] == pytest.approx(2.2 + 0.003)
    assert (attn["entry"], attn["waited"], attn["staged"], attn["done"]) == pytest.approx((2.5, 2.9, 3.1, 3.8))
    assert down["done"] == pytest.approx(9.0 + 2.5 + 0.2 + 0.0015)


def test_attention_phases_by_blocks_per_sm():
    recs = step(layers=3)
    attn = (recs["kind"] & ATTN) != 0
    recs["smid"][attn] = np.tile([5, 5, 7], 3)  # blocks 0 and 1 of each launch share an SM
    ph = trace_step.attention_phases([trace_step.launches(recs)])
    assert sorted(ph) == [1, 2]
    assert ph[2]["waited>loop"] == pytest.approx(0.2) and ph[2]["loop>partial"] == pytest.approx(0.1)
    assert ph[2]["ticket>merged"] == pytest.approx(0.4)  # block 0 merges
    assert np.isnan(ph[1]["ticket>merged"])  # block 2 only exits


def test_exit_spread_after_the_median_wait():
    sp = trace_step.exit_spread([trace_step.launches(step(layers=4))])
    assert sorted(sp) == ["down", "gate_up", "o", "qkv"]
    # waited +1000, exit +2000 + 500 (n - 1) + 200 + w for warp w: down (n = 2) 1.7 us + w ns
    assert sp["down"]["q"][1] == pytest.approx(1.7 + 0.0015)
    assert sp["down"]["q"][3] == pytest.approx(1.7 + 0.003)
    assert sp["gate_up"]["by_n"] == {3: pytest.approx(2.2 + 0.0015)}


def test_split_steps_numbers_back_to_back_steps():
    """--pipelined: one trace of steps run back to back, numbered by the first layer's QKV launch."""
    one = step(layers=3)
    base = np.lib.recfunctions.drop_fields(one, "step", usemask=False)
    base["t"] = np.where(base["t"] > 0, base["t"] + np.uint64(1000), 0)
    base["t"][:, 0] = np.maximum(base["t"][:, 0], 1000)  # every record has an entry stamp (0: none)
    parts = []
    for k in range(3):
        r = base.copy()
        r["t"] = np.where(r["t"] > 0, r["t"] + np.uint64(k * 2_000_000), 0)
        parts.append(r)
    rng = np.random.default_rng(0)
    mixed = np.concatenate(parts)[rng.permutation(3 * len(base))]  # the trace's order is per SM, not by time
    got = trace_step.split_steps(mixed)
    assert np.bincount(got["step"]).tolist() == [len(base)] * 3
    for k in range(3):
        mine = got[got["step"] == k]
        assert mine["t"][:, 0].min() == 2_000_000 * k + 1000
        ls = trace_step.launches(mine)
        assert [l["name"] for l in ls] == ["qkv", "attention", "o", "gate_up", "down"] * 3 + ["lm_head"]
