"""The CUDA engine on the attention shapes past Llama's (attention_decode.cu): GQA ratios 7, 5 and 16
and head_dim 80, 96, 256, each a random tiny Llama made by transformers (tools/make_tiny_arch.py), sizes
multiples of 128, against the numpy reference backend on the same file: at every step the logits'
cosine >= 0.9999 and the same greedy token. Short contexts (the splits merged in a cluster or not
split) and one past 513 keys (merged through the scratch). Skipped (conftest) without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from atomflow.model.fileformat import AtomflowFile

pytestmark = pytest.mark.gpu

COS_MIN, REL_L2_MAX = 0.9999, 1e-2  # as tests/test_engine_gpu.py: bf16 activations and cache vs fp32


@pytest.fixture(scope="module")
def arch_file(tmp_path_factory):
    """preset -> AtomflowFile, built once per module."""
    from conftest import load_tool

    from atomflow.model.quantize import quantize

    tool = load_tool("make_tiny_arch")
    cache: dict = {}

    def make(preset: str) -> AtomflowFile:
        if preset not in cache:
            root = tmp_path_factory.mktemp(preset)
            hf = tool.make_arch_model(root / "hf", preset, seed=1)
            quantize(hf, root / "m.atomflow", progress=False, log=lambda s: None)
            cache[preset] = AtomflowFile(root / "m.atomflow")
        return cache[preset]

    return make


def check(what: str, got: np.ndarray, want: np.ndarray) -> None:
    assert np.isfinite(got).all(), f"{what}: non-finite logits"
    g, w = got.astype(np.float64), want.astype(np.float64)
    cos = float(g @ w / (np.linalg.norm(g) * np.linalg.norm(w)))
    rel = float(np.linalg.norm(g - w) / np.linalg.norm(w))
    assert cos >= COS_MIN and rel <= REL_L2_MAX, f"{what}: cosine {cos:.6f}, rel-L2 {rel:.2e}"
    # The same greedy token, unless the reference's top two are a tie within the tolerance: closer than
    # REL_L2_MAX times the logits' scale (their RMS, ~1 for these models).
    top2 = np.sort(w)[-2:]
    if top2[1] - top2[0] > REL_L2_MAX * np.sqrt(np.mean(w * w)):
        err = float(np.abs(g - w).max())
        assert int(np.argmax(g)) == int(np.argmax(w)), (
            f"{what}: greedy token differs (reference top-2 gap {top2[1] - top2[0]:.3g}, largest logit error {err:.3g})"
        )


def compare(model: AtomflowFile, n_prompt: int, steps: int, max_context: int = 1024) -> None:
    """Prefill a random prompt on both backends, then `steps` greedy decode steps fed with the
    reference's token."""
    from atomflow.backends.cpu import CpuBackend
    from atomflow.backends.cuda import CudaBackend

    spec = model.spec
    ids = np.random.default_rng(n_prompt).integers(0, spec.vocab_size, n_prompt).astype(np.int32)
    ref, eng = CpuBackend(model, max_context), CudaBackend(model, max_context, verbose=False)
    shape = f"H={spec.num_heads} Hkv={spec.num_kv_heads} D={spec.head_dim}"
    want, got = ref.prefill(ids), eng.prefill(ids)
    check(f"{shape} prefill of {n_prompt}", got, want)
    for step in range(steps):
        token = int(np.argmax(want))
        want, got = ref.decode(token), eng.decode(token)
        check(f"{shape} decode step {step} (position {ref.position - 1})", got, want)
    assert eng.position == ref.position == n_prompt + steps


@pytest.mark.parametrize("preset,ratio", [("llama-r7", 7), ("llama-r5", 5), ("llama-r16", 16)])
def test_engine_gqa_ratio_matches_reference(arch_file, preset, ratio):
    model = arch_file(preset)
    assert model.spec.group_size == ratio and model.spec.cuda_unsupported() is None
    compare(model, 40, 16)
    compare(model, 530, 4)


@pytest.mark.parametrize("preset,head_dim", [("llama-d80", 80), ("llama-d96", 96), ("llama-d256", 256)])
def test_engine_head_dim_matches_reference(arch_file, preset, head_dim):
    model = arch_file(preset)
    assert model.spec.head_dim == head_dim and model.spec.cuda_unsupported() is None
    compare(model, 40, 16)
    compare(model, 530, 4)


def test_engine_halved_ratio_4_matches_reference(arch_file):
    """4 query heads per kv head at head_dim 128 (Llama-3.1-8B's) run the halved attention plan
    (StepPlan::attn_halved: two blocks of 2 heads per kv head, at most 32 splits): against the reference
    short and past 1024 keys, and a chunk's rows as decode steps equal the decode steps bit for bit."""
    from atomflow.backends.cuda import CudaBackend, plan_for

    model = arch_file("llama-r4-d128")
    plan = plan_for(model, 2048)
    assert plan["qkv_path"] == "fused" and all(r["halved"] for r in plan["attention"])
    assert next(r for r in plan["attention"] if r["when"] == "decode")["splits"] == 32
    compare(model, 40, 16)
    compare(model, 1100, 4, max_context=2048)
    be = CudaBackend(model, 2048, verbose=False)
    ids = np.random.default_rng(7).integers(0, model.spec.vocab_size, 1105).astype(np.int32)
    be.prefill(ids[:1100])
    rows = be.engine.prefill_rows(ids[1100:])
    be.rollback(1100)
    steps = np.stack([be.decode(int(t)) for t in ids[1100:]])
    np.testing.assert_array_equal(rows, steps)
