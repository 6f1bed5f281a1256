"""The bench baselines without a GPU: the torch Llama of the torch-compile baselines against
Hugging Face transformers on the CPU (fp32: it must be the same model), its prefill path (KV heads
repeated, SDPA causal or masked) against its decode path, its int8 weight-only and FP8 variants
(the FP8 quantization math against a float reference, torch._scaled_mm as the CPU runs it), the
decoders' cache and position handling with prefill compiled, the recipe each row records, and
every skip path ('skipped: <reason>')."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from atomflow.bench import baselines
from atomflow.bench.plan import make_options

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32, attn_implementation="eager").eval()


def ids(n: int, seed: int = 0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 1024, n)).long().view(1, -1)


def test_torch_llama_matches_transformers(tiny_hf_dir, hf_model):
    from atomflow.bench.baselines import torch_llama

    model = torch_llama.load(tiny_hf_dir, device="cpu", dtype=torch.float32)
    model.setup_cache(64)
    x = ids(14)
    with torch.no_grad():
        want = hf_model(x).logits[0]
        got = [model(x[:, :9], torch.arange(9))[0]]  # prefill, then one token at a time
        got += [model(x[:, p : p + 1], torch.tensor([p]))[0] for p in range(9, 14)]
    for i, g in zip(range(8, 14), got):
        scale = want[i].abs().max()
        assert (g - want[i]).abs().max() <= 1e-4 * scale, f"position {i}"
    assert torch.equal(torch_llama.decode_one(model, x[:, 13:14], torch.tensor([13])), want[13].argmax().view(1, 1))


def test_int8_weight_only(tiny_hf_dir, hf_model):
    from atomflow.bench.baselines import torch_llama

    model = torch_llama.load(tiny_hf_dir, device="cpu", dtype=torch.float32, linear="int8")
    lin = model.layers[0].wqkv
    assert lin.weight.dtype == torch.int8 and lin.scales.shape == (lin.weight.shape[0],)
    model.setup_cache(32)
    x = ids(12)
    with torch.no_grad():
        got, want = model(x, torch.arange(12))[0], hf_model(x).logits[0, -1]
    cos = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
    assert 0.995 < cos < 1.0 - 1e-7, cos  # close to bf16/fp32, and really quantized


def test_prefill_path_matches_decode_path_and_transformers(tiny_hf_dir, hf_model):
    """model.prefill (KV heads repeated; is_causal over a fresh cache, a mask over the cache after
    it) gives the logits of the decode path (SDPA enable_gqa over the whole static cache) and of
    transformers, and leaves the same cache: a prompt in one chunk, then in chunks of 5 and 4."""
    from atomflow.bench.baselines import torch_llama

    model = torch_llama.load(tiny_hf_dir, device="cpu", dtype=torch.float32)
    s = model.spec
    assert s.num_heads // s.num_kv_heads > 1  # the tiny model has GQA: the repeat is exercised
    x = ids(14, seed=1)
    with torch.no_grad():
        want = hf_model(x).logits[0]
        model.setup_cache(32)
        whole = model.prefill(x, 0)[0]
        cache = [b.k_cache.clone() for b in model.layers]
        model.setup_cache(48)  # a fresh cache (another length)
        model.setup_cache(32)
        model.prefill(x[:, :5], 0)
        model.prefill(x[:, 5:10], 5)
        chunked = model.prefill(x[:, 10:], 10)[0]
        model.setup_cache(48)
        model.setup_cache(32)
        decoded = model(x, torch.arange(14))[0]
    scale = want[13].abs().max()
    for got in (whole, chunked, decoded):
        assert (got - want[13]).abs().max() <= 1e-4 * scale
    assert (whole - decoded).abs().max() <= 1e-5 * scale
    for b, k in zip(model.layers, cache):
        assert torch.allclose(b.k_cache, k, atol=1e-5)  # layers after the first: attention rounding


def test_repeated_kv_sdpa_is_gqa_attention():
    """The prefill's attention call: KV heads repeat_interleave'd to the query heads, then SDPA
    (is_causal, or a [T, S] mask after earlier keys), against attention written out in fp64:
    query head h reads KV head h // (H / Hkv)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    H, Hkv, T, start, D = 8, 2, 6, 5, 16
    q = torch.randn(1, H, T, D, generator=g)
    k, v = torch.randn(1, Hkv, start + T, D, generator=g), torch.randn(1, Hkv, start + T, D, generator=g)

    def reference(q, k, v, start):
        out = torch.empty(1, H, T, D, dtype=torch.float64)
        for h in range(H):
            kh, vh = k[0, h // (H // Hkv)].double(), v[0, h // (H // Hkv)].double()
            scores = q[0, h].double() @ kh.T / D**0.5
            allowed = torch.arange(kh.shape[0])[None, :] <= start + torch.arange(T)[:, None]
            out[0, h] = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ vh
        return out

    kr, vr = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    fresh = F.scaled_dot_product_attention(q, kr[:, :, start:], vr[:, :, start:], is_causal=True)
    assert torch.allclose(fresh.double(), reference(q, k[:, :, start:], v[:, :, start:], 0), atol=1e-5)
    pos = torch.arange(start, start + T)
    mask = pos[:, None] >= torch.arange(start + T)[None, :]
    after = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    assert torch.allclose(after.double(), reference(q, k, v, start), atol=1e-5)


# ----------------------------------------------------------------------------- FP8


def test_fp8_rowwise_quantization_math():
    """fp8_rowwise against a float reference: scale = absmax(row) / 448, each row's largest
    magnitude lands on 448 exactly, and every element is within e4m3's rounding (half a step:
    2^-4 relative for normals, 2^-10 of the scale below 2^-6) of the original."""
    from atomflow.bench.baselines.torch_llama import FP8_MAX, fp8_rowwise

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g) * torch.logspace(-3, 2, 7)[:, None]
    x[3, 5] = 0.0
    q, scale = fp8_rowwise(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (7, 1) and scale.dtype == torch.float32
    assert torch.allclose(scale[:, 0], x.abs().amax(dim=1) / FP8_MAX)
    qf = q.float()
    assert torch.equal(qf.abs().amax(dim=1), torch.full((7,), FP8_MAX))
    err = (qf * scale - x).abs()
    assert (err <= 2.0**-4 * x.abs() + 2.0**-10 * scale + 1e-12).all()
    assert qf[3, 5] == 0.0 and torch.isfinite(qf).all()
    # values the float8 cast would turn to NaN (beyond 448) are clamped first
    big = fp8_rowwise(torch.tensor([[1e30, -1e30, 1.0]]))[0].float()
    assert torch.equal(big[0, :2], torch.tensor([FP8_MAX, -FP8_MAX]))


def test_fp8_linear_is_scaled_mm_of_the_dequantized_operands():
    """Fp8Linear = (x8 * sx) @ (w8 * sw).T with fp32 accumulation (the _scaled_mm call's layout
    and scales right), and within FP8's error of the float product x @ w.T."""
    from atomflow.bench.baselines.torch_llama import Fp8Linear, fp8_rowwise

    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(48, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    lin = Fp8Linear(w)
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight.shape == (48, 64) and lin.scale.shape == (1, 48)
    y = lin(x)
    assert y.shape == (2, 5, 48) and y.dtype == x.dtype
    x8, sx = fp8_rowwise(x.reshape(10, 64))
    exact = (x8.double() * sx.double()) @ (lin.weight.double() * lin.scale.double().T).T
    assert torch.allclose(y.reshape(10, 48).double(), exact, rtol=1e-5, atol=1e-5)
    rel = (y - x @ w.T).norm() / (x @ w.T).norm()
    assert 0.005 < rel < 0.06, rel  # really FP8, and as close as two e4m3 roundings allow
    assert lin(x[0, :1]).shape == (1, 48)  # one token (a decode step)


def test_fp8_model_close_to_transformers(tiny_hf_dir, hf_model):
    from atomflow.bench.baselines import torch_llama

    model = torch_llama.load(tiny_hf_dir, device="cpu", dtype=torch.float32, linear="fp8")
    assert model.output.weight.dtype == torch.float8_e4m3fn  # lm_head too
    model.setup_cache(32)
    x = ids(12)
    with torch.no_grad():
        got, want = model.prefill(x, 0)[0], hf_model(x).logits[0, -1]
    cos = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
    assert 0.99 < cos < 1.0 - 1e-6, cos
    with pytest.raises(ValueError, match="linear must be one of bf16, int8, fp8"):
        torch_llama.load(tiny_hf_dir, device="cpu", linear="fp4")


def test_fp8_unsupported_reasons():
    from types import SimpleNamespace

    from atomflow.bench.baselines.torch_runner import fp8_unsupported

    assert fp8_unsupported(torch, "cpu") is None  # this torch runs _scaled_mm rowwise on the CPU
    old = SimpleNamespace(__version__="2.0.0", float8_e4m3fn=torch.float8_e4m3fn)
    assert "has no float8_e4m3fn / torch._scaled_mm" in fp8_unsupported(old, "cpu")
    ampere = SimpleNamespace(
        __version__="2.5.0",
        float8_e4m3fn=torch.float8_e4m3fn,
        _scaled_mm=None,
        cuda=SimpleNamespace(get_device_capability=lambda: (8, 0)),
    )
    assert fp8_unsupported(ampere, "cuda") == "FP8 matmuls need compute capability >= 8.9; this GPU is 8.0"


def test_fp8_unsupported_op_is_a_reason(monkeypatch):
    from atomflow.bench.baselines.torch_runner import fp8_unsupported

    def refuse(*a, **k):
        raise RuntimeError("Invalid scaling configuration.\nmore")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    assert fp8_unsupported(torch, "cpu") == (
        "torch._scaled_mm with rowwise scales failed here (RuntimeError: Invalid scaling configuration.)"
    )


# ----------------------------------------------------------------------------- decoders


def test_decoders_agree_with_chunked_prefill(tiny_hf_dir):
    """Greedy tokens of the hf decoder (1024-token chunks cut to 5) and the compiled decoder
    (compiled on the CPU, decode and prefill, chunks of 7: the start 0 and start > 0 graphs)
    after a 12-token prefill, then 6 steps, and from empty; the recipe and compile times recorded."""
    from atomflow.bench.baselines.torch_runner import CompiledDecoder, HfDecoder

    x = ids(20, seed=3)

    def run(dec, depth: int, n: int):
        dec.prepare(depth + n)
        dec.start(depth + n)
        first = int(dec.prefill(x[:, :depth])) if depth else None
        tok, out = x[:, depth : depth + 1], []
        for _ in range(n):
            tok = dec.step(tok)
            out.append(int(tok))
        return first, out

    hf = HfDecoder(tiny_hf_dir, device="cpu", dtype=torch.float32)
    hf.prefill_chunk = 5
    comp = CompiledDecoder(tiny_hf_dir, device="cpu", dtype=torch.float32)
    comp.prefill_chunk = 7
    for depth in (12, 0):
        assert run(hf, depth, 6) == run(comp, depth, 6)
    assert comp.compile_s  # compiled once per cache length, outside the timed runs
    assert comp.recipe == (
        "float32; decode: torch.compile(mode=reduce-overhead, fullgraph, static shapes); "
        "prefill: torch.compile(fullgraph, dynamic shapes), SDPA (CPU); "
        "decode attention: SDPA enable_gqa over the static cache, masked"
    )
    comp.prepare_prefill(x[:, :12], 18)
    assert list(comp.prefill_compile_s) == [(12, 256)] and comp.prefill_compile_s[(12, 256)] > 0
    comp.prepare_prefill(x[:, :12], 18)  # once per shape
    assert len(comp.prefill_compile_s) == 1


def test_compiled_prefill_reuses_its_graph_across_cache_lengths(tiny_hf_dir):
    """Tests use caches of different lengths: the compiled prefill compiles at the first and the
    second length (which marks the cache dims dynamic) and no more (each compile of a 3B model's
    prefill takes a minute or more)."""
    from torch._dynamo.utils import counters

    from atomflow.bench.baselines.torch_runner import CompiledDecoder

    dec = CompiledDecoder(tiny_hf_dir, device="cpu", dtype=torch.float32)
    x = ids(200, seed=2)
    graphs = []
    for n, max_len in ((16, 16), (24, 300), (20, 600), (150, 600)):
        dec.start(max_len)
        dec.prefill(x[:, :n])
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[2] == graphs[1] == graphs[0] + 1 and graphs[3] == graphs[2], graphs
    torch._dynamo.reset()


def test_eager_prefill_recipe_and_row_fields(tiny_hf_dir):
    """compile_prefill=False: prefill eager (gpt-fast without --compile_prefill), said in the recipe;
    the fields a row gets from a compiled decoder."""
    from atomflow.bench.baselines.torch_llama import prefill_one
    from atomflow.bench.baselines.torch_runner import CompiledDecoder, compile_extras
    from atomflow.bench.plan import BenchTest

    dec = CompiledDecoder(tiny_hf_dir, linear="int8", compile_prefill=False, device="cpu", dtype=torch.float32)
    assert dec._prefill is prefill_one
    assert dec.recipe.startswith("int8 weight-only (per-row scales); decode: torch.compile(mode=reduce-overhead")
    assert "prefill: eager, SDPA (CPU)" in dec.recipe
    dec.compile_s[256] = 3.0
    dec.prefill_compile_s.update({(8, 256): 2.0, (6, 256): 1.0})
    assert compile_extras(dec, BenchTest("pp", 8, 0)) == dict(prefill_compile_s=2.0)
    tg = compile_extras(dec, BenchTest("tg", 0, 4))
    assert tg["compile_s"] == 3.0 and "prefill_compile_s" not in tg and tg["cudagraph_skips"] >= 0
    assert compile_extras(dec, BenchTest("tg", 0, 4, 6))["prefill_compile_s"] == 1.0


def test_weight_bytes_per_precision():
    from test_bench_report import LLAMA_3B

    from atomflow.bench.baselines.torch_runner import weight_bytes
    from atomflow.model.spec import ModelSpec

    spec = ModelSpec.from_hf_config(LLAMA_3B)
    bf16, head16 = weight_bytes(spec, "bf16")
    int8, head8 = weight_bytes(spec, "int8")
    fp8, headf = weight_bytes(spec, "fp8")
    assert int8 < fp8 < int8 * 1.001 and fp8 == pytest.approx(bf16 / 2, rel=3e-3)
    assert head16 == 128256 * 3072 * 2 + 3072 * 2 and headf == 128256 * (3072 + 4) + 3072 * 2


# ----------------------------------------------------------------------------- skip paths

OPTS = make_options("m.atomflow", n_prompt="16", n_gen="4", repetitions="1")


def run(name: str, hf_dir) -> list[dict]:
    return baselines.run(name, hf_dir, OPTS, 1000.0, lambda msg: None)


def assert_skipped(rows: list[dict], name: str, needle: str) -> None:
    assert [r["test"] for r in rows] == ["pp16", "tg4"]
    for r in rows:
        assert r["engine"] == name and r["status"] == "skipped" and needle in r["reason"], r
        assert r["tokens_per_s_avg"] is None and r["tpot_ms_p50"] is None  # nothing made up


@pytest.mark.parametrize("name", ["hf", "torch-compile", "torch-compile-int8", "torch-fp8", "vllm"])
def test_no_hf_dir(name, tmp_path):
    assert_skipped(run(name, None), name, "no HF directory")
    assert_skipped(run(name, tmp_path), name, "no config.json")


def test_no_torch(tiny_hf_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert_skipped(run("torch-compile", tiny_hf_dir), "torch-compile", "torch is not installed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
@pytest.mark.parametrize("name", ["hf", "torch-compile-int8", "torch-fp8"])
def test_no_cuda(tiny_hf_dir, name):
    assert_skipped(run(name, tiny_hf_dir), name, "torch has no CUDA device")


def test_fp8_unsupported_skips_with_the_reason(tiny_hf_dir, monkeypatch):
    """Where torch._scaled_mm cannot run (an older GPU, an older torch), torch-fp8's rows say why."""
    from atomflow.bench.baselines import torch_runner

    monkeypatch.setattr(torch_runner, "require_torch_cuda", lambda: torch)
    monkeypatch.setattr(
        torch_runner,
        "fp8_unsupported",
        lambda torch, device="cuda": "FP8 matmuls need compute capability >= 8.9; this GPU is 8.0",
    )
    assert_skipped(run("torch-fp8", tiny_hf_dir), "torch-fp8", "FP8 matmuls need compute capability >= 8.9")


def test_vllm_not_importable(tiny_hf_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert_skipped(run("vllm", tiny_hf_dir), "vllm", "vllm is not importable")


def test_unexpected_failure_is_a_reason(tiny_hf_dir, monkeypatch):
    from atomflow.bench.baselines import torch_runner

    def boom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch_runner, "require_torch_cuda", lambda: torch)
    monkeypatch.setattr(torch_runner, "make_decoder", boom)
    assert_skipped(run("hf", tiny_hf_dir), "hf", "out of GPU memory loading the model")


def test_timing_loops_on_cpu(tiny_hf_dir):
    """time_pp / time_tg with host-clock events standing in for CUDA ones: the samples per
    repetition, warm-up excluded, the depth prefilled before the timed steps."""
    import time
    from types import SimpleNamespace

    from atomflow.bench.baselines.torch_runner import HfDecoder, time_pp, time_tg
    from atomflow.bench.plan import BenchTest

    class Event:
        def __init__(self, enable_timing=True):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, other):  # ms, like torch.cuda.Event
            return 1e3 * (other.t - self.t)

    fake = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None, Event=Event), contiguous_format=torch.contiguous_format)
    dec = HfDecoder(tiny_hf_dir, device="cpu", dtype=torch.float32)
    calls = []
    real_prefill = dec.prefill
    dec.prefill = lambda ids: calls.append(ids.shape[1]) or real_prefill(ids)
    opts = make_options("m", n_prompt="8", n_gen="5", context="6", repetitions="3")
    x = ids(12)
    pp = time_pp(fake, dec, BenchTest("pp", 8, 0), opts, x[:, :8])
    assert len(pp["tokens_per_s"]) == 3 and len(pp["ttft_ms"]) == 3 and calls == [8] * 4  # + warm-up
    calls.clear()
    tg = time_tg(fake, dec, BenchTest("tg", 0, 5, 6), opts, x[:, :7])
    assert calls == [6] * 4 and len(tg["tokens_per_s"]) == 3
    assert [len(g) for g in tg["tpot_ms"]] == [4, 4, 4] and all(v > 0 for g in tg["tpot_ms"] for v in g)
    assert tg["tokens_per_s"][0] == pytest.approx(4 / (sum(tg["tpot_ms"][0]) / 1e3))


def test_vllm_runner_with_a_fake_vllm(tiny_hf_dir, monkeypatch):
    """The vllm runner's bookkeeping against a stand-in module: per-request timing, prefix caching
    off, greedy, EOS ignored, one TPOT value per repetition."""
    import types

    made = {}

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class LLM:
        def __init__(self, **kw):
            made.update(kw)

        def generate(self, prompts, params, use_tqdm=True):
            assert params.kw["temperature"] == 0.0 and params.kw["ignore_eos"]
            clock[0] += 0.004 + 0.001 * params.kw["max_tokens"]  # 4 ms to the first token, then 1 ms each
            out = types.SimpleNamespace(token_ids=list(range(params.kw["max_tokens"])))
            return [types.SimpleNamespace(outputs=[out])]

    # The runner's clock advances only inside generate: the figures are exact, whatever the load.
    from atomflow.bench.baselines import vllm_runner

    clock = [100.0]
    monkeypatch.setattr(vllm_runner, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    opts = make_options("m", n_prompt="16", n_gen="5", context="8", repetitions="2")
    rows = {r["test"]: r for r in baselines.run("vllm", tiny_hf_dir, opts, 1000.0, lambda m: None)}
    assert rows["pp16@d8"]["status"] == "skipped" and "after cached tokens" in rows["pp16@d8"]["reason"]
    assert made["enable_prefix_caching"] is False and made["dtype"] == "bfloat16"
    assert made["max_model_len"] >= opts.max_context
    assert rows["pp16"]["status"] == "ok" and len(rows["pp16"]["samples"]["ttft_ms"]) == 2
    tg = rows["tg5"]
    assert tg["status"] == "ok" and [len(g) for g in tg["samples"]["tpot_ms"]] == [1, 1]
    assert tg["tpot_ms_p50"] == pytest.approx(1.0) and tg["tpot_method"] == "per-request mean"
    assert rows["pp16"]["samples"]["ttft_ms"] == pytest.approx([5.0, 5.0])
