"""Hugging Face transformers (torch, fp32, CPU) running a .atomflow file's dequantized weights.

The ground truth for kernel error: the same weights the engine computes with, through HF's
own Llama code. Used by the tests and by the ground-truth tools; needs torch + transformers.
"""

from __future__ import annotations

import json

import numpy as np

# spec.arch -> (transformers config class, model class)
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def hf_config(model) -> dict:
    """transformers config kwargs for an AtomflowFile's spec."""
    s = model.spec
    rope = None
    if s.rope_type == "llama3":
        rope = dict(
            rope_type="llama3",
            factor=s.rope_factor,
            low_freq_factor=s.rope_low_freq_factor,
            high_freq_factor=s.rope_high_freq_factor,
            original_max_position_embeddings=s.rope_original_max_position_embeddings,
        )
    elif s.rope_type == "linear":
        rope = dict(rope_type="linear", factor=s.rope_factor)
    cfg = dict(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        rms_norm_eps=s.rms_norm_eps,
        rope_theta=s.rope_theta,
        rope_scaling=rope,
        max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=False,
        hidden_act="silu",
    )
    if s.arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    elif s.arch == "mistral":
        cfg.update(sliding_window=None)
    elif s.arch in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False)
        if s.arch == "qwen3":
            cfg.update(attention_bias=False)
    return cfg


def hf_classes(arch: str):
    import transformers

    conf, model = HF_CLASSES[arch]
    return getattr(transformers, conf), getattr(transformers, model)


def load_hf_dequantized(model):
    """transformers' own model class for the spec's arch (fp32, eager attention) holding exactly the
    file's dequantized weights."""
    import torch

    s = model.spec
    config_cls, model_cls = hf_classes(s.arch)
    cfg = config_cls(**hf_config(model))
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        hf = model_cls(cfg)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    sd = {
        "model.embed_tokens.weight": t(model.weight_f32("embed")),
        "model.norm.weight": t(model.weight_f32("final_norm")),
        "lm_head.weight": t(model.lm_head_f32()),
    }
    for i in range(s.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = np.split(model.weight_f32(p + "wqkv"), [s.q_dim, s.q_dim + s.kv_dim])
        gate, up = np.split(model.weight_f32(p + "w13"), 2)
        sd.update(
            {
                h + "self_attn.q_proj.weight": t(q),
                h + "self_attn.k_proj.weight": t(k),
                h + "self_attn.v_proj.weight": t(v),
                h + "self_attn.o_proj.weight": t(model.weight_f32(p + "wo")),
                h + "mlp.gate_proj.weight": t(gate),
                h + "mlp.up_proj.weight": t(up),
                h + "mlp.down_proj.weight": t(model.weight_f32(p + "w2")),
                h + "input_layernorm.weight": t(model.weight_f32(p + "attn_norm")),
                h + "post_attention_layernorm.weight": t(model.weight_f32(p + "mlp_norm")),
            }
        )
        if s.attention_bias:
            qb, kb, vb = np.split(model.weight_f32(p + "bqkv"), [s.q_dim, s.q_dim + s.kv_dim])
            sd.update(
                {h + "self_attn.q_proj.bias": t(qb), h + "self_attn.k_proj.bias": t(kb), h + "self_attn.v_proj.bias": t(vb)}
            )
        if s.qk_norm:
            sd.update(
                {
                    h + "self_attn.q_norm.weight": t(model.weight_f32(p + "q_norm")),
                    h + "self_attn.k_norm.weight": t(model.weight_f32(p + "k_norm")),
                }
            )
    hf.load_state_dict(sd, assign=True, strict=True)
    hf.model.rotary_emb.__init__(cfg)  # meta-device buffers: recompute inv_freq on the CPU
    return hf.eval()


def greedy_logits(hf, prompt_ids, steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Last-position logits after the prompt and after each of `steps` greedy decode steps
    (through HF's KV cache), and the greedy tokens fed."""
    import torch

    out, fed = [], []
    with torch.no_grad():
        r = hf(torch.tensor([list(prompt_ids)]), use_cache=True)
        for i in range(steps + 1):
            logits = r.logits[0, -1].numpy().astype(np.float32)
            out.append(logits)
            if i == steps:
                break
            tok = int(np.argmax(logits))
            fed.append(tok)
            r = hf(torch.tensor([[tok]]), past_key_values=r.past_key_values, use_cache=True)
    return out, fed


if __name__ == "__main__":  # quick look: python tools/hf_reference.py MODEL.atomflow
    import sys

    from atomflow.model.fileformat import AtomflowFile

    m = AtomflowFile(sys.argv[1])
    print(json.dumps(hf_config(m), indent=1))
