"""Dump Hugging Face transformers' fp32 activations, every layer, for `atomflow validate`.

    python tools/gen_ground_truth.py HF_DIR --model MODEL.atomflow -o ground_truth/NAME/
        [--prompt-tokens 32] [--steps 16] [--prompt TEXT] [--seed 0]

Runs transformers (torch, fp32, CPU, eager attention) twice over the same token sequence:
  dequant.safetensors   the file's dequantized weights: isolates the engine's kernel error
  original.safetensors  the HF checkpoint's own weights: shows the quantization error
The sequence is a prompt (random ids, or --prompt text through the model's tokenizer) and
--steps greedy decode tokens chosen by the dequantized model, fed one at a time through HF's
KV cache, so prompt (prefill) and decode positions are both covered.

Probes, captured by forward hooks on HF's own modules (no re-implementation), stored as
fp32 [positions, dim] under "<probe>.<layer>":
  attn_norm   input RMSNorm output          (input_layernorm)
  attn_out    attention output after o_proj (self_attn, before the residual add)
  resid_mid   residual stream after attention (input of post_attention_layernorm)
  mlp_out     MLP output                    (mlp, before the residual add)
  layer_out   decoder layer output          (the layer)
and "final_norm" [positions, d] and "logits" [positions, vocab]. Metadata (safetensors
__metadata__): prompt ids, decode ids, positions, the model file's checksum, the
transformers version, which reference, probe names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYER_PROBES = ("attn_norm", "attn_out", "resid_mid", "mlp_out", "layer_out")
FORMAT = "atomflow-ground-truth-1"


def _capture(hf, store: dict):
    """Registers hooks that append each probe's rows to store[name] (list of [M, dim] arrays)."""

    def put(name):
        def fn(t):
            t = t[0] if isinstance(t, tuple) else t
            store.setdefault(name, []).append(t.detach()[0].float().numpy().copy())

        return fn

    hooks = []
    for i, layer in enumerate(hf.model.layers):
        hooks.append(layer.input_layernorm.register_forward_hook(lambda m, a, o, f=put(f"attn_norm.{i}"): f(o)))
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o, f=put(f"attn_out.{i}"): f(o)))
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a, f=put(f"resid_mid.{i}"): f(a[0])))
        hooks.append(layer.mlp.register_forward_hook(lambda m, a, o, f=put(f"mlp_out.{i}"): f(o)))
        hooks.append(layer.register_forward_hook(lambda m, a, o, f=put(f"layer_out.{i}"): f(o)))
    hooks.append(hf.model.norm.register_forward_hook(lambda m, a, o, f=put("final_norm"): f(o)))
    return hooks


def run_probes(hf, prompt: list[int], decode: list[int] | None, steps: int) -> tuple[dict, list[int]]:
    """Prompt in one forward, then one token at a time through the KV cache. decode=None picks
    greedy tokens; else feeds the given ones. Returns ({name: [T, dim]}, decode ids)."""
    import torch

    store: dict = {}
    hooks = _capture(hf, store)
    logits, fed = [], []
    try:
        with torch.no_grad():
            r = hf(torch.tensor([prompt]), use_cache=True)
            logits.append(r.logits[0].float().numpy())
            for i in range(steps):
                tok = int(np.argmax(logits[-1][-1])) if decode is None else decode[i]
                fed.append(tok)
                r = hf(torch.tensor([[tok]]), past_key_values=r.past_key_values, use_cache=True)
                logits.append(r.logits[0].float().numpy())
    finally:
        for h in hooks:
            h.remove()
    out = {k: np.concatenate(v, axis=0).astype(np.float32) for k, v in store.items()}
    out["logits"] = np.concatenate(logits, axis=0).astype(np.float32)
    return out, fed


def load_hf_original(hf_dir: Path):
    """transformers' model of the checkpoint's own architecture (an HF directory, or a .gguf file
    through transformers' GGUF loader), fp32, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_dir = Path(hf_dir)
    if hf_dir.suffix.lower() == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            hf_dir.parent, gguf_file=hf_dir.name, dtype=torch.float32, attn_implementation="eager"
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return hf.eval()


def generate(
    hf_dir: str | Path,
    model_path: str | Path,
    out_dir: str | Path,
    prompt_tokens: int = 32,
    steps: int = 16,
    prompt_text: str | None = None,
    seed: int = 0,
    original=None,
) -> Path:
    """original: the loaded transformers model of hf_dir, when the caller has it already."""
    import transformers
    from hf_reference import load_hf_dequantized
    from safetensors.numpy import save_file

    from atomflow.model.fileformat import AtomflowFile
    from atomflow.model.tokenizer import Tokenizer

    model = AtomflowFile(model_path)
    if prompt_text is not None:
        tok = Tokenizer.from_metadata(
            model.raw_metadata["tokenizer"],
            model.metadata_json("tokenizer_config", {}),
            model.raw_metadata.get("chat_template", ""),
            model.metadata_json("generation_config", {}),
        )
        prompt = tok.encode(prompt_text)
    else:
        prompt = np.random.default_rng(seed).integers(0, model.spec.vocab_size, prompt_tokens).tolist()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    decode = None
    loaders = (("dequant", lambda: load_hf_dequantized(model)), ("original", lambda: original or load_hf_original(hf_dir)))
    for ref, loader in loaders:
        probes, decode = run_probes(loader(), prompt, decode, steps)
        meta = dict(
            format=FORMAT,
            reference=ref,
            prompt_ids=json.dumps(prompt),
            decode_ids=json.dumps(decode),
            positions=json.dumps([0, len(prompt) + len(decode)]),
            model_checksum=model.checksum,
            transformers_version=transformers.__version__,
            num_layers=str(model.spec.num_layers),
            probes=json.dumps(list(LAYER_PROBES) + ["final_norm", "logits"]),
        )
        save_file(probes, str(out / f"{ref}.safetensors"), metadata=meta)
        print(
            f"wrote {out / (ref + '.safetensors')}: {len(probes)} tensors, {len(prompt)} prompt + {len(decode)} decode positions"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", help="the HF checkpoint (or .gguf file) the model file was quantized from")
    ap.add_argument("--model", required=True, help="the .atomflow file")
    ap.add_argument("-o", "--output", required=True, help="output directory")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt", default=None, help="prompt text (default: random token ids)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    generate(a.hf_dir, a.model, a.output, a.prompt_tokens, a.steps, a.prompt, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
