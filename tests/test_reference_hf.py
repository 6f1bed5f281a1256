"""Rung 2 of the correctness ladder: the numpy reference equals Hugging Face transformers
running the same dequantized weights, over a prompt and decode steps, positions past the
llama3 original context included (the tiny model's is 64)."""

import numpy as np
import pytest

from atomflow.model.fileformat import AtomflowFile
from atomflow.model.reference import ReferenceModel

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("prompt_len,steps", [(40, 40), (1, 3), (300, 2)])
def test_reference_matches_hf(tiny_model_file, prompt_len, steps):
    from conftest import load_tool

    hf_ref = load_tool("hf_reference")
    model = AtomflowFile(tiny_model_file)
    hf = hf_ref.load_hf_dequantized(model)
    rng = np.random.default_rng()
    prompt = rng.integers(0, model.spec.vocab_size, prompt_len)
    want, fed = hf_ref.greedy_logits(hf, prompt, steps)
    assert prompt_len + steps > model.spec.rope_original_max_position_embeddings or prompt_len < 40

    ref = ReferenceModel(model, max_context=512)
    got = [ref.forward(prompt)] + [ref.forward(np.array([t])) for t in fed]
    errs = [rel_l2(g, w) for g, w in zip(got, want)]
    assert max(errs) <= 1e-4, f"rel-L2 per step: {np.round(errs, 7)}"
    assert [int(np.argmax(g)) for g in got[:-1]] == fed


def test_reference_is_not_trivially_equal(tiny_model_file):
    """The comparison above can fail: one perturbed weight row moves the logits well past 1e-4."""
    from conftest import load_tool

    hf_ref = load_tool("hf_reference")
    model = AtomflowFile(tiny_model_file)
    hf = hf_ref.load_hf_dequantized(model)
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight[5] *= 1.5
    prompt = np.arange(1, 20)
    want, _ = hf_ref.greedy_logits(hf, prompt, 0)
    got = ReferenceModel(model, max_context=64).forward(prompt)
    assert rel_l2(got, want[0]) > 1e-3
