"""`atomflow bench` without a GPU: the options and tests they plan, the byte counts, the statistics
of a row, speedups, and the md / json / csv renderings of a synthetic result."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from atomflow.bench.bandwidth import dense_weight_bytes, prompt_bytes_per_token, token_bytes
from atomflow.bench.plan import BenchTest, check_fits_model, make_options
from atomflow.bench.report import CSV_COLUMNS, render
from atomflow.bench.result import SCHEMA, measured_row, skipped_row, speedups
from atomflow.model.spec import ModelSpec

LLAMA_3B = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)


# ----------------------------------------------------------------------------- options


def test_default_tests_are_llama_bench_ones():
    o = make_options("m.atomflow")
    assert [t.name for t in o.tests] == ["pp512", "tg128"]
    assert o.repetitions == 5 and o.output == "md" and o.max_context == 513


def test_lists_contexts_and_sizes():
    o = make_options("m", n_prompt="64,512", n_gen="32", context="4096,32768", repetitions="2")
    assert [t.name for t in o.tests] == [
        "pp64", "pp512", "tg32", "pp64@d4096", "pp512@d4096", "tg32@d4096", "pp64@d32768", "pp512@d32768", "tg32@d32768",
    ]  # fmt: skip
    assert o.max_context == 32768 + 512 + 1  # pp512@d32768: its prompt after the depth, and the generated token
    deep = o.tests[-1]
    assert deep.positions == 32800 and deep.mean_context == 32768 + 16
    assert o.tests[-2].positions == 32768 + 513 and o.tests[-2].depth == 32768
    only_pp = make_options("m", n_prompt="32", n_gen="0", context="4096")
    assert [t.name for t in only_pp.tests] == ["pp32", "pp32@d4096"]


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(n_prompt="-1"), "-p: -1 must be >= 0"),
        (dict(n_prompt="abc"), "-p: 'abc' is not an integer"),
        (dict(n_gen="1"), "-n: 1 generated token"),
        (dict(repetitions="0"), "-r: 0 must be >= 1"),
        (dict(repetitions="2,3"), "-r: one integer"),
        (dict(context="0"), "--context: 0 must be >= 1"),
        (dict(n_prompt="0", n_gen="0"), "nothing to run"),
        (dict(output="xml"), "-o: output format"),
        (dict(baselines=["gpt-fast"]), "unknown baseline 'gpt-fast'"),
    ],
)
def test_bad_options(kw, needle):
    with pytest.raises(ValueError, match=None) as e:
        make_options("m", **kw)
    assert needle in str(e.value)


def test_baselines_all_and_dedup():
    o = make_options("m", baselines=["hf", "all", "hf"])
    assert o.baselines == ("hf", "torch-compile", "torch-compile-int8", "torch-fp8", "vllm")


def test_compile_prefill_option():
    assert make_options("m").compile_prefill is True  # gpt-fast's --compile_prefill, by default
    assert make_options("m", compile_prefill=False).compile_prefill is False


def test_context_beyond_the_model():
    o = make_options("m", n_prompt="0", context="16384")
    with pytest.raises(ValueError, match="tg128@d16384 needs 16512 positions; the model supports 16384"):
        check_fits_model(o, 16384)
    with pytest.raises(ValueError, match="pp512@d16000 needs 16513 positions"):
        check_fits_model(make_options("m", context="16000"), 16384)
    check_fits_model(make_options("m", context="15800"), 16384)


# ----------------------------------------------------------------------------- bytes


def test_byte_counts_3b():
    spec = ModelSpec.from_hf_config(LLAMA_3B)
    bf16 = dense_weight_bytes(spec, "bf16")
    assert bf16 == pytest.approx(6.425e9, rel=2e-3)  # 3.21 B parameters, the tied head read as lm_head
    int8 = dense_weight_bytes(spec, "int8")
    assert int8 == pytest.approx(bf16 / 2, rel=2e-3)
    kv_row = 2 * 28 * 1024 * 2
    assert token_bytes(spec, 1000, 100) == 1000 + 3072 * 2 + kv_row * 101
    # one chunk: weights once, the head once, K/V written and read once per token
    one = prompt_bytes_per_token(spec, 1000, 200, 256, chunk=256)
    assert one == pytest.approx((1000 + 256 * 3072 * 2 + kv_row * 512) / 256)
    # two chunks: the layer weights twice, the head once; the second chunk reads 512 rows
    two = prompt_bytes_per_token(spec, 1000, 200, 512, chunk=256)
    assert two == pytest.approx((800 * 2 + 200 + 512 * 3072 * 2 + kv_row * (512 + 256 + 512)) / 512)


# ----------------------------------------------------------------------------- rows and result

PP, TG, DEEP = BenchTest("pp", 512, 0), BenchTest("tg", 0, 128), BenchTest("tg", 0, 128, 4096)


def test_row_statistics():
    gaps = [[1.0, 1.0, 2.0, 1.0], [1.0, 3.0, 1.0, 1.0]]
    r = measured_row("atomflow", TG, [1000.0, 800.0], tpot_ms=gaps, bytes_per_token=2e9, bandwidth_gbs=4000.0)
    assert r["status"] == "ok" and r["test"] == "tg128" and r["reason"] is None
    assert r["tokens_per_s_avg"] == 900.0 and r["tokens_per_s_std"] == pytest.approx(np.std([1000, 800], ddof=1))
    assert r["tpot_ms_p50"] == 1.0 and r["tpot_ms_p99"] == pytest.approx(np.percentile(sum(gaps, []), 99))
    assert r["achieved_gbs"] == pytest.approx(2000.0) and r["efficiency"] == pytest.approx(0.5)
    assert r["samples"]["tpot_ms"] == gaps and r["ttft_ms"] is None
    p = measured_row("atomflow", PP, [10000.0], ttft_ms=[60.0, 50.0], bytes_per_token=1e7, bandwidth_gbs=4000.0)
    assert p["tpot_ms_p50"] is None and p["ttft_ms"] == 55.0 and p["tokens_per_s_std"] == 0.0
    assert p["achieved_gbs"] == pytest.approx(1e7 * 1e4 / 1e9)


RECIPE = (
    "bfloat16; decode: torch.compile(mode=reduce-overhead, fullgraph, static shapes); "
    "prefill: torch.compile(fullgraph, dynamic shapes), SDPA flash"
)


def synthetic_result() -> dict:
    rows = [
        measured_row("atomflow", PP, [20000.0, 21000.0], ttft_ms=[25.0, 26.0], bytes_per_token=1e7, bandwidth_gbs=4500.0),
        measured_row(
            "atomflow", TG, [570.0, 580.0], tpot_ms=[[1.75] * 127, [1.72] * 127], bytes_per_token=3.34e9, bandwidth_gbs=4500.0
        ),
        measured_row("atomflow", DEEP, [500.0], tpot_ms=[[2.0] * 127], bytes_per_token=3.8e9, bandwidth_gbs=4500.0),
        measured_row("torch-compile", PP, [5000.0], ttft_ms=[100.0], recipe=RECIPE, prefill_compile_s=30.25),
        measured_row(
            "torch-compile",
            TG,
            [350.0],
            tpot_ms=[[2.8] * 127],
            bytes_per_token=6.4e9,
            bandwidth_gbs=4500.0,
            recipe=RECIPE,
            compile_s=41.0,
            cudagraph_skips=0,
        ),
        skipped_row("torch-compile", DEEP, "out of GPU memory"),
    ] + [skipped_row("vllm", t, "vllm is not importable (ModuleNotFoundError: No module named 'vllm')") for t in (PP, TG, DEEP)]
    return dict(
        schema=SCHEMA,
        date="2026-11-20 12:00:00",
        commit="abc1234",
        versions=dict(atomflow="0.1.0"),
        device=dict(name="NVIDIA H200"),
        read_bandwidth_gbs=4500.0,
        model=dict(name="llama-3.2-3b.atomflow", path="/m/llama-3.2-3b.atomflow"),
        options=dict(repetitions=2),
        tests=["pp512", "tg128", "tg128@d4096"],
        baselines=["torch-compile", "vllm"],
        rows=rows,
        speedups=speedups(rows),
    )


def test_speedups():
    ups = synthetic_result()["speedups"]
    assert {(u["baseline"], u["test"]) for u in ups} == {("torch-compile", "pp512"), ("torch-compile", "tg128")}
    tg = next(u for u in ups if u["test"] == "tg128")
    assert tg["speedup"] == pytest.approx(2.8 / 1.735) and tg["metric"] == "tpot_p50"
    pp = next(u for u in ups if u["test"] == "pp512")
    assert pp["speedup"] == pytest.approx(20500 / 5000)


def test_speedups_of_each_engine_of_ours():
    """With --prefill-fp8 the pp rows of "atomflow w8a8" get their own speedups and table; none of our
    engines is ever another's baseline, and the CSV's speedup column stays the default engine's."""
    result = synthetic_result()
    w8a8_row = measured_row("atomflow w8a8", PP, [25000.0], ttft_ms=[21.0], bytes_per_token=1e7, bandwidth_gbs=4500.0)
    rows = result["rows"] + [w8a8_row]
    ups = speedups(rows) + speedups(rows, "atomflow w8a8")
    assert {u["baseline"] for u in ups} == {"torch-compile"}
    w8a8 = [u for u in ups if u["ours"] == "atomflow w8a8"]
    assert [(u["test"], u["speedup"]) for u in w8a8] == [("pp512", pytest.approx(25000 / 5000))]
    md = render({**result, "rows": rows, "speedups": ups}, "md")
    assert "Speedup of atomflow (tg" in md and "Speedup of atomflow w8a8 (tg" in md
    assert "| torch-compile | 5.00x |" in md and "| torch-compile | 4.10x | 1.61x | - |" in md
    table = list(csv.DictReader(io.StringIO(render({**result, "rows": rows, "speedups": ups}, "csv"))))
    pp = next(r for r in table if r["engine"] == "torch-compile" and r["test"] == "pp512")
    assert float(pp["speedup"]) == pytest.approx(20500 / 5000)  # the default engine's, not w8a8's


def test_markdown():
    md = render(synthetic_result(), "md")
    assert "NVIDIA H200" in md and "4500 GB/s" in md and "commit abc1234" in md
    assert "| atomflow | tg128 | 575.00 ± 7.07 | 1.735 |" in md
    assert "| torch-compile | tg128@d4096 | skipped: out of GPU memory |" in md
    assert md.count("| vllm | all | skipped: vllm is not importable") == 1  # one line, not one per test
    assert "| torch-compile | 4.10x | 1.61x | - |" in md and "| vllm | - | - | - |" in md
    # how each baseline ran, once per engine, with its compile times; nothing for a skipped one
    assert md.count("- torch-compile: bfloat16; decode:") == 1 and "- vllm" not in md
    assert (
        "prefill: torch.compile(fullgraph, dynamic shapes), SDPA flash. Compile (untimed warm-up, compiles "
        "included): pp512: prefill 30.2 s; tg128: decode 41.0 s"
    ) in md


def test_json_round_trip():
    result = synthetic_result()
    back = json.loads(render(result, "json"))
    assert back == json.loads(json.dumps(result))
    tg = next(r for r in back["rows"] if r["engine"] == "atomflow" and r["test"] == "tg128")
    assert len(tg["samples"]["tpot_ms"]) == 2 and len(tg["samples"]["tpot_ms"][0]) == 127  # every sample kept


def test_csv():
    text = render(synthetic_result(), "csv")
    assert text.splitlines()[0] == ",".join(CSV_COLUMNS)
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == 9
    tc = next(r for r in rows if r["engine"] == "torch-compile" and r["test"] == "tg128")
    assert float(tc["speedup"]) == pytest.approx(2.8 / 1.735) and tc["gpu"] == "NVIDIA H200"
    skipped = next(r for r in rows if r["engine"] == "vllm" and r["test"] == "tg128")
    assert skipped["status"] == "skipped" and "vllm" in skipped["reason"] and skipped["tpot_ms_p50"] == ""
    assert tc["recipe"] == RECIPE and float(tc["compile_s"]) == 41.0 and tc["prefill_compile_s"] == ""


def test_unknown_format():
    with pytest.raises(ValueError, match="md, json or csv"):
        render(synthetic_result(), "xml")
