"""Quality of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) on real English prose, in full,
and where the FP8 error enters.

    python tools/smollm2_quality.py [--ctx 1024 --stride 512] [--breakdown-windows 4] [--json OUT]

Text: GPL-3, GPL-2, LGPL-2.1 and GFDL-1.3 from /usr/share/common-licenses (Debian ships them on
every machine): 22.8K SmolLM2 tokens, so ctx 1024 / stride 512 scores ~22K tokens.
1. perplexity of the .atomflow file (numpy reference, lm_head FP8 and BF16) and of transformers
   on the GGUF's own weights, over the whole text;
2. the breakdown: the numpy reference with the GGUF's fp32 weights, FP8 (the file's dequantized
   weights) swapped in for one class of matrices at a time, over the first N windows.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXTS = [f"/usr/share/common-licenses/{n}" for n in ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3")]
# variant -> file matrices taken in FP8 (everything else: the GGUF's weights in fp32)
VARIANTS = {
    "gguf fp32 (no FP8)": (),
    "FP8 wqkv": ("wqkv",),
    "FP8 wo": ("wo",),
    "FP8 w13 (gate/up)": ("w13",),
    "FP8 w2 (down)": ("w2",),
    "FP8 lm_head": ("lm_head",),
    "bf16 embedding": ("embed",),
    "FP8 all linear, lm_head not": ("wqkv", "wo", "w13", "w2"),
    "FP8 all (the file)": ("wqkv", "wo", "w13", "w2", "lm_head", "embed"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--breakdown-windows", type=int, default=4, help="windows per breakdown variant (0: skip)")
    ap.add_argument("--skip-full", action="store_true", help="only the breakdown")
    ap.add_argument("--json", default=None, help="write every figure here")
    a = ap.parse_args(argv)

    from atomflow.engine import Engine
    from atomflow.model.default import default_gguf
    from atomflow.model.gguf import GGUFSource
    from atomflow.model.quantize import quantize
    from atomflow.perplexity import engine_logits_fn, hf_logits_fn, read_text, score

    gguf = default_gguf()
    work = Path(tempfile.mkdtemp(prefix="smollm2-quality-"))
    files = {}
    for head in ("fp8", "bf16"):
        files[head] = work / f"smollm2-{head}.atomflow"
        quantize(gguf, files[head], lm_head=head, progress=False, log=lambda s: None)
    eng = Engine.load(files["fp8"], backend="cpu", max_context=a.ctx)
    tokens = eng.tokenizer.encode(read_text(TEXTS), add_special_tokens=False)
    print(f"text: {len(tokens)} tokens ({', '.join(Path(t).name for t in TEXTS)}); ctx {a.ctx}, stride {a.stride}")
    out: dict = {"tokens": len(tokens), "ctx": a.ctx, "stride": a.stride, "full": {}, "breakdown": {}}

    hf_fn, hf_who = hf_logits_fn(gguf)
    if not a.skip_full:
        runs = [score("transformers, GGUF weights (fp32)", tokens, a.ctx, a.stride, hf_fn)]
        for head, path in files.items():
            e = Engine.load(path, backend="cpu", max_context=a.ctx)
            runs.append(score(f"atomflow cpu, lm_head {head}", tokens, a.ctx, a.stride, engine_logits_fn(e)))
        for r in runs:
            print(f"{r.line()}  ratio {r.ppl / runs[0].ppl:.4f}")
            out["full"][r.who] = dict(r.to_dict(), ratio=r.ppl / runs[0].ppl)

    if a.breakdown_windows:
        src = GGUFSource(gguf)
        s = src.spec
        exact = {"embed": src.tensor("model.embed_tokens.weight"), "lm_head": src.tensor("model.embed_tokens.weight")}
        for i in range(s.num_layers):
            h = f"model.layers.{i}."
            exact[f"{i}.wqkv"] = np.concatenate([src.tensor(h + f"self_attn.{p}_proj.weight") for p in "qkv"])
            exact[f"{i}.wo"] = src.tensor(h + "self_attn.o_proj.weight")
            exact[f"{i}.w13"] = np.concatenate([src.tensor(h + "mlp.gate_proj.weight"), src.tensor(h + "mlp.up_proj.weight")])
            exact[f"{i}.w2"] = src.tensor(h + "mlp.down_proj.weight")
            exact[f"{i}.attn_norm"] = src.tensor(h + "input_layernorm.weight")
            exact[f"{i}.mlp_norm"] = src.tensor(h + "post_attention_layernorm.weight")
        final_norm = src.tensor("model.norm.weight")
        m = eng.model
        wins = a.breakdown_windows
        base = score("transformers", tokens, a.ctx, a.stride, hf_fn, max_windows=wins)
        print(f"breakdown over {base.scored_tokens} tokens: transformers on the GGUF weights ppl {base.ppl:.4f}")
        out["breakdown"]["transformers"] = base.to_dict()
        for name, fp8 in VARIANTS.items():
            ref = Engine.load(files["fp8"], backend="cpu", max_context=a.ctx)
            r = ref.backend.ref
            r.embed = m.weight_f32("embed") if "embed" in fp8 else exact["embed"]
            r.lm_head = m.weight_f32("lm_head") if "lm_head" in fp8 else exact["lm_head"]
            r.final_norm = final_norm
            for i, L in enumerate(r.layers):
                for k in ("wqkv", "wo", "w13", "w2"):
                    L[k] = m.weight_f32(f"layers.{i}.{k}") if k in fp8 else exact[f"{i}.{k}"]
                L["attn_norm"], L["mlp_norm"] = exact[f"{i}.attn_norm"], exact[f"{i}.mlp_norm"]
            res = score(name, tokens, a.ctx, a.stride, engine_logits_fn(ref), max_windows=wins)
            print(f"  {name:<32} ppl {res.ppl:.4f}  ratio {res.ppl / base.ppl:.4f}")
            out["breakdown"][name] = dict(res.to_dict(), ratio=res.ppl / base.ppl)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
