"""The bench baselines without a GPU: the torch Llama of the torch-compile baselines against
Hugging Face transformers on the CPU (fp32: it must be the same model), its int8 weight-only
variant, the decoders' cache and position handling, and every skip path ('skipped: <reason>')."""
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
    return AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32,
                                                attn_implementation="eager").eval()


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
        got += [model(x[:, p:p + 1], torch.tensor([p]))[0] for p in range(9, 14)]
    for i, g in zip(range(8, 14), got):
        scale = want[i].abs().max()
        assert (g - want[i]).abs().max() <= 1e-4 * scale, f"position {i}"
    assert torch.equal(torch_llama.decode_one(model, x[:, 13:14], torch.tensor([13])),
                       want[13].argmax().view(1, 1))


def test_int8_weight_only(tiny_hf_dir, hf_model):
    from atomflow.bench.baselines import torch_llama
    model = torch_llama.load(tiny_hf_dir, device="cpu", dtype=torch.float32, int8=True)
    lin = model.layers[0].wqkv
    assert lin.weight.dtype == torch.int8 and lin.scales.shape == (lin.weight.shape[0],)
    model.setup_cache(32)
    x = ids(12)
    with torch.no_grad():
        got, want = model(x, torch.arange(12))[0], hf_model(x).logits[0, -1]
    cos = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
    assert 0.995 < cos < 1.0 - 1e-7, cos  # close to bf16/fp32, and really quantized


def test_decoders_agree_with_chunked_prefill(tiny_hf_dir):
    """Greedy tokens of the hf decoder (1024-token chunks cut to 5) and the compiled decoder
    (compiled on the CPU, chunks of 7) after a 12-token prefill, then 6 steps, and from empty."""
    from atomflow.bench.baselines.torch_runner import CompiledDecoder, HfDecoder
    x = ids(20, seed=3)

    def run(dec, depth: int, n: int):
        dec.prepare(depth + n)
        dec.start(depth + n)
        first = int(dec.prefill(x[:, :depth])) if depth else None
        tok, out = x[:, depth:depth + 1], []
        for _ in range(n):
            tok = dec.step(tok)
            out.append(int(tok))
        return first, out

    hf = HfDecoder(tiny_hf_dir, device="cpu", dtype=torch.float32)
    hf.prefill_chunk = 5
    comp = CompiledDecoder(tiny_hf_dir, int8=False, device="cpu", dtype=torch.float32)
    comp.prefill_chunk = 7
    for depth in (12, 0):
        assert run(hf, depth, 6) == run(comp, depth, 6)
    assert comp.compile_s  # compiled once per cache length, outside the timed runs


# ----------------------------------------------------------------------------- skip paths

OPTS = make_options("m.atomflow", n_prompt="16", n_gen="4", repetitions="1")


def run(name: str, hf_dir) -> list[dict]:
    return baselines.run(name, hf_dir, OPTS, 1000.0, lambda msg: None)


def assert_skipped(rows: list[dict], name: str, needle: str) -> None:
    assert [r["test"] for r in rows] == ["pp16", "tg4"]
    for r in rows:
        assert r["engine"] == name and r["status"] == "skipped" and needle in r["reason"], r
        assert r["tokens_per_s_avg"] is None and r["tpot_ms_p50"] is None  # nothing made up


@pytest.mark.parametrize("name", ["hf", "torch-compile", "torch-compile-int8", "vllm"])
def test_no_hf_dir(name, tmp_path):
    assert_skipped(run(name, None), name, "no HF directory")
    assert_skipped(run(name, tmp_path), name, "no config.json")


def test_no_torch(tiny_hf_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert_skipped(run("torch-compile", tiny_hf_dir), "torch-compile", "torch is not installed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
@pytest.mark.parametrize("name", ["hf", "torch-compile-int8"])
def test_no_cuda(tiny_hf_dir, name):
    assert_skipped(run(name, tiny_hf_dir), name, "torch has no CUDA device")


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

    fake = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None, Event=Event))
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
    opts = make_options("m", n_prompt="16", n_gen="5", repetitions="2")
    rows = {r["test"]: r for r in baselines.run("vllm", tiny_hf_dir, opts, 1000.0, lambda m: None)}
    assert made["enable_prefix_caching"] is False and made["dtype"] == "bfloat16"
    assert made["max_model_len"] >= opts.max_context
    assert rows["pp16"]["status"] == "ok" and len(rows["pp16"]["samples"]["ttft_ms"]) == 2
    tg = rows["tg5"]
    assert tg["status"] == "ok" and [len(g) for g in tg["samples"]["tpot_ms"]] == [1, 1]
    assert tg["tpot_ms_p50"] == pytest.approx(1.0) and tg["tpot_method"] == "per-request mean"
    assert rows["pp16"]["samples"]["ttft_ms"] == pytest.approx([5.0, 5.0])
