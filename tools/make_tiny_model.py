"""Write a random Hugging Face Llama, Qwen2, Qwen3 or Mistral directory (config, sharded safetensors,
tokenizer) with numpy only.

    python tools/make_tiny_model.py OUT_DIR [--preset tiny|tiny-tail|tiny-3072|llama-3.2-1b|llama-3.2-3b|llama-3.1-8b
        |qwen2.5-7b|qwen3-8b|mistral-7b] [--seed N] [--dtype bf16|fp16|fp32] [--untied] [--num-layers N]
        [--shard-size-mb N] [--transformers-version 4|5]

No real weights can be downloaded on our machines, so tests and benchmarks run on models built
here. The directory looks like a checkpoint from the Hub (Llama 3.x, Qwen2.5-7B, Qwen3-8B,
Mistral-7B-v0.3): `config.json` (the fields the Hub's config.json has, as transformers 4.x wrote
them, or as 5.x writes them with `--transformers-version 5`), `model.safetensors`
or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, `tokenizer.json`,
`tokenizer_config.json` (with the Llama 3 chat template), `special_tokens_map.json` and
`generation_config.json`. The tiny preset always writes two shards so the sharded path is
exercised. The Qwen2 preset adds q/k/v_proj.bias, the Qwen3 preset q_norm/k_norm.weight [head_dim]
per layer (HF's tensor names); rope is the plain one with theta 1e6 for the three non-Llama presets.

Tokenizer: a byte-level BPE (Llama 3's split regex + ByteLevel) trained on tools/corpus.txt,
a 1019-entry BPE vocab (256 bytes + merges) + 5 special tokens = 1024 ids (specials at 1019..1023:
<|begin_of_text|>, <|end_of_text|>, <|start_header_id|>, <|end_header_id|>, <|eot_id|>).
Every preset uses this same small tokenizer; the big presets keep their model's vocab size
(128256, 152064, 151936, 32768) for their embedding and lm_head, so a random model may emit ids
the tokenizer does not know (the detokenizer must map them to "").

Weights (seeded, deterministic, independent of the number of threads): every tensor is cut into
fixed chunks of CHUNK elements, each drawn from its own numpy generator keyed by
(seed, tensor index, chunk index), in a thread pool, and streamed straight to the shard file,
so memory stays at a few chunks however big the model is. The scales make the residual stream
dominated by the skip path, as in a trained model, so FP8 quantization error stays small
through the layers (the validator's original-weights thresholds hold) instead of compounding
chaotically; the price is that greedy decoding of a random model soon repeats itself:
  q/k/v/gate/up: N(0, 1/fan_in)        (unit-variance outputs from a unit-RMS normed input)
  o/down:        N(0, 0.04/fan_in)     (each layer adds a small update to the residual stream)
  embed/lm_head: N(0, 1/hidden)        (small enough that sampling at T ~ 1 still varies)
  norms:         1 + N(0, 0.05^2)        (q_norm / k_norm too)
  q/k/v biases:  N(0, 0.5^2)             (as tools/make_tiny_arch.py: large enough that a lost bias shows)
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import ml_dtypes
import numpy as np

CORPUS = Path(__file__).resolve().parent / "corpus.txt"
CHUNK = 1 << 22  # elements per independently seeded chunk; changing it changes every weight

BOS, EOT_TEXT, START_HEADER, END_HEADER, EOT_ID = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
SPECIAL_TOKENS = [BOS, EOT_TEXT, START_HEADER, END_HEADER, EOT_ID]
BPE_VOCAB = 1019  # + 5 special tokens = 1024

# Llama 3's pre-tokenizer split (tiktoken cl100k-style pattern).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Meta-Llama-3-8B-Instruct's template: no date, so prompts (and ground truth) do not change daily.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

DTYPES = {  # --dtype -> (numpy dtype, safetensors dtype, config torch_dtype)
    "bf16": (ml_dtypes.bfloat16, "BF16", "bfloat16"),
    "fp16": (np.float16, "F16", "float16"),
    "fp32": (np.float32, "F32", "float32"),
}


@dataclass(frozen=True)
class Preset:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int | None  # None: the trained tokenizer's size
    rope_factor: float
    original_max_pos: int
    max_pos: int
    tied: bool
    arch: str = "llama"  # llama | qwen2 (q/k/v bias) | qwen3 (q/k norm) | mistral
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5


PRESETS = {
    "tiny": Preset(256, 640, 3, 4, 2, 64, None, 8.0, 64, 16384, True),
    # SmolLM2-135M's widths (hidden 576 = 4 x 128 + 64: tail FP8 groups; 9 query heads on 3 KV heads)
    # on the tiny vocabulary and two layers.
    "tiny-tail": Preset(576, 1536, 2, 9, 3, 64, None, 8.0, 64, 16384, True),
    # Llama-3.2-3B's widths on the tiny vocabulary and two layers (the widths some plan choices are measured at).
    "tiny-3072": Preset(3072, 8192, 2, 24, 8, 128, None, 32.0, 8192, 131072, True),
    "llama-3.2-1b": Preset(2048, 8192, 16, 32, 8, 64, 128256, 32.0, 8192, 131072, True),
    "llama-3.2-3b": Preset(3072, 8192, 28, 24, 8, 128, 128256, 32.0, 8192, 131072, True),
    "llama-3.1-8b": Preset(4096, 14336, 32, 32, 8, 128, 128256, 8.0, 8192, 131072, False),
    # The other architectures' 7-8B shapes (plain rope: rope_factor 0 means no rope_scaling).
    "qwen2.5-7b": Preset(3584, 18944, 28, 28, 4, 128, 152064, 0.0, 0, 32768, False, "qwen2", 1e6, 1e-6),
    "qwen3-8b": Preset(4096, 12288, 36, 32, 8, 128, 151936, 0.0, 0, 40960, False, "qwen3", 1e6, 1e-6),
    "mistral-7b": Preset(4096, 14336, 32, 32, 8, 128, 32768, 0.0, 0, 32768, False, "mistral", 1e6, 1e-5),
}


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer():
    """Train the byte-level BPE on tools/corpus.txt; returns a `tokenizers.Tokenizer` (deterministic)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator([CORPUS.read_text(encoding="utf-8")], trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)  # appended after the BPE vocab, like Llama 3's 128000+
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [  # Llama 3: prepend <|begin_of_text|> when asked
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]),
        ]
    )
    return tok


def _write_tokenizer_files(out: Path, tok) -> dict:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "chat_template": LLAMA3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": True,
        "eos_token": EOT_ID,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOT_ID})
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids[BOS],
            "do_sample": True,
            "eos_token_id": [ids[EOT_TEXT], ids[EOT_ID]],
            "temperature": 0.6,
            "top_p": 0.9,
            "transformers_version": "4.45.0",
        },
    )
    return ids


# ----------------------------------------------------------------------------- config and shapes


def resolve_preset(preset: str, num_layers: int | None = None, untied: bool = False, vocab: int | None = None) -> Preset:
    """The preset with the command-line overrides applied (vocab fills in the tiny preset's None)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    p = PRESETS[preset]
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        p = replace(p, layers=num_layers)
    if untied:
        p = replace(p, tied=False)
    if p.vocab is None:
        p = replace(p, vocab=vocab if vocab is not None else BPE_VOCAB + len(SPECIAL_TOKENS))
    return p


def hf_tensor_shapes(preset: str | Preset, num_layers: int | None = None, untied: bool = False) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, in file order, for a preset (nothing is written)."""
    p = preset if isinstance(preset, Preset) else resolve_preset(preset, num_layers, untied)
    d, f, q, kv = p.hidden, p.intermediate, p.heads * p.head_dim, p.kv_heads * p.head_dim
    shapes = {"model.embed_tokens.weight": (p.vocab, d)}
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        shapes.update(
            {
                pre + "input_layernorm.weight": (d,),
                pre + "self_attn.q_proj.weight": (q, d),
                pre + "self_attn.k_proj.weight": (kv, d),
                pre + "self_attn.v_proj.weight": (kv, d),
            }
        )
        if p.arch == "qwen2":
            shapes.update(
                {pre + "self_attn.q_proj.bias": (q,), pre + "self_attn.k_proj.bias": (kv,), pre + "self_attn.v_proj.bias": (kv,)}
            )
        if p.arch == "qwen3":
            shapes.update({pre + "self_attn.q_norm.weight": (p.head_dim,), pre + "self_attn.k_norm.weight": (p.head_dim,)})
        shapes.update(
            {
                pre + "self_attn.o_proj.weight": (d, q),
                pre + "post_attention_layernorm.weight": (d,),
                pre + "mlp.gate_proj.weight": (f, d),
                pre + "mlp.up_proj.weight": (f, d),
                pre + "mlp.down_proj.weight": (d, f),
            }
        )
    shapes["model.norm.weight"] = (d,)
    if not p.tied:
        shapes["lm_head.weight"] = (p.vocab, d)
    return shapes


def _init_stats(name: str, shape: tuple[int, ...], p: Preset) -> tuple[float, float]:
    """(mean, std) of a tensor's random init; see the module docstring for why."""
    if name.endswith("norm.weight"):
        return 1.0, 0.05
    if name.endswith(".bias"):
        return 0.0, 0.5
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0.0, 1.0 / math.sqrt(p.hidden)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, 0.2 / math.sqrt(shape[1])
    return 0.0, 1.0 / math.sqrt(shape[1])


def config_dict(p: Preset, dtype: str, ids: dict, transformers_version: int) -> dict:
    """config.json as transformers 4.x (rope_theta + rope_scaling) or 5.x (rope_parameters) writes it."""
    if p.arch != "llama":
        return _arch_config_dict(p, dtype, ids, transformers_version)
    rope = {
        "factor": p.rope_factor,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": p.original_max_pos,
        "rope_type": "llama3",
    }
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOT_TEXT], ids[EOT_ID]],
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden,
        "initializer_range": 0.02,
        "intermediate_size": p.intermediate,
        "max_position_embeddings": p.max_pos,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": p.heads,
        "num_hidden_layers": p.layers,
        "num_key_value_heads": p.kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": p.tied,
        "use_cache": True,
        "vocab_size": p.vocab,
    }
    if transformers_version == 4:
        cfg.update(rope_scaling=rope, rope_theta=p.rope_theta, torch_dtype=DTYPES[dtype][2], transformers_version="4.45.0")
    elif transformers_version == 5:
        cfg.update(rope_parameters={**rope, "rope_theta": p.rope_theta}, dtype=DTYPES[dtype][2], transformers_version="5.23.0")
    else:
        raise ValueError(f"transformers_version must be 4 or 5, got {transformers_version}")
    return dict(sorted(cfg.items()))


# The Hub's config.json of each architecture's model, as transformers 4.x wrote it
# (Qwen2.5-7B, Qwen3-8B, Mistral-7B-v0.3), and the fields 5.x writes for the same config class
# (tests/test_tiny_model.py round-trips them through the installed transformers).
_ARCH_V4 = {
    "qwen2": ("Qwen2ForCausalLM", "4.43.1"),
    "qwen3": ("Qwen3ForCausalLM", "4.51.0"),
    "mistral": ("MistralForCausalLM", "4.42.0.dev0"),
}


def _arch_config_dict(p: Preset, dtype: str, ids: dict, transformers_version: int) -> dict:
    if transformers_version not in (4, 5):
        raise ValueError(f"transformers_version must be 4 or 5, got {transformers_version}")
    arch_name, v4_version = _ARCH_V4[p.arch]
    cfg = {
        "architectures": [arch_name],
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOT_TEXT], ids[EOT_ID]],
        "hidden_act": "silu",
        "hidden_size": p.hidden,
        "initializer_range": 0.02,
        "intermediate_size": p.intermediate,
        "max_position_embeddings": p.max_pos,
        "model_type": p.arch,
        "num_attention_heads": p.heads,
        "num_hidden_layers": p.layers,
        "num_key_value_heads": p.kv_heads,
        "rms_norm_eps": p.rms_eps,
        "sliding_window": None,
        "tie_word_embeddings": p.tied,
        "use_cache": True,
        "vocab_size": p.vocab,
    }
    if p.arch in ("qwen2", "qwen3"):
        # use_sliding_window false: every layer attends to the whole context.
        cfg.update(max_window_layers=p.layers, use_sliding_window=False)
    if p.arch == "qwen3":
        cfg.update(attention_bias=False, head_dim=p.head_dim)
    if transformers_version == 4:
        if p.arch == "qwen2":
            cfg.update(sliding_window=131072)  # Qwen2.5's file names a window that use_sliding_window turns off
        if p.arch == "qwen3":
            cfg.update(rope_scaling=None)
        if p.arch == "mistral" and p.head_dim != p.hidden // p.heads:
            cfg.update(head_dim=p.head_dim)  # Mistral v0.3's file has none (hidden / heads)
        cfg.update(rope_theta=p.rope_theta, torch_dtype=DTYPES[dtype][2], transformers_version=v4_version)
    else:
        if p.arch in ("qwen2", "qwen3"):
            cfg.update(layer_types=["full_attention"] * p.layers)
        if p.arch == "mistral":
            cfg.update(head_dim=p.head_dim)
        cfg.update(
            pad_token_id=None,
            rope_parameters={"rope_theta": p.rope_theta, "rope_type": "default"},
            dtype=DTYPES[dtype][2],
            transformers_version="5.23.0",
        )
    return dict(sorted(cfg.items()))


# ----------------------------------------------------------------------------- weights


def _chunk(seed: int, tensor_idx: int, chunk_idx: int, n: int, mean: float, std: float, np_dtype) -> np.ndarray:
    rng = np.random.default_rng([seed, tensor_idx, chunk_idx])
    x = rng.standard_normal(n, dtype=np.float32)
    x *= np.float32(std)
    if mean:
        x += np.float32(mean)
    return x.astype(np_dtype)


def _plan_shards(shapes: dict, itemsize: int, shard_bytes: int | None) -> list[list[str]]:
    """Greedy packing up to shard_bytes; None means exactly two shards cut at half the bytes."""
    sizes = {k: math.prod(s) * itemsize for k, s in shapes.items()}
    total, shards, cur, acc = sum(sizes.values()), [], [], 0
    for name, size in sizes.items():
        full = (acc + size > shard_bytes) if shard_bytes is not None else (acc >= total / 2 and len(shards) == 0)
        if cur and full:
            shards.append(cur)
            cur, acc = [], 0
        cur.append(name)
        acc += size
    shards.append(cur)
    return shards


def _write_shard(
    path: Path,
    names: list[str],
    shapes: dict,
    p: Preset,
    dtype: str,
    seed: int,
    tensor_index: dict,
    pool: ThreadPoolExecutor,
    window: int,
) -> None:
    """Hand-written safetensors: header first, then each tensor streamed chunk by chunk."""
    np_dtype, st_dtype, _ = DTYPES[dtype]
    itemsize = np.dtype(np_dtype).itemsize
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        nbytes = math.prod(shapes[name]) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    jobs = []  # (tensor, chunk) in file order
    for name in names:
        n = math.prod(shapes[name])
        mean, std = _init_stats(name, shapes[name], p)
        for c in range(math.ceil(n / CHUNK)):
            jobs.append((seed, tensor_index[name], c, min(CHUNK, n - c * CHUNK), mean, std, np_dtype))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        pending = collections.deque()
        for job in jobs:  # a bounded window of chunks in flight keeps memory flat
            pending.append(pool.submit(_chunk, *job))
            if len(pending) >= window:
                f.write(pending.popleft().result().view(np.uint8).data)
        while pending:
            f.write(pending.popleft().result().view(np.uint8).data)


def make_model(
    out_dir,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "bf16",
    untied: bool = False,
    num_layers: int | None = None,
    shard_size_mb: float | None = None,
    transformers_version: int = 4,
    threads: int | None = None,
) -> Path:
    """Write the random HF Llama directory and return its path. shard_size_mb None: two shards for
    the tiny preset, 2000 MB shards for the others."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if transformers_version not in (4, 5):
        raise ValueError(f"transformers_version must be 4 or 5, got {transformers_version}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    p = resolve_preset(preset, num_layers, untied, vocab=tok.get_vocab_size(with_added_tokens=True))
    ids = _write_tokenizer_files(out, tok)
    _write_json(out / "config.json", config_dict(p, dtype, ids, transformers_version))

    shapes = hf_tensor_shapes(p)
    itemsize = np.dtype(DTYPES[dtype][0]).itemsize
    if shard_size_mb is None and preset != "tiny":
        shard_size_mb = 2000
    shards = _plan_shards(shapes, itemsize, None if shard_size_mb is None else int(shard_size_mb * 2**20))
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    tensor_index = {name: i for i, name in enumerate(shapes)}
    threads = threads or os.cpu_count() or 1
    with ThreadPoolExecutor(threads) as pool:
        for fname, names in zip(files, shards):
            _write_shard(out / fname, names, shapes, p, dtype, seed, tensor_index, pool, window=2 * threads)
    if len(shards) > 1:
        _write_json(
            out / "model.safetensors.index.json",
            {
                "metadata": {"total_size": sum(math.prod(s) * itemsize for s in shapes.values())},
                "weight_map": {name: fname for fname, names in zip(files, shards) for name in names},
            },
        )
    return out


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--untied", action="store_true", help="write a separate lm_head.weight")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument(
        "--shard-size-mb", type=float, default=None, help="max shard size (default: 2 shards for tiny, 2000 MB otherwise)"
    )
    ap.add_argument(
        "--transformers-version",
        type=int,
        default=4,
        choices=(4, 5),
        help="config.json rope keys as transformers 4.x or 5.x writes them",
    )
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = make_model(
        a.out_dir, a.preset, a.seed, a.dtype, a.untied, a.num_layers, a.shard_size_mb, a.transformers_version, a.threads
    )
    nbytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    dt = time.perf_counter() - t0
    print(f"wrote {out} ({a.preset}, {nbytes / 2**30:.2f} GiB) in {dt:.1f} s ({nbytes / dt / 1e9:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
