"""ModelSpec from HF config.json: the supported Llama family, both transformers config styles,
RoPE frequencies identical to transformers', and clear rejection of everything else."""

import numpy as np
import pytest

from atomflow.errors import UnsupportedModelError
from atomflow.model.spec import ModelSpec

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama_config(**over) -> dict:
    """Llama-3.2-3B-Instruct's config.json as transformers 4.x writes it."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(LLAMA3_ROPE),
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "mlp_bias": False,
    }
    cfg.update(over)
    return cfg


@pytest.mark.parametrize(
    "name,over,expect",
    [
        (
            "3.2-1b",
            dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64),
            dict(head_dim=64, num_heads=32, num_kv_heads=8, tie_word_embeddings=True),
        ),
        ("3.2-3b", {}, dict(head_dim=128, num_heads=24, q_dim=3072, kv_dim=1024, qkv_dim=5120)),
        (
            "3.1-8b",
            dict(
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                head_dim=None,
                tie_word_embeddings=False,
                rope_scaling=dict(LLAMA3_ROPE, factor=8.0),
            ),
            dict(head_dim=128, rope_factor=8.0, tie_word_embeddings=False, group_size=4),
        ),
        (
            "3.1-70b",
            dict(
                hidden_size=8192,
                intermediate_size=28672,
                num_hidden_layers=80,
                num_attention_heads=64,
                head_dim=None,
                tie_word_embeddings=False,
            ),
            dict(num_layers=80, group_size=8),
        ),
        ("plain-rope", dict(rope_scaling=None, rope_theta=10000.0), dict(rope_type="default", rope_theta=10000.0)),
    ],
)
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


@pytest.mark.parametrize(
    "over,needle",
    [
        (dict(architectures=["GemmaForCausalLM"], model_type="gemma"), "architectures = ['GemmaForCausalLM']"),
        (dict(architectures=["MixtralForCausalLM"], model_type="mixtral"), "MixtralForCausalLM"),
        (dict(architectures=None, model_type="deepseek_v3"), "model_type = 'deepseek_v3'"),
        (dict(num_local_experts=8), "num_local_experts = 8"),
        (dict(kv_lora_rank=512), "kv_lora_rank = 512"),
        (dict(attention_bias=True), "attention_bias = true"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(sliding_window=4096), "sliding_window = 4096"),
        (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True), "use_sliding_window = true"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types contains 'sliding_attention'"),
        (dict(hidden_act="gelu"), "gelu"),
        (dict(head_dim=112, num_attention_heads=32), "head_dim 112"),
        (dict(num_key_value_heads=5), "not divisible by num_key_value_heads 5"),
        (dict(num_attention_heads=34, num_key_value_heads=1, head_dim=64), "= 34 (supported: 1..16)"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type = 'yarn'"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_type = 'dynamic'"),
        (dict(hidden_size=3000, num_attention_heads=24, head_dim=128), "hidden_size = 3000"),
        (dict(intermediate_size=8200), "intermediate_size = 8200"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
        (dict(vocab_size=0), "vocab_size"),
    ],
)
def test_unsupported_configs_name_the_problem(over, needle):
    cfg = llama_config(**over)
    if cfg.get("architectures") is None:
        cfg.pop("architectures")
    with pytest.raises(UnsupportedModelError, match=None) as e:
        ModelSpec.from_hf_config(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value)


def qwen2_config(**over) -> dict:
    """Qwen2.5-7B-Instruct's config.json (28 query / 4 KV heads: 7 per KV head)."""
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }
    cfg.update(over)
    return cfg


@pytest.mark.parametrize(
    "cfg,expect,cuda",
    [
        (
            qwen2_config(),
            dict(arch="qwen2", attention_bias=True, qk_norm=False, head_dim=128, group_size=7, sliding_window=0),
            None,
        ),
        (
            qwen2_config(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=8),
            dict(group_size=5),
            None,
        ),
        (
            qwen2_config(
                architectures=["Qwen3ForCausalLM"],
                model_type="qwen3",
                hidden_size=4096,
                intermediate_size=12288,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                attention_bias=False,
            ),
            dict(arch="qwen3", attention_bias=False, qk_norm=True, head_dim=128),
            None,  # the CUDA engine runs the q/k norms (rope.cu, the split QKV path)
        ),
        (
            qwen2_config(
                architectures=["Qwen3ForCausalLM"],
                model_type="qwen3",
                hidden_size=1024,
                intermediate_size=3072,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
            ),  # head_dim * heads != hidden
            dict(q_dim=2048, hidden_size=1024),
            None,
        ),
        (
            llama_config(
                architectures=["MistralForCausalLM"],
                model_type="mistral",
                sliding_window=4096,
                max_position_embeddings=32768,
                rope_scaling=None,
            ),
            dict(arch="mistral", sliding_window=4096, max_context_limit=4096),
            None,
        ),
        (
            llama_config(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None, rope_scaling=None),
            dict(arch="mistral", sliding_window=0, max_context_limit=131072),
            None,
        ),
        (
            llama_config(
                hidden_size=576,
                intermediate_size=1536,
                num_attention_heads=9,
                num_key_value_heads=3,
                head_dim=64,
                rope_scaling=None,
            ),
            dict(group_size=3, q_dim=576),
            None,
        ),  # SmolLM2's shapes: tail FP8 groups (576 = 4 x 128 + 64), which the CUDA engine runs
        (
            llama_config(rope_scaling={"rope_type": "linear", "factor": 2.0}),
            dict(rope_type="linear", rope_factor=2.0),
            None,
        ),  # the CUDA engine takes the inv_freq table, which carries the factor
        (llama_config(head_dim=96, num_attention_heads=32), dict(head_dim=96), None),
        (llama_config(), dict(arch="llama"), None),
    ],
)
def test_architectures(cfg, expect, cuda):
    spec = ModelSpec.from_hf_config(cfg)
    for k, v in expect.items():
        assert getattr(spec, k) == v, k
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    why = spec.cuda_unsupported()
    assert (why is None) if cuda is None else (cuda in why and "\n" not in why), why


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_cuda_runs_every_head_ratio(head_dim):
    """The CUDA attention takes 1..16 query heads per KV head at every supported head_dim
    (attention_decode.cu): nothing about the heads is refused."""
    for g in range(1, 17):
        spec = ModelSpec.from_hf_config(llama_config(num_attention_heads=8 * g, num_key_value_heads=8, head_dim=head_dim))
        assert spec.group_size == g and spec.cuda_unsupported() is None, (g, spec.cuda_unsupported())


def test_version1_spec_dict_loads_as_llama():
    d = ModelSpec.from_hf_config(llama_config()).to_dict()
    for k in ("arch", "attention_bias", "qk_norm", "sliding_window"):
        d.pop(k)
    assert ModelSpec.from_dict(d) == ModelSpec.from_hf_config(llama_config())


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, None, {"rope_type": "linear", "factor": 4.0}])
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
        ref, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, torch.device("cpu"))
        np.testing.assert_array_max_ulp(spec.rope_inv_freq(), ref.numpy(), maxulp=1)
        assert not np.array_equal(
            spec.rope_inv_freq(),
            ModelSpec.from_hf_config(
                llama_config(head_dim=head_dim, num_attention_heads=3072 // head_dim, rope_scaling=None)
            ).rope_inv_freq(),
        )
