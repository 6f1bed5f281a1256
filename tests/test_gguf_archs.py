"""GGUF in, on each architecture: random tiny models (tools/make_tiny_arch.py) written as Q8_0 GGUF
files the way llama.cpp's converter writes them (tools/make_tiny_gguf.py: q/k rows permuted for
`llama`), read by atomflow/model/gguf.py and by transformers' own GGUF loader: identical
dequantized weights (bias and q/k norms included) and token ids; the quantized file's reference
forward near transformers on the GGUF."""

import numpy as np
import pytest

from atomflow.model.fileformat import AtomflowFile
from atomflow.model.quantize import quantize
from atomflow.model.reference import ReferenceModel

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

CASES = {"qwen2": ("qwen2", "bqkv"), "qwen3": ("qwen3", "q_norm"), "llama-tail": ("llama", None)}


@pytest.mark.parametrize("preset", list(CASES))
def test_gguf_matches_transformers_loader(tmp_path, preset):
    from conftest import load_tool
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atomflow.model.gguf import GGUFSource

    arch, extra = CASES[preset]
    hf_dir = load_tool("make_tiny_arch").make_arch_model(tmp_path / "hf", preset, seed=2)
    g = load_tool("make_tiny_gguf").write_gguf(hf_dir, tmp_path / "m.gguf", "Q8_0")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=g.name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=g.name)

    src = GGUFSource(g)
    assert src.spec.arch == arch
    want = {k: v.numpy() for k, v in hf.state_dict().items()}
    got = src.state_dict()
    assert set(got) == set(want)
    for k, v in got.items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)

    out = tmp_path / "m.atomflow"
    quantize(g, out, progress=False, log=lambda s: None)
    from atomflow.engine import Engine

    eng = Engine.load(out, backend="cpu", max_context=64)
    for s in ["Hello  wörld\n\n <|eot_id|> x", "  spaces", "<|start_header_id|>user<|end_header_id|>"]:
        assert eng.tokenizer.encode(s) == hf_tok(s).input_ids, s
    msgs = [{"role": "user", "content": "hi there"}]
    assert eng.tokenizer.apply_chat_template(msgs) == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    with AtomflowFile(out) as m:
        assert extra is None or f"layers.0.{extra}" in m.tensors
        ids = np.random.default_rng(0).integers(0, m.spec.vocab_size, 16)
        got_logits = ReferenceModel(m, 32).forward(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([list(ids)])).logits[0, -1].numpy()
    err = float(np.linalg.norm(got_logits - ref) / np.linalg.norm(ref))
    assert err < 0.1, f"rel-L2 {err:.4f} vs transformers on the GGUF (FP8 error only)"
