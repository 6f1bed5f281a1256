"""Every supported architecture, made at random by transformers' own classes (tools/make_tiny_arch.py)
with awkward shapes (tail FP8 groups, 3/5/7/16 query heads per KV head, Qwen3's free head_dim):
quantized, then the numpy reference against transformers on the same dequantized weights (rel-L2
<= 1e-4) and against the original checkpoint (FP8 error only: catches a tensor mapped wrongly)."""

import json

import numpy as np
import pytest

from atomflow.errors import UnsupportedModelError
from atomflow.model.fileformat import AtomflowFile
from atomflow.model.reference import ReferenceModel

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# preset -> (file tensors of layer 0 beyond Llama's, the CUDA refusal's words or None)
CASES = {
    "llama-tail": ((), None),
    "mistral": ((), None),
    "qwen2": (("bqkv",), None),
    "qwen2-r5": (("bqkv",), None),
    "qwen3": (("q_norm", "k_norm"), None),
    "llama-r16": ((), None),
    "qwen2-g2": (("bqkv",), None),
    "qwen3-d128": (("q_norm", "k_norm"), None),
}


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def arch_models(arch_model):
    return {preset: arch_model(preset, 1) for preset in CASES}


@pytest.mark.parametrize("preset", list(CASES))
def test_reference_matches_transformers(arch_models, preset):
    from conftest import load_tool

    hf_ref = load_tool("hf_reference")
    hf_dir, path = arch_models[preset]
    extra, cuda = CASES[preset]
    model = AtomflowFile(path)
    spec = model.spec
    assert all(f"layers.0.{t}" in model.tensors for t in extra)
    why = spec.cuda_unsupported()
    assert (why is None) if cuda is None else (cuda in why), why

    prompt = np.random.default_rng(0).integers(0, spec.vocab_size, 24)
    want, fed = hf_ref.greedy_logits(hf_ref.load_hf_dequantized(model), prompt, 4)
    ref = ReferenceModel(model, max_context=64)
    got = [ref.forward(prompt)] + [ref.forward(np.array([t])) for t in fed]
    errs = [rel_l2(g, w) for g, w in zip(got, want)]
    assert max(errs) <= 1e-4, f"vs transformers on the dequantized weights: {np.round(errs, 7)}"

    import transformers

    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        orig = original(torch.tensor([list(prompt)])).logits[0, -1].numpy()
    err = rel_l2(got[0], orig)
    assert err < 0.1, f"vs transformers on the original weights: rel-L2 {err:.4f} (FP8 error is ~0.02)"


def test_mistral_window_bounds_the_context(arch_models):
    from atomflow.engine import Engine

    _, path = arch_models["mistral"]
    assert AtomflowFile(path).spec.sliding_window == 4096
    assert Engine.load(path, backend="cpu").max_context == 2048  # max_position_embeddings is the smaller
    with pytest.raises(ValueError, match="2048"):
        Engine.load(path, backend="cpu", max_context=3000)


def test_cuda_backend_refuses_before_loading(arch_models, monkeypatch):
    """Every shape the spec accepts runs on CUDA today (CASES); the guard that keeps a spec the core has
    no kernels for away from it still answers first, in one line, before any GPU work."""
    from atomflow.backends import make_backend
    from atomflow.model.spec import ModelSpec

    monkeypatch.setattr(ModelSpec, "cuda_unsupported", lambda self: "the CUDA engine does not run this model yet: x")
    with AtomflowFile(arch_models["qwen2"][1]) as m, pytest.raises(UnsupportedModelError) as e:
        make_backend("cuda", m, 64)
    assert "does not run this model yet" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda c: c.update(architectures=["Qwen2MoeForCausalLM"]), "architectures = ['Qwen2MoeForCausalLM']"),
        (lambda c: c.update(use_sliding_window=True), "use_sliding_window = true"),
        (lambda c: c.update(num_key_value_heads=2), "not divisible"),
    ],
)
def test_unsupported_config_writes_nothing(arch_models, tmp_path, edit, needle, capsys):
    import shutil

    from atomflow.cli import main

    src, _ = arch_models["qwen2"]
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    cfg = json.loads((hf / "config.json").read_text())
    edit(cfg)
    (hf / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "m.atomflow"
    assert main(["quantize", str(hf), "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == [hf]


def test_version1_file_loads(tiny_model_file, tmp_path):
    """A file written by format version 1 (no arch fields in its spec, sizes multiples of 128) reads
    as the same Llama; an unknown version is refused in one line."""
    import shutil
    import struct

    from atomflow.errors import FormatError

    def rewrite(path, fn):
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        fn(header["__metadata__"])
        new = json.dumps(header).encode()
        new += b" " * (-(8 + len(new)) % 8)
        path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])

    def to_v1(meta):
        spec = json.loads(meta["spec"])
        for k in ("arch", "attention_bias", "qk_norm", "sliding_window"):
            spec.pop(k)
        meta.pop("header_checksum", None)  # version-1 writers did not write one
        meta.update(format_version="1", spec=json.dumps(spec))

    v1 = tmp_path / "v1.atomflow"
    shutil.copyfile(tiny_model_file, v1)
    rewrite(v1, to_v1)
    with AtomflowFile(v1) as old, AtomflowFile(tiny_model_file) as new:
        assert old.spec == new.spec and old.spec.arch == "llama"
        ids = np.arange(1, 9)
        np.testing.assert_array_equal(ReferenceModel(old, 16).forward(ids), ReferenceModel(new, 16).forward(ids))
    rewrite(v1, lambda m: m.update(format_version="3"))
    with pytest.raises(FormatError) as e:
        AtomflowFile(v1)
    assert "format version '3' is not supported" in str(e.value) and "re-quantize" in str(e.value)


# tools/make_tiny_model.py's 7-8B presets of the other architectures, shrunk (2 layers, the tiny
# vocabulary) but with their features: Qwen2.5's q/k/v bias and 7 query heads per KV head,
# Qwen3's q/k norm (head_dim 128 while hidden / heads = 64), Mistral's plain rope at theta 1e6.
SHRUNK = {
    "qwen2.5-7b": dict(hidden=896, intermediate=512, layers=2, heads=7, kv_heads=1, vocab=None),
    "qwen3-8b": dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=1, vocab=None),
    "mistral-7b": dict(hidden=512, intermediate=512, layers=2, heads=4, kv_heads=1, vocab=None),
}


@pytest.fixture(scope="module")
def shrunk_models(tmp_path_factory):
    """preset -> (HF directory, .atomflow file): written by make_tiny_model with the preset table
    patched to the shrunk shape (two shards), quantized by `atomflow quantize`."""
    from dataclasses import replace

    from conftest import load_tool

    from atomflow.cli import main

    tool = load_tool("make_tiny_model")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for preset, shape in SHRUNK.items():
            mp.setitem(tool.PRESETS, preset, replace(tool.PRESETS[preset], **shape))
            d = tool.make_model(tmp_path_factory.mktemp(preset) / "hf", preset=preset, seed=2, shard_size_mb=1)
            f = d.parent / "m.atomflow"
            assert main(["quantize", str(d), "-o", str(f), "-q"]) == 0
            out[preset] = (d, f)
    return out


@pytest.mark.parametrize("preset", list(SHRUNK))
def test_shrunk_big_presets_decode_like_transformers(shrunk_models, preset):
    """Greedy tokens on the CPU backend equal transformers' own class on the file's dequantized
    weights (logits within rel-L2 1e-4), and the first logits are the original checkpoint's, read
    by transformers from the directory, to FP8 error (no tensor missing, none unexpected)."""
    import transformers
    from conftest import load_tool

    from atomflow.engine import Engine
    from atomflow.sampling import SamplingParams

    hf_ref = load_tool("hf_reference")
    hf_dir, path = shrunk_models[preset]
    assert len(list(hf_dir.glob("model-*.safetensors"))) >= 2
    model = AtomflowFile(path)
    spec = model.spec
    arch, extra = {
        "qwen2.5-7b": ("qwen2", ("bqkv",)),
        "qwen3-8b": ("qwen3", ("q_norm", "k_norm")),
        "mistral-7b": ("mistral", ()),
    }[preset]
    assert spec.arch == arch and spec.rope_theta == 1e6 and spec.head_dim == 128 and not spec.tie_word_embeddings
    assert all(f"layers.{i}.{t}" in model.tensors for i in range(spec.num_layers) for t in extra)
    assert spec.cuda_unsupported() is None

    steps = 5
    prompt = np.random.default_rng(3).integers(0, spec.vocab_size, 16)
    want, fed = hf_ref.greedy_logits(hf_ref.load_hf_dequantized(model), prompt, steps)
    eng = Engine.load(path, backend="cpu", max_context=64)
    params = SamplingParams(temperature=0.0, max_new_tokens=steps, ignore_eos=True)
    assert list(eng.generate_tokens(prompt.tolist(), params)) == fed
    eng.reset()
    got = [eng.prefill(prompt)] + [eng.decode(t) for t in fed[:-1]]
    errs = [rel_l2(g, w) for g, w in zip(got, want)]
    assert max(errs) <= 1e-4, f"vs transformers on the dequantized weights: {np.round(errs, 7)}"

    original, info = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    assert type(original).__name__ == hf_ref.HF_CLASSES[arch][1]
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    with torch.no_grad():
        orig = original.eval()(torch.tensor([list(prompt)])).logits[0, -1].numpy()
    err = rel_l2(got[0], orig)
    assert err < 0.1, f"vs transformers on the original weights: rel-L2 {err:.4f} (FP8 error is ~0.02)"
