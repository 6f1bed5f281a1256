"""The torch baselines (hf, torch-compile, torch-compile-int8, torch-fp8): one decoder interface,
one set of timing loops, timed on the device with torch.cuda.Event / synchronize.

A decoder keeps its own KV cache and position:
  recipe                 how it runs (precision, what is compiled and how, attention), in every row
  start(max_len)         a fresh sequence of up to max_len tokens
  prepare(max_len)       before timing decode steps at that cache length (compiles, records graphs)
  prepare_prefill(ids)   before timing a prefill of ids: one untimed prefill (compiles)
  prefill(ids)           ids [1, T] (long, on the GPU) -> the greedy next token [1, 1], on the device
  step(token)            token [1, 1] -> the next token [1, 1]; never synchronizes, so the host runs
                         ahead of the GPU as in our pipelined generate
"""

from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Callable
from pathlib import Path

from atomflow.bench.bandwidth import dense_weight_bytes, prompt_bytes_per_token, token_bytes
from atomflow.bench.baselines import Skip, not_run
from atomflow.bench.plan import BenchOptions, BenchTest, prompt_ids
from atomflow.bench.result import measured_row, skipped_row
from atomflow.model.spec import ModelSpec

COMPILE_WARMUP_STEPS = 3  # cudagraph trees: warm-up run, recording run, then replays


def require_torch_cuda():
    try:
        import torch
    except ImportError as e:
        raise Skip(f"torch is not installed ({e})") from None
    if not torch.cuda.is_available():
        raise Skip("torch has no CUDA device")
    return torch


def fp8_unsupported(torch, device: str = "cuda") -> str | None:
    """Why torch._scaled_mm with rowwise scales cannot run on this device (None: it can): the
    float8 dtype and the op must exist, a GPU must be of compute capability >= 8.9, and one small
    product must run (rowwise scales need a recent torch and, on a GPU, sm90)."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8_e4m3fn / torch._scaled_mm"
    if device == "cuda":
        cc = torch.cuda.get_device_capability()
        if cc < (8, 9):
            return f"FP8 matmuls need compute capability >= 8.9; this GPU is {cc[0]}.{cc[1]}"
    try:
        from atomflow.bench.baselines.torch_llama import Fp8Linear

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        w = torch.randn(32, 64, device=device, dtype=dtype)
        Fp8Linear(w)(torch.randn(3, 64, device=device, dtype=dtype))
    except Exception as e:  # noqa: BLE001 - the reason is the row's
        from atomflow.bench.baselines import reason

        return f"torch._scaled_mm with rowwise scales failed here ({reason(e)})"
    return None


def fused_sdpa(torch, spec: ModelSpec, device: str, dtype) -> tuple[list, str]:
    """The fused SDPA backends prefill is held to, and a word on what runs: a causal prefill
    chunk of this model's head shape (KV heads repeated) is tried under flash attention alone,
    then memory-efficient attention alone. Neither: no restriction (the math path runs) and the
    word says why. On the CPU: no restriction (the CPU's own fused kernel)."""
    if device != "cuda":
        return [], "SDPA (CPU)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, spec.num_heads, 64, spec.head_dim, device=device, dtype=dtype)
    tried = []
    for backend, word in ((SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.EFFICIENT_ATTENTION, "efficient")):
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        except RuntimeError as e:
            tried.append(f"{word}: {str(e).strip().splitlines()[0][:80] if str(e).strip() else type(e).__name__}")
            continue
        fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        return fused, (f"SDPA {word} (start 0, is_causal) / efficient (later chunks, mask), KV heads repeated")
    return [], "SDPA math path, no fused kernel ran (" + "; ".join(tried) + ")"


class HfDecoder:
    """transformers eager (attn_implementation="eager"), bf16, DynamicCache through past_key_values."""

    weight_dtype = "bf16"
    recipe = "transformers eager (attn_implementation=eager), bf16, DynamicCache, nothing compiled"
    prefill_chunk = 1024  # eager attention materializes [heads, chunk, keys] scores: bounded

    def __init__(self, hf_dir: Path, device: str = "cuda", dtype=None):
        import torch

        try:
            import transformers
            from transformers import AutoModelForCausalLM
        except ImportError as e:
            raise Skip(f"transformers is not installed ({e})") from None
        self.torch = torch
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
        self.model = (
            AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager", **{dtype_kw: dtype or torch.bfloat16})
            .to(device)
            .eval()
        )
        params = inspect.signature(self.model.forward).parameters
        # Only the last row's logits, as generate() asks for them (a full [T, vocab] is not the baseline's cost).
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.cache = None

    def start(self, max_len: int) -> None:
        self.cache = None

    def prepare(self, max_len: int) -> None:
        pass

    def prepare_prefill(self, ids, max_len: int) -> None:
        pass

    def _forward(self, ids):
        with self.torch.no_grad():
            out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, **self.keep)
        self.cache = out.past_key_values
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def prefill(self, ids):
        for s in range(0, ids.shape[1], self.prefill_chunk):
            tok = self._forward(ids[:, s : s + self.prefill_chunk])
        return tok

    def step(self, token):
        return self._forward(token)


class CompiledDecoder:
    """atomflow.bench.baselines.torch_llama with gpt-fast's settings (generate.py): the decode step
    compiled with mode="reduce-overhead" (CUDA graphs), fullgraph, static shapes; prefill compiled
    as gpt-fast's --compile_prefill does (fullgraph, dynamic shapes; what its authors benchmark
    with), its attention held to fused SDPA kernels. compile_prefill=False: prefill eager, as
    gpt-fast without --compile_prefill. linear: "bf16", "int8" (weight-only) or "fp8" (rowwise
    torch._scaled_mm, activations quantized per token)."""

    prefill_chunk = 2048

    def __init__(self, hf_dir: Path, linear: str = "bf16", compile_prefill: bool = True, device: str = "cuda", dtype=None):
        import torch
        import torch._dynamo.config
        import torch._inductor.config as inductor

        from atomflow.bench.baselines import torch_llama

        # gpt-fast's generate.py settings, but for unique_kernel_names (kernel names only): gpt-fast's
        # True makes every layer's copy of a kernel distinct, compiled and tuned once per layer.
        inductor.coordinate_descent_tuning = True
        inductor.fx_graph_cache = True
        inductor.triton.unique_kernel_names = False
        torch._dynamo.config.cache_size_limit = 64  # one compile per cache length (per test)
        # The cache and rotary table are module buffers, static shapes by default even under
        # dynamic=True: prefill would recompile for every cache length (~80 s each on a 3B model).
        # Allowed to vary, the second length marks them dynamic and later ones reuse that graph.
        # The decode step (dynamic=False) stays static: one graph per cache length, as intended.
        torch._dynamo.config.force_parameter_static_shapes = False
        torch._dynamo.config.force_nn_module_property_static_shapes = False
        self.torch, self.device = torch, device
        if linear == "fp8":
            why = fp8_unsupported(torch, device)
            if why:
                raise Skip(why)
        self.weight_dtype = linear
        self.model = torch_llama.load(hf_dir, device, dtype or torch.bfloat16, linear=linear)
        self._step = torch.compile(torch_llama.decode_one, mode="reduce-overhead", fullgraph=True, dynamic=False)
        self.compile_prefill = compile_prefill
        self._prefill = (
            torch.compile(torch_llama.prefill_one, fullgraph=True, dynamic=True) if compile_prefill else torch_llama.prefill_one
        )
        self.sdpa_backends, attention = fused_sdpa(torch, self.model.spec, device, self.model.embed.dtype)
        precision = {
            "bf16": f"{str(self.model.embed.dtype).removeprefix('torch.')}",
            "int8": "int8 weight-only (per-row scales)",
            "fp8": "fp8 e4m3 weights (per-row fp32 scales) x activations (per-token scales), "
            "torch._scaled_mm rowwise, lm_head included",
        }[linear]
        self.recipe = (
            f"{precision}; decode: torch.compile(mode=reduce-overhead, fullgraph, static shapes); "
            f"prefill: {'torch.compile(fullgraph, dynamic shapes)' if compile_prefill else 'eager'}, "
            f"{attention}; decode attention: SDPA enable_gqa over the static cache, masked"
        )
        self.compile_s: dict[int, float] = {}
        self.prefill_compile_s: dict[tuple[int, int], float] = {}

    @staticmethod
    def cache_len(max_len: int) -> int:
        return -(-max_len // 256) * 256  # repetitions of a test share one cache, one graph

    def start(self, max_len: int) -> None:
        self.model.setup_cache(self.cache_len(max_len))
        self.p = 0
        self.pos = self.torch.zeros(1, dtype=self.torch.long, device=self.device)

    def prepare(self, max_len: int) -> None:
        """Compiles and records the decode graph for this cache length, outside the timed runs."""
        torch, n = self.torch, self.cache_len(max_len)
        if n in self.compile_s:
            return
        self.start(max_len)
        t0 = time.perf_counter()
        tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        for _ in range(COMPILE_WARMUP_STEPS):
            tok = self.step(tok)
        tok.cpu()  # waits for the device
        self.compile_s[n] = time.perf_counter() - t0

    def prepare_prefill(self, ids, max_len: int) -> None:
        """One untimed prefill of ids into a cache of max_len, compiles included, timed once per
        (prompt length, cache length) and kept in prefill_compile_s."""
        key = (ids.shape[1], self.cache_len(max_len))
        if key in self.prefill_compile_s:
            return
        self.start(max_len)
        t0 = time.perf_counter()
        self.prefill(ids).cpu()  # waits for the device
        self.prefill_compile_s[key] = time.perf_counter() - t0

    @staticmethod
    def cudagraph_skips() -> int:
        """Times inductor fell back from CUDA graphs (reported: the baseline then ran without them)."""
        from torch._dynamo.utils import counters

        return int(counters["inductor"].get("cudagraph_skips", 0))

    def prefill(self, ids):
        torch = self.torch
        with torch.no_grad(), self._sdpa_held():
            for s in range(0, ids.shape[1], self.prefill_chunk):
                chunk = ids[:, s : s + self.prefill_chunk]
                tok = self._prefill(self.model, chunk, self.p)
                self.p += chunk.shape[1]
        self.pos.fill_(self.p)
        return tok

    def _sdpa_held(self):
        """Prefill attention held to the fused SDPA backends found at load (none found: no hold)."""
        if not self.sdpa_backends:
            import contextlib

            return contextlib.nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(self.sdpa_backends)

    def step(self, token):
        with self.torch.no_grad():
            out = self._step(self.model, token, self.pos).clone()  # the graph's output is reused
        self.pos += 1
        self.p += 1
        return out


TORCH_LINEAR = {"torch-compile": "bf16", "torch-compile-int8": "int8", "torch-fp8": "fp8"}


def make_decoder(name: str, hf_dir: Path, compile_prefill: bool = True):
    if name == "hf":
        return HfDecoder(hf_dir)
    if name in TORCH_LINEAR:
        return CompiledDecoder(hf_dir, linear=TORCH_LINEAR[name], compile_prefill=compile_prefill)
    raise ValueError(f"unknown torch baseline {name!r}")


def weight_bytes(spec: ModelSpec, weight_dtype: str) -> tuple[float, float]:
    """(the weight bytes a decode step reads, those of the head: final norm + lm_head) for bf16,
    int8 weight-only (bf16 row scales) or fp8 (fp32 row scales: int8's count + 2 B per row)."""
    d, v = spec.hidden_size, spec.vocab_size
    if weight_dtype == "fp8":
        rows = spec.num_layers * (spec.qkv_dim + d + 2 * spec.intermediate_size + d) + v
        return dense_weight_bytes(spec, "int8") + 2 * rows, v * d + v * 4 + d * 2
    return dense_weight_bytes(spec, weight_dtype), v * d * (2 if weight_dtype == "bf16" else 1) + d * 2


# ---------------------------------------------------------------------------------------
# timing


def time_pp(torch, dec, test: BenchTest, opts: BenchOptions, ids) -> dict:
    """Prefill of the whole prompt plus the greedy first token, synchronized on both ends."""
    runs = []
    dec.prepare_prefill(ids, test.n_prompt)
    for _rep in range(opts.repetitions + int(opts.warmup)):
        dec.start(test.n_prompt)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec.prefill(ids)
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    runs = runs[int(opts.warmup) :]
    return dict(tokens_per_s=[test.n_prompt / s for s in runs], ttft_ms=[1e3 * s for s in runs])


def time_tg(torch, dec, test: BenchTest, opts: BenchOptions, ids) -> dict:
    """depth tokens prefilled, then n_gen steps with an event after each; TPOT = the n_gen - 1
    step intervals after the first generated token (as for our engine)."""
    n = test.n_gen
    tps, gaps_all = [], []
    if test.depth:
        dec.prepare_prefill(ids[:, : test.depth], test.depth + n)
    dec.prepare(test.depth + n)
    for rep in range(opts.repetitions + int(opts.warmup)):
        dec.start(test.depth + n)
        if test.depth:
            dec.prefill(ids[:, : test.depth])
        # its own [1, 1] tensor with a step output's strides (a strided one recompiles the step)
        token = ids[:, test.depth : test.depth + 1].clone(memory_format=torch.contiguous_format)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        torch.cuda.synchronize()
        events[0].record()
        for i in range(n):
            token = dec.step(token)
            events[i + 1].record()
        torch.cuda.synchronize()
        gaps = [events[i].elapsed_time(events[i + 1]) for i in range(1, n)]
        if rep >= int(opts.warmup):
            tps.append((n - 1) / (sum(gaps) / 1e3))
            gaps_all.append(gaps)
    return dict(tokens_per_s=tps, tpot_ms=gaps_all)


def compile_extras(dec: CompiledDecoder, test: BenchTest) -> dict:
    """A compiled decoder's row fields for test: compile_s (decode: compile + graph recording at
    the test's cache length), cudagraph_skips (tg), prefill_compile_s (the untimed first prefill
    of the test's prompt or depth, compiles included; absent where the test prefills nothing)."""
    out = {}
    if test.kind == "tg":
        out.update(compile_s=dec.compile_s.get(dec.cache_len(test.positions)), cudagraph_skips=dec.cudagraph_skips())
    n, max_len = (test.n_prompt, test.n_prompt) if test.kind == "pp" else (test.depth, test.positions)
    if n:
        out["prefill_compile_s"] = dec.prefill_compile_s.get((n, dec.cache_len(max_len)))
    return out


def run_torch_baseline(
    name: str, hf_dir: Path, opts: BenchOptions, bandwidth_gbs: float | None, log: Callable[[str], None]
) -> list[dict]:
    torch = require_torch_cuda()
    spec = ModelSpec.from_hf_dir(hf_dir)
    log(f"{name}: loading {hf_dir}")
    try:
        dec = make_decoder(name, hf_dir, compile_prefill=opts.compile_prefill)
    except torch.cuda.OutOfMemoryError:
        raise Skip("out of GPU memory loading the model") from None
    log(f"{name}: {dec.recipe}")
    weights, head = weight_bytes(spec, dec.weight_dtype)
    rows = []
    try:
        for test in opts.tests:
            log(f"{name}: {test.name}")
            if (row := not_run(name, test)) is not None:
                rows.append(row)
                continue
            ids = (
                torch.from_numpy(prompt_ids(spec.vocab_size, max(test.n_prompt, test.depth + 1), opts.seed))
                .long()
                .view(1, -1)
                .cuda()
            )
            try:
                if test.kind == "pp":
                    s = time_pp(torch, dec, test, opts, ids)
                    nbytes = prompt_bytes_per_token(spec, weights, head, test.n_prompt, dec.prefill_chunk)
                else:
                    s = time_tg(torch, dec, test, opts, ids)
                    nbytes = token_bytes(spec, weights, test.mean_context)
            except torch.cuda.OutOfMemoryError:
                rows.append(skipped_row(name, test, "out of GPU memory"))
                torch.cuda.empty_cache()
                continue
            extra = dict(recipe=dec.recipe)
            if isinstance(dec, CompiledDecoder):
                extra.update(compile_extras(dec, test))
            rows.append(
                measured_row(
                    name, test, bytes_per_token=nbytes, bandwidth_gbs=bandwidth_gbs, weight_dtype=dec.weight_dtype, **s, **extra
                )
            )
    finally:
        compiled = isinstance(dec, CompiledDecoder)
        del dec
        if compiled:  # compiled code and CUDA-graph pools hold the model's memory until reset
            torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    return rows
