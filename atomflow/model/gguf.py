"""A GGUF file as the quantizer's source: weights dequantized to fp32 with the `gguf` package,
llama.cpp's q/k row permutation undone, the config, tokenizer and chat template rebuilt from the
metadata. The quantizer reads it through the same interface as an HF directory (tensors by
their Hugging Face names), so one mapping writes both.

    src = GGUFSource("model.gguf")          # checks architecture, tensor types, shapes; writes nothing
    src.spec                                # ModelSpec, through ModelSpec.from_hf_config
    src.rows("model.layers.0.self_attn.q_proj.weight", shape)   # fp32 row blocks
    src.metadata("fp8")                     # the .atomflow metadata (tokenizer.json built with `tokenizers`)

Checked against transformers' own GGUF loader (from_pretrained(dir, gguf_file=...)): the same
dequantized weights, token ids and chat prompt (tests/test_gguf.py, tests/test_smollm2.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from atomflow import __version__
from atomflow.errors import FormatError, UnsupportedModelError
from atomflow.model.spec import QUANT_GROUP, ModelSpec

# general.architecture -> HF architecture. llama.cpp writes Mistral as "llama".
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED = ("llama",)  # llama.cpp's converter interleaves q/k rows of these (rotate-half -> GPT-J pairs)
ROWS_PER_BLOCK = 4096

# HF name -> GGUF name
_LAYER = {
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
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# The pre-tokenizer split of each `tokenizer.ggml.pre`, as transformers' GGUF loader chooses it
# (a byte-level vocabulary must be split the way its merges were learned). Absent: GPT-2's own.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _gguf():
    try:
        import gguf
    except ImportError:
        raise UnsupportedModelError("reading a GGUF file needs the gguf package (pip install gguf)") from None
    return gguf


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (convert_hf_to_gguf's LlamaModel.permute): rows of each head
    go from (pairs, 2) back to (2, halves). w [n_head * head_dim, ...] (a weight or a bias)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    """A checked GGUF model, read lazily (the file is memory-mapped; one tensor is dequantized at a time)."""

    def __init__(self, path: str | Path, lm_head_fp8: bool = True):
        gguf = _gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {self.path}")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the reader raises ValueError, struct/numpy errors, ... on a bad file
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise FormatError(f"{self.path}: not a valid GGUF file (truncated or corrupt: {first})") from None
        self.meta = {name: f for name, f in self.reader.fields.items()}
        self.arch = self._value("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: unsupported: general.architecture = {self.arch!r} (supported: {', '.join(ARCHITECTURES)})"
            )
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.tensors.values():
            qtype = gguf.GGMLQuantizationType(t.tensor_type)
            if (
                qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
                and qtype not in gguf.quants._type_traits
            ):
                raise UnsupportedModelError(
                    f"{self.path}: tensor {t.name}: unsupported GGUF type {qtype.name} (the gguf package cannot dequantize it)"
                )
        self.dtypes: set[str] = set()
        self.config = self._hf_config()
        self.spec = ModelSpec.from_hf_config(self.config, lm_head_fp8=lm_head_fp8)
        self._check_shapes()

    # -- metadata ---------------------------------------------------------------------------------
    def _value(self, key: str, default=None):
        f = self.meta.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception:
            raise FormatError(f"{self.path}: metadata {key} cannot be read (truncated or corrupt)") from None

    def _arch_value(self, key: str, default=None):
        return self._value(f"{self.arch}.{key}", default)

    def _hf_config(self) -> dict:
        """config.json equivalent, validated by ModelSpec.from_hf_config like any HF config."""
        a = self._arch_value
        kv = a("attention.head_count_kv")
        if isinstance(kv, list):  # per-layer KV heads (variable GQA): the engine needs one value
            if len(set(kv)) != 1:
                raise UnsupportedModelError(
                    f"{self.path}: unsupported: {self.arch}.attention.head_count_kv varies by layer ({sorted(set(kv))})"
                )
            kv = kv[0]
        hidden, heads = a("embedding_length"), a("attention.head_count")
        head_dim = a("attention.key_length") or (hidden // heads if hidden and heads else None)
        rot = a("rope.dimension_count")
        if rot is not None and head_dim is not None and rot != head_dim:
            raise UnsupportedModelError(
                f"{self.path}: unsupported: {self.arch}.rope.dimension_count = {rot} (partial rotary; head_dim {head_dim})"
            )
        if "rope_freqs.weight" in self.tensors:
            raise UnsupportedModelError(
                f"{self.path}: unsupported: tensor rope_freqs.weight (llama.cpp's RoPE "
                f"frequency factors); quantize the Hugging Face checkpoint instead"
            )
        tokens = self._value("tokenizer.ggml.tokens") or []
        cfg = {
            "architectures": [ARCHITECTURES[self.arch]],
            "hidden_act": "silu",
            "vocab_size": a("vocab_size") or len(tokens) or self._shape("token_embd.weight")[0],
            "hidden_size": hidden,
            "intermediate_size": a("feed_forward_length"),
            "num_hidden_layers": a("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": head_dim,
            "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": a("rope.freq_base", 10000.0),
            "max_position_embeddings": a("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in self.tensors,
        }
        scaling = a("rope.scaling.type")
        if scaling not in (None, "none"):
            cfg["rope_scaling"] = {
                "rope_type": scaling,
                "factor": a("rope.scaling.factor"),
                "original_max_position_embeddings": a("rope.scaling.original_context_length"),
            }
        if a("expert_count"):
            cfg["num_local_experts"] = a("expert_count")
        if a("attention.sliding_window"):
            cfg["sliding_window"] = a("attention.sliding_window")
        if self.arch != "qwen2" and "blk.0.attn_q.bias" in self.tensors:
            cfg["attention_bias"] = True
        return cfg

    def _gguf_name(self, name: str) -> str:
        if name in _GLOBAL:
            return _GLOBAL[name]
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m and m.group(2) in _LAYER:
            return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"
        raise KeyError(name)

    def _shape(self, gguf_name: str) -> tuple[int, ...]:
        t = self.tensors[gguf_name]
        return tuple(int(x) for x in reversed(t.shape))  # GGUF lists dimensions innermost first

    def _check_shapes(self) -> None:
        """Every tensor the spec needs is there with the shape it implies, before anything is written."""
        s = self.spec
        need = {"model.embed_tokens.weight": (s.vocab_size, s.hidden_size), "model.norm.weight": (s.hidden_size,)}
        if not s.tie_word_embeddings:
            need["lm_head.weight"] = (s.vocab_size, s.hidden_size)
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            need.update(
                {
                    p + "input_layernorm.weight": (s.hidden_size,),
                    p + "post_attention_layernorm.weight": (s.hidden_size,),
                    p + "self_attn.q_proj.weight": (s.q_dim, s.hidden_size),
                    p + "self_attn.k_proj.weight": (s.kv_dim, s.hidden_size),
                    p + "self_attn.v_proj.weight": (s.kv_dim, s.hidden_size),
                    p + "self_attn.o_proj.weight": (s.hidden_size, s.q_dim),
                    p + "mlp.gate_proj.weight": (s.intermediate_size, s.hidden_size),
                    p + "mlp.up_proj.weight": (s.intermediate_size, s.hidden_size),
                    p + "mlp.down_proj.weight": (s.hidden_size, s.intermediate_size),
                }
            )
            if s.attention_bias:
                need.update(
                    {
                        p + "self_attn.q_proj.bias": (s.q_dim,),
                        p + "self_attn.k_proj.bias": (s.kv_dim,),
                        p + "self_attn.v_proj.bias": (s.kv_dim,),
                    }
                )
            if s.qk_norm:
                need.update({p + "self_attn.q_norm.weight": (s.head_dim,), p + "self_attn.k_norm.weight": (s.head_dim,)})
        for name, shape in need.items():
            g = self._gguf_name(name)
            if g not in self.tensors:
                raise UnsupportedModelError(f"{self.path}: no tensor {g} (the metadata implies a {shape} tensor)")
            if self._shape(g) != shape:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {g}: shape {list(self._shape(g))}, the metadata implies {list(shape)}"
                )

    # -- tensors (the quantizer's source interface) -----------------------------------------------
    def tensor(self, name: str) -> np.ndarray:
        """The HF-named tensor as fp32, dequantized, q/k rows in Hugging Face order."""
        gguf = _gguf()
        g = self._gguf_name(name)
        t = self.tensors[g]
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        self.dtypes.add(f"gguf {qtype.name}")
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, qtype), dtype=np.float32).reshape(self._shape(g))
        except (ValueError, IndexError, TypeError) as e:
            raise FormatError(f"{self.path}: tensor {g} cannot be read (truncated or corrupt: {e})") from None
        if self.arch in PERMUTED and (".attn_q." in g or ".attn_k." in g):
            w = unpermute_rows(w, self.spec.num_heads if ".attn_q." in g else self.spec.num_kv_heads)
        return w

    def rows(self, name: str, shape: tuple[int, ...]):
        w = self.tensor(name)
        if w.shape != tuple(shape):
            raise UnsupportedModelError(f"{self.path}: {self._gguf_name(name)}: shape {list(w.shape)}, expected {list(shape)}")
        for a in range(0, shape[0], ROWS_PER_BLOCK):
            yield np.ascontiguousarray(w[a : a + ROWS_PER_BLOCK])

    def vector(self, name: str, n: int) -> np.ndarray:
        w = self.tensor(name)
        if w.shape != (n,):
            raise UnsupportedModelError(f"{self.path}: {self._gguf_name(name)}: shape {list(w.shape)}, expected [{n}]")
        return w

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every tensor the model uses, fp32, by its HF name (for comparisons with transformers)."""
        names = [
            n
            for n in (list(_GLOBAL) + [f"model.layers.{i}.{k}" for i in range(self.spec.num_layers) for k in _LAYER])
            if self._gguf_name(n) in self.tensors
        ]
        return {n: self.tensor(n) for n in names}

    # -- tokenizer and metadata -------------------------------------------------------------------
    def tokenizer_json(self) -> str:
        """The tokenizer the metadata describes, built with `tokenizers` as transformers builds it."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

        kind = self._value("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"{self.path}: unsupported: tokenizer.ggml.model = {kind!r} (supported: gpt2, byte-level BPE)"
            )
        tokens = self._value("tokenizer.ggml.tokens")
        types = self._value("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = self._value("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise FormatError(f"{self.path}: tokenizer.ggml.tokens / merges missing")
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for i, t in enumerate(tokens):  # tokens outside the byte alphabet are spelled byte by byte
            vocab[t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))] = i
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=[tuple(m.split(" ")) for m in merges],
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        split = PRE_TOKENIZER_SPLITS.get(self._value("tokenizer.ggml.pre"))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        # Control tokens whole and special; user-defined ones whole but not special (llama.cpp matches both).
        tok.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, ty in zip(tokens, types)
                if ty == CONTROL and set(t) <= alphabet
            ]
        )
        tok.add_tokens(
            [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
        )
        bos, eos = self._token("bos"), self._token("eos")
        specials = []
        single, pair = "$A:0", "$A:0 $B:1"
        if self._value("tokenizer.ggml.add_bos_token") and bos is not None:
            single, pair = f"{bos[1]}:0 {single}", f"{bos[1]}:0 $A:0 {bos[1]}:1 $B:1"
            specials.append(bos[::-1])
        if self._value("tokenizer.ggml.add_eos_token") and eos is not None:
            single, pair = f"{single} {eos[1]}:0", f"{pair} {eos[1]}:1"
            specials.append(eos[::-1])
        if specials:
            tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
        return tok.to_str()

    def _token(self, which: str) -> tuple[int, str] | None:
        i = self._value(f"tokenizer.ggml.{which}_token_id")
        tokens = self._value("tokenizer.ggml.tokens") or []
        return (int(i), tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else None

    def metadata(self, head_mode: str) -> dict[str, str]:
        from atomflow.model.fileformat import FORMAT_NAME, FORMAT_VERSION

        bos, eos = self._token("bos"), self._token("eos")
        eos_ids = [t[0] for t in (eos, self._token("eot"), self._token("eom")) if t is not None]
        generation = dict(
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=sorted(set(eos_ids), key=eos_ids.index),
            temperature=None,
            top_p=None,
            top_k=None,
        )
        linear = sorted(
            {
                self.tensors[self._gguf_name("model.layers.0.mlp.gate_proj.weight")].tensor_type.name,
                self.tensors["token_embd.weight"].tensor_type.name,
            }
        )
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "spec": self.spec.to_json(),
            "quantization": json.dumps(
                dict(
                    scheme="fp8_e4m3fn_w8a16",
                    group_size=QUANT_GROUP,
                    scale_dtype="F32",
                    lm_head=head_mode,
                    source_dtype="gguf " + "/".join(linear),
                )
            ),
            "tokenizer": self.tokenizer_json(),
            "tokenizer_config": json.dumps(
                dict(
                    bos_token=bos[1] if bos else None,
                    eos_token=eos[1] if eos else None,
                    add_bos_token=bool(self._value("tokenizer.ggml.add_bos_token")),
                    chat_template_source="gguf" if self._value("tokenizer.chat_template") else "",
                )
            ),
            "chat_template": self._value("tokenizer.chat_template") or "",
            "generation_config": json.dumps(generation),
            "source": json.dumps(
                dict(repo_id=None, revision=None, path=str(self.path.resolve()), format="gguf", name=self._value("general.name"))
            ),
            "created_by": f"atomflow {__version__}",
        }
