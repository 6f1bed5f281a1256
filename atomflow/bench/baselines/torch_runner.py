"""The torch baselines (hf, torch-compile, torch-compile-int8): one decoder interface, one set of
timing loops, timed on the device with torch.cuda.Event / synchronize.

A decoder keeps its own KV cache and position:
  start(max_len)   a fresh sequence of up to max_len tokens
  prepare(max_len) before timing decode steps at that cache length (compiles, records graphs)
  prefill(ids)     ids [1, T] (long, on the GPU) -> the greedy next token [1, 1], on the device
  step(token)      token [1, 1] -> the next token [1, 1]; never synchronizes, so the host runs
                   ahead of the GPU as in our pipelined generate
"""
from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Callable
from pathlib import Path

from atomflow.bench.bandwidth import dense_weight_bytes, prompt_bytes_per_token, token_bytes
from atomflow.bench.baselines import Skip
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


class HfDecoder:
    """transformers eager (attn_implementation="eager"), bf16, DynamicCache through past_key_values."""

    weight_dtype = "bf16"
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
        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager",
                                                          **{dtype_kw: dtype or torch.bfloat16}).to(device).eval()
        params = inspect.signature(self.model.forward).parameters
        # Only the last row's logits, as generate() asks for them (a full [T, vocab] is not the baseline's cost).
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.cache = None

    def start(self, max_len: int) -> None:
        self.cache = None

    def prepare(self, max_len: int) -> None:
        pass

    def _forward(self, ids):
        with self.torch.no_grad():
            out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, **self.keep)
        self.cache = out.past_key_values
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def prefill(self, ids):
        for s in range(0, ids.shape[1], self.prefill_chunk):
            tok = self._forward(ids[:, s:s + self.prefill_chunk])
        return tok

    def step(self, token):
        return self._forward(token)


class CompiledDecoder:
    """atomflow.bench.baselines.torch_llama with gpt-fast's settings: the decode step compiled with
    mode="reduce-overhead" (CUDA graphs), fullgraph, static shapes; prefill eager (gpt-fast
    compiles it only with --compile_prefill)."""

    prefill_chunk = 2048

    def __init__(self, hf_dir: Path, int8: bool, device: str = "cuda", dtype=None):
        import torch
        import torch._dynamo.config
        import torch._inductor.config as inductor

        from atomflow.bench.baselines import torch_llama
        inductor.coordinate_descent_tuning = True  # gpt-fast's generate.py settings
        inductor.triton.unique_kernel_names = True
        inductor.fx_graph_cache = True
        torch._dynamo.config.cache_size_limit = 64  # one compile per cache length (per test)
        self.torch, self.device = torch, device
        self.weight_dtype = "int8" if int8 else "bf16"
        self.model = torch_llama.load(hf_dir, device, dtype or torch.bfloat16, int8=int8)
        self._step = torch.compile(torch_llama.decode_one, mode="reduce-overhead", fullgraph=True, dynamic=False)
        self.compile_s: dict[int, float] = {}

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

    @staticmethod
    def cudagraph_skips() -> int:
        """Times inductor fell back from CUDA graphs (reported: the baseline then ran without them)."""
        from torch._dynamo.utils import counters
        return int(counters["inductor"].get("cudagraph_skips", 0))

    def prefill(self, ids):
        torch = self.torch
        with torch.no_grad():
            for s in range(0, ids.shape[1], self.prefill_chunk):
                chunk = ids[:, s:s + self.prefill_chunk]
                pos = torch.arange(self.p, self.p + chunk.shape[1], device=self.device)
                logits = self.model(chunk, pos)
                self.p += chunk.shape[1]
        self.pos.fill_(self.p)
        return torch.argmax(logits, dim=-1, keepdim=True)

    def step(self, token):
        with self.torch.no_grad():
            out = self._step(self.model, token, self.pos).clone()  # the graph's output is reused
        self.pos += 1
        self.p += 1
        return out


def make_decoder(name: str, hf_dir: Path):
    if name == "hf":
        return HfDecoder(hf_dir)
    if name in ("torch-compile", "torch-compile-int8"):
        return CompiledDecoder(hf_dir, int8=name.endswith("int8"))
    raise ValueError(f"unknown torch baseline {name!r}")


# ---------------------------------------------------------------------------------------
# timing

def time_pp(torch, dec, test: BenchTest, opts: BenchOptions, ids) -> dict:
    """Prefill of the whole prompt plus the greedy first token, synchronized on both ends."""
    runs = []
    for _rep in range(opts.repetitions + int(opts.warmup)):
        dec.start(test.n_prompt)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec.prefill(ids)
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    runs = runs[int(opts.warmup):]
    return dict(tokens_per_s=[test.n_prompt / s for s in runs], ttft_ms=[1e3 * s for s in runs])


def time_tg(torch, dec, test: BenchTest, opts: BenchOptions, ids) -> dict:
    """depth tokens prefilled, then n_gen steps with an event after each; TPOT = the n_gen - 1
    step intervals after the first generated token (as for our engine)."""
    n = test.n_gen
    tps, gaps_all = [], []
    dec.prepare(test.depth + n)
    for rep in range(opts.repetitions + int(opts.warmup)):
        dec.start(test.depth + n)
        if test.depth:
            dec.prefill(ids[:, :test.depth])
        token = ids[:, test.depth:test.depth + 1].clone()  # its own [1, 1] tensor, like every step's output
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


def run_torch_baseline(name: str, hf_dir: Path, opts: BenchOptions, bandwidth_gbs: float | None,
                       log: Callable[[str], None]) -> list[dict]:
    torch = require_torch_cuda()
    spec = ModelSpec.from_hf_dir(hf_dir)
    log(f"{name}: loading {hf_dir}")
    try:
        dec = make_decoder(name, hf_dir)
    except torch.cuda.OutOfMemoryError:
        raise Skip("out of GPU memory loading the model") from None
    weights = dense_weight_bytes(spec, dec.weight_dtype)
    head = spec.vocab_size * spec.hidden_size * (2 if dec.weight_dtype == "bf16" else 1) + spec.hidden_size * 2
    rows = []
    try:
        for test in opts.tests:
            log(f"{name}: {test.name}")
            ids = torch.from_numpy(prompt_ids(spec.vocab_size, max(test.n_prompt, test.depth + 1), opts.seed)
                                   ).long().view(1, -1).cuda()
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
            extra = {}
            if isinstance(dec, CompiledDecoder) and test.kind == "tg":
                extra.update(compile_s=dec.compile_s.get(dec.cache_len(test.positions)),
                             cudagraph_skips=dec.cudagraph_skips())
            rows.append(measured_row(name, test, bytes_per_token=nbytes, bandwidth_gbs=bandwidth_gbs,
                                 weight_dtype=dec.weight_dtype, **s, **extra))
    finally:
        compiled = isinstance(dec, CompiledDecoder)
        del dec
        if compiled:  # compiled code and CUDA-graph pools hold the model's memory until reset
            torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    return rows

