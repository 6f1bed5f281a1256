"""tools/make_tiny_model.py builds every model our tests and benchmarks run on, so it must write
what Hugging Face would: a directory transformers loads (both config styles), consistent shards,
the same bytes for the same seed, and the parameter counts of the real Llama shapes."""

import json
import math

import ml_dtypes  # noqa: F401  (lets safetensors' numpy API read bf16)
import numpy as np
import pytest
from safetensors import safe_open

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tensors(d):
    """name -> (file, array) for every tensor in every shard."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "np") as h:
            for k in h.keys():
                out[k] = (f.name, h.get_tensor(k))
    return out


@pytest.mark.parametrize("version", [4, 5])
def test_loads_in_transformers_with_both_config_styles(tmp_path, make_tiny_model, version):
    d = make_tiny_model.make_model(tmp_path / "m", preset="tiny", seed=0, transformers_version=version)
    cfg = json.loads((d / "config.json").read_text())
    if version == 4:
        assert {"rope_scaling", "rope_theta", "torch_dtype"} <= cfg.keys() and "rope_parameters" not in cfg
    else:
        assert {"rope_parameters", "dtype"} <= cfg.keys() and not {"rope_scaling", "rope_theta"} & cfg.keys()
    model = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    rope = model.config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"], rope["rope_theta"]) == (
        "llama3",
        8.0,
        64,
        500000.0,
    )
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tok) == 1024

    ids = tok("The history of computing is a history of memory.", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.convert_tokens_to_ids("<|begin_of_text|>")
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        torch.manual_seed(0)
        sampled = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=True, temperature=1.0, top_k=0, top_p=1.0
        )
    logits = out.logits[0, -1]
    assert torch.isfinite(out.logits).all()
    # the residual stream starts at the embedding's RMS (1/16) and grows, neither vanishing nor exploding
    rms = [h[0].pow(2).mean().sqrt().item() for h in out.hidden_states]
    assert 0.05 < rms[0] < 0.08 and all(a < b < 10 for a, b in zip(rms, rms[1:])), rms
    # logits are informative but not one-hot, so sampling at T = 1 varies
    assert 0.5 < logits.std().item() < 4.0
    assert 1 / 1024 < logits.softmax(-1).max().item() < 0.9
    assert len(set(sampled[0, ids.shape[1] :].tolist())) >= 8


def test_sharded_index_is_consistent(tiny_hf_dir, make_tiny_model):
    index = json.loads((tiny_hf_dir / "model.safetensors.index.json").read_text())
    tensors = _tensors(tiny_hf_dir)
    shapes = make_tiny_model.hf_tensor_shapes("tiny")
    assert len({f for f, _ in tensors.values()}) == 2  # the tiny preset always exercises sharding
    assert index["weight_map"] == {k: f for k, (f, _) in tensors.items()}
    assert list(shapes) == list(index["weight_map"])
    assert {k: a.shape for k, (_, a) in tensors.items()} == shapes
    assert index["metadata"]["total_size"] == sum(a.nbytes for _, a in tensors.values())
    assert all(a.dtype == ml_dtypes.bfloat16 for _, a in tensors.values())
    assert "lm_head.weight" not in tensors


def test_same_seed_same_bytes(tmp_path, make_tiny_model):
    a = make_tiny_model.make_model(tmp_path / "a", seed=7, threads=1)
    b = make_tiny_model.make_model(tmp_path / "b", seed=7, threads=4)  # thread count must not matter
    c = make_tiny_model.make_model(tmp_path / "c", seed=8)
    for f in sorted(p.name for p in a.iterdir()):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    ta, tc = _tensors(a), _tensors(c)
    assert not np.array_equal(ta["model.layers.0.mlp.up_proj.weight"][1], tc["model.layers.0.mlp.up_proj.weight"][1])
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_untied_writes_lm_head(tmp_path, make_tiny_model):
    d = make_tiny_model.make_model(tmp_path / "u", untied=True, dtype="fp32", num_layers=1)
    assert json.loads((d / "config.json").read_text())["tie_word_embeddings"] is False
    t = _tensors(d)
    head, embed = t["lm_head.weight"][1], t["model.embed_tokens.weight"][1]
    assert head.shape == embed.shape and head.dtype == np.float32 and not np.array_equal(head, embed)
    model = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert np.array_equal(model.lm_head.weight.detach().numpy(), head)


def test_cli_single_file_when_under_shard_size(tmp_path, make_tiny_model):
    assert (
        make_tiny_model.main(
            [str(tmp_path / "s"), "--num-layers", "2", "--shard-size-mb", "100", "--dtype", "fp16", "--seed", "3"]
        )
        == 0
    )
    files = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    assert json.loads((tmp_path / "s" / "config.json").read_text())["num_hidden_layers"] == 2


@pytest.mark.parametrize(
    "preset, params, tied",
    [  # the real checkpoints' counts (1.24B, 3.21B, 8.03B)
        ("llama-3.2-1b", 1_235_814_400, True),
        ("llama-3.2-3b", 3_212_749_824, True),
        ("llama-3.1-8b", 8_030_261_248, False),
    ],
)
def test_preset_shapes_match_llama(make_tiny_model, preset, params, tied):
    """Computed, not written: the shapes give the real models' exact parameter counts."""
    shapes = make_tiny_model.hf_tensor_shapes(preset)
    assert shapes["model.embed_tokens.weight"][0] == 128256
    assert ("lm_head.weight" not in shapes) == tied
    assert sum(math.prod(s) for s in shapes.values()) == params


def test_generation_config_and_specials(tiny_hf_dir):
    gen = json.loads((tiny_hf_dir / "generation_config.json").read_text())
    vocab = json.loads((tiny_hf_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    assert gen["eos_token_id"] == [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
    assert (gen["bos_token_id"], gen["temperature"], gen["top_p"], gen["do_sample"]) == (ids["<|begin_of_text|>"], 0.6, 0.9, True)


@pytest.mark.parametrize(
    "preset, params, vocab",
    [  # the Hub checkpoints' counts (total_size / 2 of their bf16 safetensors index)
        ("qwen2.5-7b", 7_615_616_512, 152064),
        ("qwen3-8b", 8_190_735_360, 151936),
        ("mistral-7b", 7_248_023_552, 32768),
    ],
)
def test_preset_shapes_match_other_architectures(make_tiny_model, preset, params, vocab):
    """Computed, not written: the HF tensor names of each architecture (Qwen2's q/k/v bias, Qwen3's
    per-head q/k norm) and the real models' exact parameter counts; untied, like theirs."""
    shapes = make_tiny_model.hf_tensor_shapes(preset)
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (vocab, shapes["model.norm.weight"][0])
    assert sum(math.prod(s) for s in shapes.values()) == params
    attn = {k.split("self_attn.")[1]: s for k, s in shapes.items() if k.startswith("model.layers.0.self_attn.")}
    extra = set(attn) - {f"{x}_proj.weight" for x in "qkvo"}
    want = {
        "qwen2.5-7b": {"q_proj.bias": (3584,), "k_proj.bias": (512,), "v_proj.bias": (512,)},
        "qwen3-8b": {"q_norm.weight": (128,), "k_norm.weight": (128,)},
        "mistral-7b": {},
    }[preset]
    assert {k: attn[k] for k in extra} == want


@pytest.mark.parametrize("preset", ["qwen2.5-7b", "qwen3-8b", "mistral-7b"])
def test_other_architectures_config_is_what_transformers_writes(make_tiny_model, tmp_path, preset):
    """--transformers-version 5: the installed transformers' config class reads config.json and
    writes it back unchanged (but for its version). 4 (the default, the Hub files' form): the
    same config for transformers and the same ModelSpec as the 5.x form."""
    from atomflow.model.spec import ModelSpec

    p = make_tiny_model.resolve_preset(preset)
    ids = {t: i for i, t in enumerate(make_tiny_model.SPECIAL_TOKENS, start=1019)}
    v4, v5 = (make_tiny_model.config_dict(p, "bf16", ids, v) for v in (4, 5))
    (tmp_path / "config.json").write_text(json.dumps(v5))
    cfg5 = transformers.AutoConfig.from_pretrained(tmp_path)
    cfg5.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    if transformers.__version__.startswith("5."):
        assert {k: v for k, v in again.items() if k != "transformers_version"} == {
            k: v for k, v in v5.items() if k != "transformers_version"
        }
    (tmp_path / "config.json").write_text(json.dumps(v4))
    cfg4 = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(cfg4) is type(cfg5) and cfg4.architectures == v5["architectures"]
    assert cfg4.to_dict() | {"transformers_version": None} == cfg5.to_dict() | {"transformers_version": None}
    spec = ModelSpec.from_hf_config(v4)
    assert spec == ModelSpec.from_hf_config(v5)
    assert (spec.rope_theta, spec.rope_type, spec.head_dim, spec.sliding_window, spec.tie_word_embeddings) == (
        1e6,
        "default",
        128,
        0,
        False,
    )
    assert (spec.arch, spec.attention_bias, spec.qk_norm) == {
        "qwen2.5-7b": ("qwen2", True, False),
        "qwen3-8b": ("qwen3", False, True),
        "mistral-7b": ("mistral", False, False),
    }[preset]
