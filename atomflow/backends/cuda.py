"""The CUDA backend: the same contract as CpuBackend (atomflow/backends/cpu.py), run by the _core engine.

Generation is pipelined: the prompt but its last token is prefilled, the last token goes in as
the first decode step's input, and every step samples on the device and feeds its token to the
next step on the device. The host keeps up to IN_FLIGHT steps enqueued and collects tokens from
the engine's pinned ring as they complete, so it never stands between two steps.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from atomflow.errors import BackendUnavailableError, UnsupportedModelError
from atomflow.model.fileformat import AtomflowFile
from atomflow.sampling import SamplingParams

IN_FLIGHT = 4  # decode steps enqueued ahead of the one being read (the engine's ring holds 8)


def eager_from_env() -> bool:
    """ATOMFLOW_EAGER set to anything but empty or 0: the default of every eager argument."""
    return os.environ.get("ATOMFLOW_EAGER", "0") not in ("", "0")


class _Run:
    """An unfinished generate_ids() run: `keep` = the position that holds its prompt and every
    token it yielded but the last (what the cache must hold once it stops)."""

    def __init__(self, keep: int):
        self.keep = keep


def _core_module():
    try:
        from atomflow import _core  # type: ignore[attr-defined]
    except ImportError as e:
        raise BackendUnavailableError(f"cuda backend unavailable: the CUDA core was not built ({e})") from None
    ok, why = _core.cuda_available()
    if not ok:
        raise BackendUnavailableError(f"cuda backend unavailable: {why}")
    return _core


class CudaBackend:
    """The _core engine over one .atomflow file: weights, KV cache for max_context tokens, one
    CUDA graph per decode step. eager runs the step without the graph; None (the default) takes it
    from the ATOMFLOW_EAGER environment variable (eager_from_env)."""

    name = "cuda"

    def __init__(self, model: AtomflowFile, max_context: int, eager: bool | None = None, verbose: bool = True):
        if model.spec.cuda_unsupported():  # before the core sees a spec it has no kernels for
            raise UnsupportedModelError(model.spec.cuda_unsupported() + " (--backend cpu runs it)")
        core = _core_module()
        if isinstance(max_context, bool) or not isinstance(max_context, (int, np.integer)) or max_context < 1:
            raise ValueError(f"max_context must be a positive integer, got {max_context!r}")
        eager = eager_from_env() if eager is None else bool(eager)
        self.spec = model.spec
        self.max_context = int(max_context)
        self._run: _Run | None = None  # the generate_ids() run that drives the pipeline now
        self.engine = core.Engine(str(model.path), model.spec.to_dict(), model.tensor_table(),
                                  np.ascontiguousarray(model.spec.rope_inv_freq(), dtype=np.float32),
                                  self.max_context, eager=eager, verbose=verbose)

    # -- the backend contract -------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.engine.position

    @property
    def eager(self) -> bool:
        return not self.engine.graph_enabled

    # -- what the core reports about itself ------------------------------------------------------
    @property
    def load_seconds(self) -> float:
        """File -> device weight copy time (the arena plan and graph capture not included)."""
        return self.engine.load_seconds

    @property
    def plan(self) -> dict:
        """Arena bytes: weights, kv, activations, scratch, total."""
        return self.engine.plan

    @property
    def device_allocations(self) -> int:
        return self.engine.device_allocations

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        ids = self._ids(ids)
        self._end_run()
        return self.engine.prefill(ids)

    def decode(self, token: int) -> np.ndarray:
        self._end_run()
        return self.engine.decode(int(token))

    def probed_prefill(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """prefill() run eagerly, returning the validator's probes (see CpuBackend)."""
        ids = self._ids(ids)
        self._end_run()
        return dict(self.engine.prefill_probed(ids))

    def probed_decode(self, token: int) -> dict[str, np.ndarray]:
        self._end_run()
        return dict(self.engine.decode_probed(int(token)))

    def reset(self) -> None:
        self._end_run()
        self.engine.reset()

    def rollback(self, position: int) -> None:
        self._end_run()
        if not 0 <= position <= self.engine.position:
            raise ValueError(f"rollback to {position}: must be in [0, {self.engine.position}]")
        self.engine.set_position(int(position))

    def generate_ids(self, prompt_ids: np.ndarray, params: SamplingParams) -> Iterator[int]:
        """Resets, prefills, then yields up to params.max_new_tokens sampled ids (fewer when the
        context fills). Checks the prompt now, not at the first next()."""
        ids = self._ids(prompt_ids)
        if len(ids) > self.max_context:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_context {self.max_context}")
        vocab = self.spec.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise ValueError(f"token id {bad} out of range [0, {vocab})")
        return self._generate(ids, params)

    # -- internals ------------------------------------------------------------------------------
    def _generate(self, ids: np.ndarray, params: SamplingParams) -> Iterator[int]:
        eng = self.engine
        n = len(ids)
        # Steps at positions n-1 .. max_context-1 can run: the same budget as the CPU backend.
        budget = min(int(params.max_new_tokens), self.max_context - n + 1)
        seed = 0 if params.seed is None else int(params.seed)
        self._end_run()
        eng.reset()
        eng.set_sampling(float(params.temperature), int(params.top_k or 0),
                         float(1.0 if params.top_p is None else params.top_p), seed)
        if n > 1:
            eng.prefill(ids[:-1])
        eng.begin(int(ids[-1]))
        run = self._run = _Run(keep=n - 1)
        enqueued = yielded = 0
        try:
            while yielded < budget:
                if self._run is not run:
                    raise RuntimeError("this generation was ended by a later call on the same backend")
                ahead = min(IN_FLIGHT, budget - yielded) - (enqueued - yielded)
                if ahead > 0:
                    eng.enqueue(ahead)
                    enqueued += ahead
                (token,) = eng.wait(1)
                yielded += 1
                run.keep += 1
                yield token
        finally:
            if self._run is run:
                self._end_run()

    def _end_run(self) -> None:
        """Stops the unfinished generate_ids() run, if any: drops the steps it enqueued past the
        consumer's last token and rolls the cache back to its prompt + yielded tokens but the last
        (the last one was never fed)."""
        run, self._run = self._run, None
        if run is not None:
            self.engine.synchronize()
            self.engine.set_position(run.keep)

    @staticmethod
    def _ids(ids) -> np.ndarray:
        a = np.asarray(ids)
        if a.ndim != 1:
            a = a.reshape(-1)
        if a.size == 0:
            raise ValueError("empty prompt: nothing to run")
        if a.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {a.dtype}")
        return a  # the binding range-checks and converts to int32
