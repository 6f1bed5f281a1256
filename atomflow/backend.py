"""The backend interface the Engine drives, its CPU implementation, and backend selection.

A backend owns one KV cache and a position (tokens in the cache). Both implementations keep
the same contract, so the facade, the tests and the validator treat them alike:
  prefill(ids) -> fp32 logits [vocab] of the last token (appends ids at the position)
  decode(token) -> fp32 logits [vocab] (appends one token)
  reset(); rollback(position)
  generate_ids(prompt_ids, params, start=0) -> iterator of sampled ids; it rolls the cache back to
    `start` (0: reset) and prefills prompt_ids[start:] first (the caller vouches that the cache
    holds prompt_ids[:start]; start < len(prompt_ids)). Closing it early leaves the cache holding
    the prompt + every yielded id but the last.
"""
from __future__ import annotations

import sys
from typing import Iterator

import numpy as np

from .device import cuda_status
from .errors import BackendUnavailableError
from .fileformat import AtomflowFile
from .reference import ReferenceModel
from .sampling import SamplingParams, sample_numpy


class CpuBackend:
    """numpy fp32 reference forward; slow, exact, and always available."""

    name = "cpu"

    def __init__(self, model: AtomflowFile, max_context: int, **_ignored):
        self.spec = model.spec
        self.max_context = max_context
        self.ref = ReferenceModel(model, max_context)

    @property
    def position(self) -> int:
        return self.ref.pos

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        return self.ref.forward(np.asarray(ids, dtype=np.int32))

    def decode(self, token: int) -> np.ndarray:
        return self.ref.forward(np.array([token], dtype=np.int32))

    def reset(self) -> None:
        self.ref.pos = 0

    def rollback(self, position: int) -> None:
        if not 0 <= position <= self.ref.pos:
            raise ValueError(f"rollback to {position}: must be in [0, {self.ref.pos}]")
        self.ref.pos = position

    def probed_prefill(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """prefill() that also returns the validator's probes: "attn_norm.3" -> [M, d], ...,
        "final_norm" and "logits" -> [1, ...] (the last position)."""
        return self._probed(lambda: self.prefill(ids))

    def probed_decode(self, token: int) -> dict[str, np.ndarray]:
        return self._probed(lambda: self.decode(token))

    def _probed(self, run) -> dict[str, np.ndarray]:
        got: dict[str, list[np.ndarray]] = {}

        def probe(name: str, layer: int, a: np.ndarray) -> None:
            got.setdefault(name if layer < 0 else f"{name}.{layer}", []).append(np.array(a, dtype=np.float32))

        self.ref.probe = probe
        try:
            run()
        finally:
            self.ref.probe = None
        # a long prompt runs in chunks: the last chunk's final_norm/logits are the last position
        return {k: (v[-1] if k in ("final_norm", "logits") else np.concatenate(v)) for k, v in got.items()}

    def generate_ids(self, prompt_ids: np.ndarray, params: SamplingParams, start: int = 0) -> Iterator[int]:
        if not 0 <= start < len(prompt_ids):
            raise ValueError(f"start {start} must be in [0, {len(prompt_ids)}) (at least one prompt token runs)")
        self.rollback(start)
        logits = self.prefill(prompt_ids[start:])
        for i in range(params.max_new_tokens):
            token = sample_numpy(logits, params, self.position)
            yield token
            if i + 1 == params.max_new_tokens or self.position >= self.max_context:
                return
            logits = self.decode(token)


def make_backend(name: str, model: AtomflowFile, max_context: int, eager: bool | None = None,
                 verbose: bool = False):
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"backend must be auto, cpu or cuda, got {name!r}")
    if name == "cpu":
        return CpuBackend(model, max_context)
    ok, why = cuda_status()
    if not ok:
        if name == "cuda":
            raise BackendUnavailableError(f"cuda backend unavailable: {why}")
        print(f"atomflow: running on the CPU backend (slow): {why}", file=sys.stderr)
        return CpuBackend(model, max_context)
    from .backend_cuda import CudaBackend
    return CudaBackend(model, max_context, eager=eager, verbose=verbose)
