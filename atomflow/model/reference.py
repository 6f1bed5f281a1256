"""The numpy fp32 forward pass over a file's dequantized weights: the CPU backend and the test
oracle. Same semantics as the CUDA engine (fused QKV and gate/up, HF rotate-half RoPE with the
spec's inv_freq table, GQA, contiguous KV cache), in plain fp32 so its only error against
Hugging Face transformers on the same weights is float rounding. The spec's fields select the
architecture's extras: a QKV bias (Qwen2), per-head q/k RMSNorm before RoPE (Qwen3).

Probes: set `probe = fn(name, layer, array)` to receive the named activations of every
layer ([M, ...] rows for the M tokens of the current call); the validator uses them.

Prefill recipes (atomflow/model/recipe.py): "w8a16", the default, multiplies the dequantized weights
by the activations as they are; "w8a8" emulates the CUDA engine's FP8 prefill recipe: in a call of at
least W8A8_MIN_ROWS tokens (as the engine's chunks of that many rows, for calls of up to one
2048-row chunk) each linear's input is quantized per token per 128 columns to e4m3 first.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

from atomflow.model.fileformat import AtomflowFile
from atomflow.model.recipe import PREFILL_RECIPES, W8A8_MIN_ROWS

PREFILL_CHUNK = 256  # bounds the [heads, chunk, context] score matrix for long prompts
FP8_GROUP = 128
FP8_PRODUCTS = ("qkv", "o", "gate_up", "down")  # a layer's products, in order


def quantize_fp8_rows(x: np.ndarray, group: int = FP8_GROUP) -> np.ndarray:
    """x [M, K] fp32 as the FP8 recipe feeds it to the product: per row per `group` columns (128, the
    recipe's; a last group may be shorter), scale = amax / 448 (1 for an all-zero group), x / scale
    rounded to e4m3, times the scale again."""
    x = np.asarray(x, np.float32)
    out = np.empty_like(x)
    for g in range(0, x.shape[1], group):
        blk = x[:, g : g + group]
        amax = np.abs(blk).max(axis=1, keepdims=True)
        scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
        out[:, g : g + group] = (blk / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    return out


Probe = Callable[[str, int, np.ndarray], None]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * w, in fp32 (HF LlamaRMSNorm)."""
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(var + np.float32(eps))) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1) + np.exp(-x))


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """HF rotate-half RoPE. x [M, heads, D], positions [M] -> rotated x."""
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # [M, D/2], fp32 like HF
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class ReferenceModel:
    def __init__(self, model: AtomflowFile, max_context: int, prefill_recipe: str = "w8a16"):
        if prefill_recipe not in PREFILL_RECIPES:
            raise ValueError(f"prefill_recipe must be one of {', '.join(PREFILL_RECIPES)}, got {prefill_recipe!r}")
        spec = self.spec = model.spec
        self.max_context = max_context
        self.prefill_recipe = prefill_recipe
        # The products whose input the w8a8 recipe quantizes (all of them, as the engine does; a subset
        # attributes the recipe's cost, tools/recipe_attribution.py), and the columns a scale covers (the
        # engine's 128; other sizes measure the choice, tools/recipe_attribution.py --groups).
        self.fp8_products = frozenset(FP8_PRODUCTS)
        self.fp8_group = FP8_GROUP
        self.inv_freq = spec.rope_inv_freq()
        self.embed = model.array("embed")  # bf16 rows, converted on lookup
        self.layers = []
        for i in range(spec.num_layers):
            p = f"layers.{i}."
            layer = dict(
                attn_norm=model.weight_f32(p + "attn_norm"),
                wqkv=model.weight_f32(p + "wqkv"),
                wo=model.weight_f32(p + "wo"),
                mlp_norm=model.weight_f32(p + "mlp_norm"),
                w13=model.weight_f32(p + "w13"),
                w2=model.weight_f32(p + "w2"),
            )
            if spec.attention_bias:
                layer["bqkv"] = model.weight_f32(p + "bqkv")
            if spec.qk_norm:
                layer["q_norm"], layer["k_norm"] = model.weight_f32(p + "q_norm"), model.weight_f32(p + "k_norm")
            self.layers.append(layer)
        self.final_norm = model.weight_f32("final_norm")
        self.lm_head = model.lm_head_f32()
        shape = (spec.num_layers, max_context, spec.num_kv_heads, spec.head_dim)
        self.k_cache = np.zeros(shape, np.float32)  # untouched pages cost no memory
        self.v_cache = np.zeros(shape, np.float32)
        self.pos = 0
        self.probe: Probe | None = None

    def forward(self, ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Appends `ids` at the current position; returns the fp32 logits of the last one [vocab]
        (all_logits: of every one, [len(ids), vocab], as perplexity needs)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) == 0:
            raise ValueError("forward() needs at least one token")
        if self.pos + len(ids) > self.max_context:
            raise ValueError(f"{len(ids)} tokens at position {self.pos} do not fit max_context {self.max_context}")
        if ids.min() < 0 or ids.max() >= self.spec.vocab_size:
            raise ValueError(f"token id out of range [0, {self.spec.vocab_size})")
        fp8 = self.prefill_recipe == "w8a8" and len(ids) >= W8A8_MIN_ROWS
        out = [self._forward_chunk(ids[a : a + PREFILL_CHUNK], all_logits, fp8) for a in range(0, len(ids), PREFILL_CHUNK)]
        return np.concatenate(out) if all_logits else out[-1]

    def _emit(self, name: str, layer: int, a: np.ndarray) -> None:
        if self.probe is not None:
            self.probe(name, layer, a)

    def _forward_chunk(self, ids: np.ndarray, all_logits: bool = False, fp8: bool = False) -> np.ndarray:
        s = self.spec

        def a(product: str, v: np.ndarray) -> np.ndarray:  # what a linear's input is rounded to
            return quantize_fp8_rows(v, self.fp8_group) if fp8 and product in self.fp8_products else v

        m, p0 = len(ids), self.pos
        positions = np.arange(p0, p0 + m)
        x = self.embed[ids].astype(np.float32)  # [M, d] fp32 residual stream
        for i, L in enumerate(self.layers):
            h = rmsnorm(x, L["attn_norm"], s.rms_norm_eps)
            self._emit("attn_norm", i, h)
            qkv = a("qkv", h) @ L["wqkv"].T
            if s.attention_bias:
                qkv = qkv + L["bqkv"]
            q = qkv[:, : s.q_dim].reshape(m, s.num_heads, s.head_dim)
            k = qkv[:, s.q_dim : s.q_dim + s.kv_dim].reshape(m, s.num_kv_heads, s.head_dim)
            v = qkv[:, s.q_dim + s.kv_dim :].reshape(m, s.num_kv_heads, s.head_dim)
            if s.qk_norm:  # per head, over head_dim, before RoPE (Qwen3)
                q, k = rmsnorm(q, L["q_norm"], s.rms_norm_eps), rmsnorm(k, L["k_norm"], s.rms_norm_eps)
            self.k_cache[i, p0 : p0 + m] = rope(k, positions, self.inv_freq)
            self.v_cache[i, p0 : p0 + m] = v
            attn = self._attention(rope(q, positions, self.inv_freq), i, p0)
            o = a("o", attn) @ L["wo"].T
            self._emit("attn_out", i, o)
            x = x + o
            self._emit("resid_mid", i, x)
            h = rmsnorm(x, L["mlp_norm"], s.rms_norm_eps)
            gu = a("gate_up", h) @ L["w13"].T
            mlp = a("down", silu(gu[:, : s.intermediate_size]) * gu[:, s.intermediate_size :]) @ L["w2"].T
            self._emit("mlp_out", i, mlp)
            x = x + mlp
            self._emit("layer_out", i, x)
        self.pos += m
        if all_logits:
            return rmsnorm(x, self.final_norm, s.rms_norm_eps) @ self.lm_head.T
        h = rmsnorm(x[-1:], self.final_norm, s.rms_norm_eps)
        self._emit("final_norm", -1, h)
        logits = (h @ self.lm_head.T)[0]
        self._emit("logits", -1, logits[None])
        return logits

    def _attention(self, q: np.ndarray, layer: int, p0: int) -> np.ndarray:
        """Causal GQA over the cache. q [M, H, D] at positions p0.. -> [M, H * D]."""
        s = self.spec
        m, t = q.shape[0], p0 + q.shape[0]
        k, v = self.k_cache[layer, :t], self.v_cache[layer, :t]  # [T, Hkv, D]
        qg = q.reshape(m, s.num_kv_heads, s.group_size, s.head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, M, D]
        # batched matmuls (BLAS), not einsum (numpy's einsum does not use BLAS for these)
        scores = (qg @ k.transpose(1, 2, 0)[:, None]) * np.float32(s.head_dim**-0.5)  # [Hkv, G, M, T]
        if m > 1:  # key after query: -inf (a one-token step sees the whole cache)
            causal = np.arange(t)[None, :] > (p0 + np.arange(m))[:, None]  # [M, T]
            scores += np.where(causal, np.float32(-np.inf), np.float32(0))
        scores -= scores.max(axis=-1, keepdims=True)
        prob = np.exp(scores, out=scores)
        prob /= prob.sum(axis=-1, keepdims=True)
        out = prob @ v.transpose(1, 0, 2)[:, None]  # [Hkv, G, M, D]
        return out.transpose(2, 0, 1, 3).reshape(m, s.q_dim)
