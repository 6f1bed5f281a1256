"""Write a random tiny Hugging Face directory of any supported architecture with transformers' own
classes (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM).

    python tools/make_tiny_arch.py OUT_DIR --arch qwen2|qwen3|mistral|llama [--preset NAME] [--seed N]

The shapes are chosen to be awkward: sizes that are multiples of 64 but not of 128 (a tail FP8
group), 3, 5, 7 and 16 query heads per KV head, Qwen3's head_dim independent of hidden / heads,
head_dim 80, 96 and 256.
Every parameter is redrawn (transformers initializes biases to zero and norms to one, which
would hide a mapping error): weights N(0, 1/fan_in), o/down smaller, biases N(0, 0.5^2), norms
1 + N(0, 0.1^2). The tokenizer is tools/make_tiny_model.py's (1024 ids, Llama 3 chat template).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# name -> (arch, hidden, intermediate, layers, heads, kv_heads, head_dim, extra config)
PRESETS = {
    "llama-tail": ("llama", 192, 320, 2, 3, 1, 64, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": ("mistral", 256, 512, 2, 4, 2, 64, {"sliding_window": 4096}),
    "qwen2": ("qwen2", 448, 576, 2, 7, 1, 64, {"use_sliding_window": False, "sliding_window": 4096}),
    "qwen2-r5": ("qwen2", 320, 640, 2, 10, 2, 32 * 2, {}),
    "qwen3": ("qwen3", 192, 384, 2, 4, 2, 128, {"attention_bias": False}),
    "llama-r16": ("llama", 256, 512, 2, 16, 1, 64, {}),
    # Shapes the CUDA engine runs (sizes multiples of 128 and of the heads, no bias or q/k norm): GQA ratios 7
    # and 5, and head_dim 80, 96, 256 (the last at ratio 8: two blocks of 4 query heads per KV head).
    "llama-r7": ("llama", 896, 512, 2, 14, 2, 64, {}),
    "llama-r5": ("llama", 640, 512, 2, 10, 2, 128, {}),
    "llama-d80": ("llama", 256, 512, 2, 8, 2, 80, {}),
    "llama-d96": ("llama", 256, 512, 2, 8, 1, 96, {}),
    "llama-d256": ("llama", 256, 512, 2, 8, 1, 256, {}),
    # Llama-3.1-8B's ratio and head_dim (4, 128): the attention plan halved (StepPlan::attn_halved).
    "llama-r4-d128": ("llama", 256, 512, 2, 4, 1, 128, {}),
    # The Qwen extras on the GPU (tests/test_architectures_gpu.py); qwen3-d128: head_dim 128 while
    # hidden / heads = 64.
    "qwen2-g2": ("qwen2", 256, 512, 2, 4, 2, 64, {"use_sliding_window": False}),
    "qwen3-d128": ("qwen3", 256, 512, 2, 4, 1, 128, {"attention_bias": False}),
}
DEFAULT_PRESET = {"llama": "llama-tail", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def make_arch_model(out_dir, preset: str, seed: int = 0) -> Path:
    import torch
    import transformers
    from make_tiny_model import _write_tokenizer_files, build_tokenizer

    from atomflow.model.spec import ARCHITECTURES

    arch, hidden, inter, layers, heads, kv, head_dim, extra = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = _write_tokenizer_files(out, tok)
    hf_arch = next(k for k, v in ARCHITECTURES.items() if v == arch)
    config_cls = getattr(transformers, hf_arch.replace("ForCausalLM", "Config"))
    cfg = config_cls(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=ids["<|eot_id|>"],
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, hf_arch)(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(0.2 * torch.randn_like(p) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    model.save_pretrained(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--arch", choices=sorted(DEFAULT_PRESET), default=None)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    preset = a.preset or DEFAULT_PRESET[a.arch or "qwen2"]
    print(f"wrote {make_arch_model(a.out, preset, a.seed)} ({preset})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
