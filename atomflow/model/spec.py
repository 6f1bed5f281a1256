"""ModelSpec: the validated shape of a Llama-family model, built from a Hugging Face config.json.

One forward pass covers Llama, Mistral, Qwen2 and Qwen3: their differences are fields (QKV
bias, per-head q/k RMSNorm, rope scaling, a sliding window that is never in effect), not forks.
Mirrored as a POD struct in include/atomflow/spec.h (same field names). Anything the engine
does not support fails here, with a message naming the config field and its value.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from atomflow.errors import UnsupportedModelError

QUANT_GROUP = 128  # input columns per FP8 scale; the last group of a row covers K % 128 (docs/FORMAT.md)
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
MAX_HEAD_RATIO = 16  # query heads per KV head
SIZE_MULTIPLE = 64  # hidden and intermediate sizes
ROPE_TYPES = ("default", "linear", "llama3")

# Spec fields a version-1 file (Llama only) does not have: their defaults describe it.
V1_ABSENT_FIELDS = ("arch", "attention_bias", "qk_norm", "sliding_window")

# HF architecture -> the spec's arch name
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}  # config model_type -> architecture

# What the CUDA engine runs today (csrc/): everything else is refused before loading.
CUDA_HEAD_DIMS = (64, 80, 96, 128, 256)  # kernels::attention_supported
CUDA_HEAD_RATIOS = tuple(range(1, MAX_HEAD_RATIO + 1))
CUDA_ROPE_TYPES = ("default", "llama3", "linear")  # the engine takes the inv_freq table, which carries the type


def scale_groups(k: int) -> int:
    """FP8 scale groups of a row of k input columns: ceil(k / 128), the last one partial."""
    return -(-k // QUANT_GROUP)


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str  # "default", "linear" (positions / factor) or "llama3"
    rope_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_position_embeddings: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    lm_head_fp8: bool = True
    # format version 2 (absent from version-1 files: these defaults are what those files hold)
    arch: str = "llama"  # llama | mistral | qwen2 | qwen3
    attention_bias: bool = False  # q/k/v projections have a bias (Qwen2): tensor layers.{i}.bqkv
    qk_norm: bool = False  # RMSNorm per head on q and k before RoPE (Qwen3): layers.{i}.q_norm, k_norm
    sliding_window: int = 0  # 0: none; else no context longer than this may be used (Mistral v0.1)

    # -- derived sizes ---------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        return self.q_dim + 2 * self.kv_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def max_context_limit(self) -> int:
        """The longest context this model may be run at: its positions, and its sliding window
        (full attention equals windowed attention only while the context fits the window)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def cuda_unsupported(self) -> str | None:
        """Why the CUDA engine cannot run this model yet (one line), or None. Checked before loading."""
        why = []
        if self.head_dim not in CUDA_HEAD_DIMS:
            why.append(f"head_dim {self.head_dim} (CUDA: {', '.join(map(str, CUDA_HEAD_DIMS))})")
        if self.group_size not in CUDA_HEAD_RATIOS:
            why.append(f"{self.group_size} query heads per KV head (CUDA: 1..{CUDA_HEAD_RATIOS[-1]})")
        if self.rope_type not in CUDA_ROPE_TYPES:
            why.append(f"rope_type {self.rope_type}")
        return ("the CUDA engine does not run this model yet: " + "; ".join(why)) if why else None

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V (bf16) one token adds to the cache, all layers."""
        return 2 * self.num_layers * self.kv_dim * 2

    # -- RoPE ------------------------------------------------------------------------------
    def rope_inv_freq(self) -> np.ndarray:
        """float32 [head_dim / 2]: the rotary frequencies as transformers computes them (fp32
        arithmetic, llama3 smoothing included; within 1 ulp of its values). The CUDA engine
        receives this table, so both backends rotate by identical angles."""
        d = self.head_dim
        exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
        # theta ** x correctly rounded to fp32 (torch's vectorized powf may differ by 1 ulp).
        base = (np.float64(np.float32(self.rope_theta)) ** exponents.astype(np.float64)).astype(np.float32)
        inv_freq = (np.float32(1.0) / base).astype(np.float32)
        if self.rope_type == "default":
            return inv_freq
        if self.rope_type == "linear":  # transformers: inv_freq / factor (positions divided by factor)
            return (inv_freq / np.float32(self.rope_factor)).astype(np.float32)
        factor = np.float32(self.rope_factor)
        low, high = np.float32(self.rope_low_freq_factor), np.float32(self.rope_high_freq_factor)
        old_ctx = np.float32(self.rope_original_max_position_embeddings)
        low_freq_wavelen = old_ctx / low
        high_freq_wavelen = old_ctx / high
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
        smooth = ((old_ctx / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    # -- serialization ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        missing = names - set(d) - optional
        if missing:
            raise ValueError(f"model spec is missing {sorted(missing)}")
        spec = cls(**{k: v for k, v in d.items() if k in names})
        spec.validate()
        return spec

    # -- from Hugging Face -----------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: dict, lm_head_fp8: bool = True) -> ModelSpec:
        """Build from a transformers config.json (4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters`). Raises UnsupportedModelError for anything the engine cannot run."""
        check_config_types(config)
        arch = _architecture(config)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if isinstance(config.get(key), bool) or not isinstance(config.get(key), int) or config[key] <= 0:
                raise UnsupportedModelError(f"config.json: {key} must be a positive integer, got {config.get(key)!r}")
        if config.get("mlp_bias"):
            raise UnsupportedModelError("unsupported: mlp_bias = true")
        act = config.get("hidden_act", config.get("hidden_activation", "silu"))
        if act != "silu":
            raise UnsupportedModelError(f"unsupported: hidden_act = {act!r} (only silu, SwiGLU)")
        for key in ("num_experts", "num_local_experts", "n_routed_experts", "kv_lora_rank"):
            if config.get(key):
                raise UnsupportedModelError(f"unsupported: {key} = {config[key]!r} (dense attention and MLP only)")
        # Qwen2 has a bias on q, k and v by construction (transformers ignores attention_bias there);
        # Llama's and Qwen3's attention_bias also puts one on o_proj, which the engine does not have.
        bias = arch == "qwen2"
        if arch in ("llama", "qwen3") and config.get("attention_bias"):
            raise UnsupportedModelError(
                "unsupported: attention_bias = true (a bias on q/k/v/o_proj; only Qwen2's q/k/v bias is supported)"
            )
        sliding = _sliding_window(config, arch)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads

        rope = _rope_settings(config)
        spec = cls(
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            lm_head_fp8=lm_head_fp8,
            arch=arch,
            attention_bias=bool(bias),
            qk_norm=(arch == "qwen3"),
            sliding_window=sliding,
            **rope,
        )
        spec.validate()
        return spec

    @classmethod
    def from_hf_dir(cls, path: str | Path, lm_head_fp8: bool = True) -> ModelSpec:
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        try:
            config = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"{cfg}: not valid JSON ({e})") from None
        return cls.from_hf_config(config, lm_head_fp8=lm_head_fp8)

    def validate(self) -> None:
        def bad(msg: str):
            raise UnsupportedModelError(f"unsupported model: {msg}")

        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                bad(f"{f} must be a positive integer, got {getattr(self, f)!r}")
        if self.arch not in _MODEL_TYPES:
            bad(f"arch {self.arch!r} (supported: {', '.join(_MODEL_TYPES)})")
        if self.num_heads % self.num_kv_heads:
            bad(f"num_attention_heads {self.num_heads} is not divisible by num_key_value_heads {self.num_kv_heads}")
        if not 1 <= self.group_size <= MAX_HEAD_RATIO:
            bad(f"num_attention_heads / num_key_value_heads = {self.group_size} (supported: 1..{MAX_HEAD_RATIO})")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            bad(f"head_dim {self.head_dim} (supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})")
        for name, k in (("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size)):
            if k % SIZE_MULTIPLE:
                bad(f"{name} = {k} is not a multiple of {SIZE_MULTIPLE}")
        if self.rope_type not in ROPE_TYPES:
            bad(f"rope_type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            bad(f"sliding_window {self.sliding_window!r}")
        if self.rope_type == "linear" and not self.rope_factor > 0:
            bad(f"linear rope scaling needs factor > 0, got {self.rope_factor}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            bad(f"rms_norm_eps {self.rms_norm_eps}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            bad(f"rope_theta {self.rope_theta}")
        if self.rope_type == "llama3":
            if not (self.rope_factor > 0 and self.rope_low_freq_factor > 0 and self.rope_original_max_position_embeddings > 0):
                bad("llama3 rope scaling needs factor > 0, low_freq_factor > 0 and original_max_position_embeddings > 0")
            if not self.rope_high_freq_factor > self.rope_low_freq_factor:
                bad("llama3 rope scaling needs high_freq_factor > low_freq_factor")


# config.json fields the spec reads, and the JSON types each may hold (null is always allowed:
# transformers writes null for "the default").
_NUMBER = (int, float)
CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "architectures": (list,),
    "model_type": (str,),
    "vocab_size": (int,),
    "hidden_size": (int,),
    "intermediate_size": (int,),
    "num_hidden_layers": (int,),
    "num_attention_heads": (int,),
    "num_key_value_heads": (int,),
    "head_dim": (int,),
    "rms_norm_eps": _NUMBER,
    "rope_theta": _NUMBER,
    "rope_scaling": (dict,),
    "rope_parameters": (dict,),
    "max_position_embeddings": (int,),
    "tie_word_embeddings": (bool,),
    "hidden_act": (str,),
    "attention_bias": (bool,),
    "mlp_bias": (bool,),
    "sliding_window": (int,),
    "bos_token_id": (int,),
    "eos_token_id": (int, list),
}

_NOT_NULL = ("rms_norm_eps", "rope_theta", "max_position_embeddings")  # read through float() / int()
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_config_types(config) -> None:
    """config.json is an object and each field the spec reads has its JSON type (a bool is not
    a number here); else one UnsupportedModelError naming the field and its value."""
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"config.json must hold a JSON object, got a {type(config).__name__}")
    for key, types in CONFIG_TYPES.items():
        v = config.get(key)
        if v is None and (key not in _NOT_NULL or key not in config):
            continue
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            want = (
                "a number"
                if types == _NUMBER
                else " or ".join(
                    {int: "an integer", str: "a string", list: "a list", dict: "an object", bool: "true or false"}[t]
                    for t in types
                )
            )
            raise UnsupportedModelError(f"config.json: {key} must be {want}, got {v!r:.60}")
        if isinstance(v, float) and not math.isfinite(v):
            raise UnsupportedModelError(f"config.json: {key} must be finite, got {v!r}")
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key) or {}
        for d in [rope] + [v for v in rope.values() if isinstance(v, dict)]:  # rope_parameters per layer type
            for k in _ROPE_NUMBERS:
                v = d.get(k)
                if k in d and (isinstance(v, bool) or not isinstance(v, _NUMBER) or not math.isfinite(v)):  # null too
                    raise UnsupportedModelError(f"config.json: {key}.{k} must be a finite number, got {v!r:.60}")


def _rope_settings(config: dict) -> dict:
    """Normalize transformers 4.x (rope_theta + rope_scaling) and 5.x (rope_parameters)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling = params if isinstance(params, dict) else (config.get("rope_scaling") or {})
    theta = config.get("rope_theta", (params or {}).get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported: rope_scaling rope_type = {rope_type!r} (supported: none/default, linear, llama3)"
        )
    out = dict(
        rope_theta=float(theta),
        rope_type=rope_type,
        rope_factor=1.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position_embeddings=0,
    )
    if rope_type == "linear":
        if not isinstance(scaling.get("factor"), (int, float)):
            raise UnsupportedModelError(f"linear rope scaling needs a numeric factor, got {scaling.get('factor')!r}")
        out.update(rope_factor=float(scaling["factor"]))
    if rope_type == "llama3":
        try:
            out.update(
                rope_factor=float(scaling["factor"]),
                rope_low_freq_factor=float(scaling["low_freq_factor"]),
                rope_high_freq_factor=float(scaling["high_freq_factor"]),
                rope_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise UnsupportedModelError(f"llama3 rope scaling is missing {e.args[0]!r}") from None
    return out


def _architecture(config: dict) -> str:
    """The spec's arch name from `architectures` (or `model_type` when that list is absent)."""
    archs = config.get("architectures") or []
    if not all(isinstance(a, str) for a in archs):
        raise UnsupportedModelError(f"config.json: architectures must be a list of strings, got {archs!r:.60}")
    if archs:
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {', '.join(archs)}: architectures = {archs} (supported: {', '.join(ARCHITECTURES)})"
            )
        return ARCHITECTURES[archs[0]]
    model_type = config.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported architecture model_type {model_type!r}: model_type = {model_type!r} "
            f"(no architectures given; supported: {', '.join(_MODEL_TYPES)})"
        )
    return model_type


def _sliding_window(config: dict, arch: str) -> int:
    """0 when every layer attends to the whole context, else Mistral's window (contexts beyond it
    are refused at load). Sliding-window layers that are in effect are refused here."""
    types = config.get("layer_types")
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        other = next(t for t in types if t != "full_attention")
        raise UnsupportedModelError(f"unsupported: layer_types contains {other!r} (full attention only)")
    window = config.get("sliding_window")
    if arch in ("qwen2", "qwen3"):
        if config.get("use_sliding_window"):
            raise UnsupportedModelError("unsupported: use_sliding_window = true (full attention only)")
        return 0  # the window is not in effect
    if window in (None, 0):
        return 0
    if arch != "mistral":
        raise UnsupportedModelError(f"unsupported: sliding_window = {window!r} (full attention only)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise UnsupportedModelError(f"config.json: sliding_window must be null or a positive integer, got {window!r}")
    return window
