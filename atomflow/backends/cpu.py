"""The CPU backend: the numpy reference forward pass (atomflow/model/reference.py) behind the
backend contract (atomflow/backends/__init__.py)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from atomflow.model.fileformat import AtomflowFile
from atomflow.model.reference import ReferenceModel
from atomflow.sampling import SamplingParams, sample_numpy
from atomflow.speculate import greedy_rows
from atomflow.tokens import generation_budget


class CpuBackend:
    """numpy fp32 reference forward; slow, exact, and always available."""

    name = "cpu"

    def __init__(self, model: AtomflowFile, max_context: int, prefill_recipe: str = "w8a16", **_ignored):
        self.spec = model.spec
        self.max_context = max_context
        self.ref = ReferenceModel(model, max_context, prefill_recipe)  # w8a8: the FP8 recipe emulated
        self._run: object | None = None  # the generate_ids() run that owns the cache now (as CudaBackend's)

    @property
    def position(self) -> int:
        return self.ref.pos

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        self._run = None
        return self.ref.forward(np.asarray(ids, dtype=np.int32))

    def decode(self, token: int) -> np.ndarray:
        self._run = None
        return self.ref.forward(np.array([token], dtype=np.int32))

    def reset(self) -> None:
        self._run = None
        self.ref.pos = 0

    def rollback(self, position: int) -> None:
        self._run = None
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

    # -- speculative decoding (atomflow/speculate.py) -----------------------------------------------
    # verify runs its rows one at a time: a numpy chunk rounds differently from single rows (BLAS
    # blocking; ~4e-6 on the tiny model), so the rows equal decode steps by construction here.
    verify_rows = 16
    exact_verify = True

    def spec_prefill(self, ids: np.ndarray, start: int) -> int:
        """As generate_ids: the rest of the prompt in one forward; its greedy token."""
        if not 0 <= start < len(ids):
            raise ValueError(f"start {start} must be in [0, {len(ids)}) (at least one prompt token runs)")
        self.rollback(start)
        return int(greedy_rows(self.prefill(np.asarray(ids[start:])), self.position))

    def verify(self, ids: np.ndarray) -> np.ndarray:
        """Each row's greedy token (NonFiniteLogitsError on NaN / Inf logits)."""
        self._run = None
        position = self.position
        return greedy_rows(
            np.stack([self.ref.forward(np.array([t], dtype=np.int32)) for t in np.asarray(ids).reshape(-1)]), position
        )

    def steps(self, token: int, n: int) -> Iterator[int]:
        """n greedy decode steps from `token`."""
        run = self._run = object()
        for _ in range(n):
            if self._run is not run:
                raise RuntimeError("this generation was ended by a later call on the same backend")
            token = int(greedy_rows(self.ref.forward(np.array([token], dtype=np.int32)), self.position))
            yield token

    def hold(self, keep: int) -> object:
        self._run = object()
        return self._run

    def hold_of(self):
        return self._run

    def generate_ids(self, prompt_ids: np.ndarray, params: SamplingParams, start: int = 0) -> Iterator[int]:
        if not 0 <= start < len(prompt_ids):
            raise ValueError(f"start {start} must be in [0, {len(prompt_ids)}) (at least one prompt token runs)")
        self.rollback(start)
        logits = self.prefill(prompt_ids[start:])
        run = self._run = object()
        budget = generation_budget(len(prompt_ids), params.max_new_tokens, self.max_context)
        for i in range(budget):
            token = sample_numpy(logits, params, self.position)
            yield token
            if i + 1 == budget:
                return
            if self._run is not run:  # the cache now holds another run's tokens
                raise RuntimeError("this generation was ended by a later call on the same backend")
            logits = self.ref.forward(np.array([token], dtype=np.int32))
