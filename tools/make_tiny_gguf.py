"""Write an HF directory (tools/make_tiny_arch.py, tools/make_tiny_model.py) as a GGUF file the way
llama.cpp's converter does: `{arch}.*` metadata, the byte-level BPE tokenizer as tokens / types /
merges, q and k rows permuted for `llama`, tensors in F32 or Q8_0 (gguf.quants).

    python tools/make_tiny_gguf.py HF_DIR OUT.gguf [--type F32|Q8_0]

For tests of atomflow/model/gguf.py against transformers' own GGUF loader on each architecture.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir, out, qtype: str = "F32") -> Path:
    import gguf
    from safetensors.numpy import load_file

    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    sd = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        sd.update({k: np.asarray(v, dtype=np.float32) for k, v in load_file(str(f)).items()})
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(hf_dir.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(specials)
    tokens = [None] * cfg["vocab_size"]
    for t, i in vocab.items():
        tokens[i] = t
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    types = [3 if t in specials else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")  # make_tiny_model's tokenizer splits with Llama 3's regex
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tcfg["bos_token"]])
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_add_bos_token(True)
    w.add_chat_template(tcfg["chat_template"])

    def put(name: str, a: np.ndarray) -> None:
        if qtype == "Q8_0" and a.ndim == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf, g in LAYER.items():
            name = f"model.layers.{i}.{hf}"
            if name not in sd:
                continue
            a = sd[name]
            if arch == "llama" and hf.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                a = permute(a, heads if "q_proj" in hf else kv)
            put(f"blk.{i}.{g}", a)
    put("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd and not cfg.get("tie_word_embeddings"):
        put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    ap.add_argument("--type", choices=["F32", "Q8_0"], default="F32")
    a = ap.parse_args(argv)
    print(f"wrote {write_gguf(a.hf_dir, a.out, a.type)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
