"""ModelSpec from HF config.json: the supported Llama family, both transformers config styles,
RoPE frequencies identical to transformers', and clear rejection of everything else."""
import numpy as np
import pytest

from atomflow.errors import UnsupportedModelError
from atomflow.model.spec import ModelSpec

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def llama_config(**over) -> dict:
    """Llama-3.2-3B-Instruct's config.json as transformers 4.x writes it."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
           "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
           "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE),
           "max_position_embeddings": 131072, "tie_word_embeddings": True, "mlp_bias": False}
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("name,over,expect", [
    ("3.2-1b", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64),
     dict(head_dim=64, num_heads=32, num_kv_heads=8, tie_word_embeddings=True)),
    ("3.2-3b", {}, dict(head_dim=128, num_heads=24, q_dim=3072, kv_dim=1024, qkv_dim=5120)),
    ("3.1-8b", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    head_dim=None, tie_word_embeddings=False, rope_scaling=dict(LLAMA3_ROPE, factor=8.0)),
     dict(head_dim=128, rope_factor=8.0, tie_word_embeddings=False, group_size=4)),
    ("3.1-70b", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                     head_dim=None, tie_word_embeddings=False), dict(num_layers=80, group_size=8)),
    ("plain-rope", dict(rope_scaling=None, rope_theta=10000.0), dict(rope_type="default", rope_theta=10000.0)),
])
def test_supported_configs(name, over, expect):
    cfg = llama_config(**{k: v for k, v in over.items() if v is not None})
    for k, v in over.items():
        if v is None:
            cfg.pop(k)
    spec = ModelSpec.from_hf_config(cfg)
    for k, v in expect.items():
        assert getattr(spec, k) == v, (name, k)
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_transformers5_rope_parameters():
    cfg = llama_config()
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = dict(LLAMA3_ROPE, rope_theta=500000.0)
    assert ModelSpec.from_hf_config(cfg) == ModelSpec.from_hf_config(llama_config())


@pytest.mark.parametrize("over,needle", [
    (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "MistralForCausalLM"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(sliding_window=4096), "sliding-window"),
    (dict(hidden_act="gelu"), "gelu"),
    (dict(head_dim=96, num_attention_heads=32), "head_dim 96"),
    (dict(num_key_value_heads=5), "not divisible by num_key_value_heads 5"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (dict(hidden_size=3000, num_attention_heads=24, head_dim=128), "hidden_size = 3000"),
    (dict(intermediate_size=8200), "intermediate_size = 8200"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(vocab_size=0), "vocab_size"),
])
def test_unsupported_configs_name_the_problem(over, needle):
    with pytest.raises(UnsupportedModelError, match=None) as e:
        ModelSpec.from_hf_config(llama_config(**over))
    assert needle in str(e.value)


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, None])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_inv_freq_matches_transformers(rope, head_dim):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = llama_config(head_dim=head_dim, num_attention_heads=3072 // head_dim, rope_scaling=rope)
    spec = ModelSpec.from_hf_config(cfg)
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    hf = LlamaRotaryEmbedding(hf_cfg).inv_freq.numpy()
    # transformers' powf is vectorized (<= 1 ulp from correctly rounded); ours is correctly rounded.
    np.testing.assert_array_max_ulp(spec.rope_inv_freq(), hf, maxulp=1)
    if rope:
        ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, torch.device("cpu"))
        np.testing.assert_array_max_ulp(spec.rope_inv_freq(), ref.numpy(), maxulp=1)
        assert not np.array_equal(spec.rope_inv_freq(), ModelSpec.from_hf_config(
            llama_config(head_dim=head_dim, num_attention_heads=3072 // head_dim, rope_scaling=None)).rope_inv_freq())
