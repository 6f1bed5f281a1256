"""Backends: what the Engine facade drives, and how one is chosen.

A backend owns one KV cache and a position (tokens in the cache). Both implementations keep
the same contract, so the facade, the tests and the validator treat them alike:
  prefill(ids) -> fp32 logits [vocab] of the last token (appends ids at the position)
  decode(token) -> fp32 logits [vocab] (appends one token)
  reset(); rollback(position)
  generate_ids(prompt_ids, params, start=0) -> iterator of sampled ids; it rolls the cache back to
    `start` (0: reset) and prefills prompt_ids[start:] first (the caller vouches that the cache
    holds prompt_ids[:start]; start < len(prompt_ids)). Closing it early leaves the cache holding
    the prompt + every yielded id but the last.

  cpu.py   CpuBackend: the numpy reference (runs everywhere)
  cuda.py  CudaBackend: the _core engine (CUDA graph decode, pipelined generation)
"""

from __future__ import annotations

import sys

from atomflow.backends.cpu import CpuBackend
from atomflow.device import cuda_status
from atomflow.errors import BackendUnavailableError, UnsupportedModelError
from atomflow.model.fileformat import AtomflowFile
from atomflow.model.recipe import PREFILL_RECIPES


def make_backend(
    name: str,
    model: AtomflowFile,
    max_context: int,
    eager: bool | None = None,
    verbose: bool = False,
    prefill_recipe: str = "w8a16",
    **plan: bool,
):
    """plan: step plan options for the CUDA backend (atomflow/backends/cuda.py PLAN_OPTIONS); the CPU one has
    none. prefill_recipe: w8a16 (the default) or w8a8, the FP8 prefill recipe (the CUDA plan's prefill_fp8;
    emulated by the CPU reference)."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"backend must be auto, cpu or cuda, got {name!r}")
    if prefill_recipe not in PREFILL_RECIPES:
        raise ValueError(f"prefill recipe must be one of {', '.join(PREFILL_RECIPES)}, got {prefill_recipe!r}")
    if name == "cpu":
        return CpuBackend(model, max_context, prefill_recipe)
    ok, why = cuda_status()
    unsupported = model.spec.cuda_unsupported()
    if not ok or unsupported:
        if name == "cuda":
            if unsupported:
                raise UnsupportedModelError(unsupported + " (--backend cpu runs it)")
            raise BackendUnavailableError(f"cuda backend unavailable: {why}")
        print(f"atomflow: running on the CPU backend (slow): {unsupported or why}", file=sys.stderr)
        return CpuBackend(model, max_context, prefill_recipe)
    from atomflow.backends.cuda import CudaBackend

    if prefill_recipe == "w8a8":
        plan["prefill_fp8"] = True
    return CudaBackend(model, max_context, eager=eager, verbose=verbose, **plan)
