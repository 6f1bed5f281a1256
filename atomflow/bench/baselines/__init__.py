"""Baselines for `atomflow bench`, run on the model's original Hugging Face directory with the
same tests (prompt lengths, generated tokens, depths, random token ids) as our engine:

  hf                  transformers eager, bf16, a manual greedy loop over past_key_values
  torch-compile       atomflow.bench.baselines.torch_llama (gpt-fast recipe), bf16, decode step under
                      torch.compile(mode="reduce-overhead", fullgraph=True), prefill under
                      torch.compile(fullgraph=True, dynamic=True) with KV heads repeated so a fused
                      SDPA kernel runs (gpt-fast's --compile_prefill; --eager-prefill: eager)
  torch-compile-int8  the same with int8 weight-only linears
  torch-fp8           the same with FP8 linears: e4m3 weights with per-row scales, activations
                      quantized per token, torch._scaled_mm with rowwise scales (sm89+)
  vllm                vLLM's offline LLM, bf16, when it is importable

Every measured row of a torch baseline carries `recipe` (precision, what is compiled and how,
which attention runs) and, where compiled, the compile times (compile_s, prefill_compile_s).

A baseline that cannot run here (no torch, no CUDA, no HF directory, an import error, out of
memory) gives rows marked skipped with the reason; nothing is estimated. torch is imported only
inside the runners, on demand.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from atomflow.bench.plan import BenchOptions, BenchTest
from atomflow.bench.result import skipped_row


class Skip(Exception):
    """This baseline (or one test of it) cannot run here; the message says why."""


def reason(e: BaseException) -> str:
    """One line naming an unexpected failure."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def not_run(name: str, test: BenchTest) -> dict | None:
    """The skipped row of a test no baseline runs (a prompt after cached tokens, pp<P>@d<D>: it would need
    the baseline's own prefix cache), else None."""
    if test.kind == "pp" and test.depth:
        return skipped_row(name, test, "a prompt after cached tokens is not run by this baseline")
    return None


def check_hf_dir(hf_dir: str | Path | None) -> Path:
    if not hf_dir:
        raise Skip("no HF directory: pass --hf-dir (the model file records no existing source directory)")
    p = Path(hf_dir)
    if not (p / "config.json").is_file():
        raise Skip(f"no HF model in {p} (no config.json)")
    return p


def run(
    name: str, hf_dir: str | Path | None, opts: BenchOptions, bandwidth_gbs: float | None, log: Callable[[str], None]
) -> list[dict]:
    """Rows for every test of opts; a baseline that cannot start gives one skipped row per test."""
    tests: tuple[BenchTest, ...] = opts.tests
    try:
        path = check_hf_dir(hf_dir)
        if name == "vllm":
            from atomflow.bench.baselines.vllm_runner import run_vllm

            return run_vllm(path, opts, bandwidth_gbs, log)
        from atomflow.bench.baselines.torch_runner import run_torch_baseline

        return run_torch_baseline(name, path, opts, bandwidth_gbs, log)
    except Skip as e:
        return [skipped_row(name, t, str(e)) for t in tests]
    except Exception as e:  # noqa: BLE001 - reported as the row's reason, never hidden or faked
        return [skipped_row(name, t, reason(e)) for t in tests]
