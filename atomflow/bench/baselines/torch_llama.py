"""A static-KV-cache Llama in plain torch, the gpt-fast recipe: the `torch-compile`,
`torch-compile-int8` and `torch-fp8` baselines of `atomflow bench`. torch is imported here (and by
the baseline runners), never by the engine.

    model = load(hf_dir, device="cuda", dtype=torch.bfloat16, linear="bf16")  # or "int8", "fp8"
    model.setup_cache(max_len)
    logits = model(tokens [1, T], pos [T])         # decode: fp32 logits [1, vocab] of the last token
    logits = model.prefill(tokens [1, T], start)   # prefill of positions start .. start + T - 1

Weights come from the HF checkpoint's safetensors, q/k/v and gate/up fused into one matrix each
(gpt-fast fuses wqkv; gate/up the same way, one read of x). RoPE is HF's rotate-half with the
rotary table of atomflow.model.spec (llama3 scaling included), so logits match transformers. The
KV cache is [1, Hkv, max_len, D] per layer, written at `pos`.

Attention. Decode (forward): the query reads the whole static cache under a causal mask (fixed
shapes: one CUDA graph serves every position), SDPA with enable_gqa. Prefill (prefill): gpt-fast's
model.py, K/V heads repeated (repeat_interleave) to the query heads so a fused SDPA kernel runs
(with enable_gqa and a mask SDPA falls to its fp32 math path); over a fresh cache (start == 0) the
keys are the chunk's own under is_causal=True (flash attention), after it (start > 0) the cache's
first start + T rows under a [T, start + T] mask (memory-efficient attention).

Linears. int8: gpt-fast's WeightOnlyInt8Linear, an int8 weight per element and a scale per output
row, dequantized in the matmul: y = (x @ int8_w.to(x.dtype).T) * scale. fp8: Fp8Linear, float8
e4m3 weights with an fp32 scale per output row and activations quantized per token at run time,
multiplied by torch._scaled_mm with rowwise scales (the usual FP8 recipe on Hopper).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from atomflow.model.spec import ModelSpec


class Dense(nn.Module):
    """y = x @ w.T (no bias)."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", w, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Int8Linear(nn.Module):
    """gpt-fast's WeightOnlyInt8Linear: symmetric per-output-channel int8 (scale = absmax / 127)."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        scale = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
        q = torch.round(w.float() / scale[:, None]).clamp(-128, 127).to(torch.int8)
        self.register_buffer("weight", q, persistent=False)
        self.register_buffer("scales", scale.to(w.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(dtype=x.dtype)) * self.scales


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale fp32 [M, 1]) with x ~= q * scale:
    scale = absmax(row) / 448, q = fp8(x / scale) (clamped: e4m3fn has no inf, overflow is NaN)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class Fp8Linear(nn.Module):
    """y = x @ w.T in FP8: w as float8_e4m3fn [N, K] with fp32 scales [1, N] (one per output row,
    quantized once), x quantized per token (row) at run time, then
    y = torch._scaled_mm(x8 [M, K], w8.T [K, N], scale_a [M, 1], scale_b [1, N]) in x's dtype
    (fp32 accumulation). _scaled_mm wants K and N multiples of 16 and the second operand
    column-major: w8.T of a row-major [N, K] is."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        q, scale = fp8_rowwise(w)
        self.register_buffer("weight", q, persistent=False)
        self.register_buffer("scale", scale.view(1, -1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x8, sx = fp8_rowwise(x.reshape(-1, x.shape[-1]))
        y = torch._scaled_mm(x8, self.weight.t(), scale_a=sx, scale_b=self.scale, out_dtype=x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])


LINEARS = {"bf16": Dense, "int8": Int8Linear, "fp8": Fp8Linear}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalize in fp32, back to x's dtype, then the weight."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [1, heads, T, D] with cos/sin fp32 [T, D], in fp32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], linear):
        super().__init__()
        self.spec = spec
        self.attn_norm = nn.Parameter(w["input_layernorm.weight"], requires_grad=False)
        self.mlp_norm = nn.Parameter(w["post_attention_layernorm.weight"], requires_grad=False)
        self.wqkv = linear(torch.cat([w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"], w["self_attn.v_proj.weight"]]))
        self.wo = linear(w["self_attn.o_proj.weight"])
        self.w13 = linear(torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
        self.w2 = linear(w["mlp.down_proj.weight"])
        self.register_buffer("k_cache", None, persistent=False)  # setup_cache() makes them
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, pos, cos, sin, mask, start: int | None = None):
        """start None: a decode step over the whole cache under mask [T, max_len]. start an int:
        prefill of positions start .. start + T - 1, KV heads repeated; mask [T, start + T] when
        start > 0, unused (is_causal over the chunk's own keys) when start == 0."""
        s = self.spec
        T = x.shape[1]
        qkv = self.wqkv(rms_norm(x, self.attn_norm, s.rms_norm_eps))
        q, k, v = qkv.split([s.q_dim, s.kv_dim, s.kv_dim], dim=-1)
        q = rope(q.view(1, T, s.num_heads, s.head_dim).transpose(1, 2), cos, sin)
        k = rope(k.view(1, T, s.num_kv_heads, s.head_dim).transpose(1, 2), cos, sin)
        v = v.view(1, T, s.num_kv_heads, s.head_dim).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        if start is None:
            y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        elif start == 0:  # a fresh cache: the chunk's own keys, causal (flash attention)
            rep = s.num_heads // s.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # after earlier chunks: the cache's first start + T keys under the mask
            rep = s.num_heads // s.num_kv_heads
            k = self.k_cache[:, :, : start + T].repeat_interleave(rep, dim=1)
            v = self.v_cache[:, :, : start + T].repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.wo(y.transpose(1, 2).reshape(1, T, s.q_dim))
        gate, up = self.w13(rms_norm(x, self.mlp_norm, s.rms_norm_eps)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], linear: str = "bf16"):
        super().__init__()
        self.spec = spec
        self.linear = linear
        linear = LINEARS[linear]
        self.embed = nn.Parameter(weights["model.embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            Block(
                spec,
                {k[len(f"model.layers.{i}.") :]: v for k, v in weights.items() if k.startswith(f"model.layers.{i}.")},
                linear,
            )
            for i in range(spec.num_layers)
        )
        self.norm = nn.Parameter(weights["model.norm.weight"], requires_grad=False)
        self.output = linear(weights.get("lm_head.weight", weights["model.embed_tokens.weight"]))
        for name in ("cos", "sin", "keys"):
            self.register_buffer(name, None, persistent=False)
        self.max_len = 0

    def setup_cache(self, max_len: int) -> None:
        """A zeroed cache of max_len positions per layer, and the rotary table for them. Same
        max_len again: nothing changes (a compiled step keeps its graph)."""
        if max_len == self.max_len:
            return
        s, dev, dt = self.spec, self.embed.device, self.embed.dtype
        for b in self.layers:
            b.k_cache = torch.zeros(1, s.num_kv_heads, max_len, s.head_dim, device=dev, dtype=dt)
            b.v_cache = torch.zeros_like(b.k_cache)
        inv_freq = torch.from_numpy(s.rope_inv_freq()).to(dev)
        angles = torch.arange(max_len, device=dev, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin = angles.cos(), angles.sin()
        self.keys = torch.arange(max_len, device=dev)
        self.max_len = max_len

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [1, T] at positions pos [T] -> fp32 logits [1, vocab] of the last one."""
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[pos], self.sin[pos]
        mask = pos[:, None] >= self.keys[None, :]  # [T, max_len]: causal over the static cache
        for b in self.layers:
            x = b(x, pos, cos, sin, mask)
        return self.head(x)

    def prefill(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens [1, T] at positions start .. start + T - 1 (the cache holds the start before
        them) -> fp32 logits [1, vocab] of the last one. Attention as gpt-fast's prefill: KV heads
        repeated, a fused SDPA kernel (see the module docstring)."""
        T = tokens.shape[1]
        x = F.embedding(tokens, self.embed)
        pos = torch.arange(start, start + T, device=tokens.device)
        cos, sin = self.cos[start : start + T], self.sin[start : start + T]
        mask = pos[:, None] >= self.keys[None, : start + T] if start > 0 else None
        for b in self.layers:
            x = b(x, pos, cos, sin, mask, start)
        return self.head(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(rms_norm(x[:, -1], self.norm, self.spec.rms_norm_eps)).float()


def read_safetensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                out[name] = fh.get_tensor(name)
    return out


@torch.no_grad()
def load(hf_dir: str | Path, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, linear: str = "bf16") -> Transformer:
    """linear: "bf16" (dense, in dtype), "int8" (weight-only) or "fp8" (Fp8Linear)."""
    if linear not in LINEARS:
        raise ValueError(f"linear must be one of {', '.join(LINEARS)}, got {linear!r}")
    spec = ModelSpec.from_hf_dir(hf_dir)
    weights = {k: v.to(device=device, dtype=dtype) for k, v in read_safetensors(hf_dir).items()}
    return Transformer(spec, weights, linear).eval()


def decode_one(model: Transformer, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One greedy step: token [1, 1] at pos [1] -> the next token [1, 1] (what gets compiled)."""
    return torch.argmax(model(token, pos), dim=-1, keepdim=True)


def prefill_one(model: Transformer, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """A prefill chunk: tokens [1, T] from position start -> the greedy next token [1, 1] (what
    gets compiled with dynamic shapes: one graph for start == 0, one for start > 0)."""
    return torch.argmax(model.prefill(tokens, start), dim=-1, keepdim=True)
