"""The CUDA backend: the same contract as CpuBackend (atomflow/backends/cpu.py), run by the _core engine.

Generation is pipelined: the prompt but its last token is prefilled, the last token goes in as
the first decode step's input, and every step samples on the device and feeds its token to the
next step on the device. The host keeps up to IN_FLIGHT steps enqueued and collects tokens from
the engine's pinned ring as they complete, so it never stands between two steps.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np

from atomflow.errors import BackendUnavailableError, NonFiniteLogitsError, UnsupportedModelError
from atomflow.model.fileformat import AtomflowFile
from atomflow.sampling import SamplingParams
from atomflow.tokens import check_ids, generation_budget

IN_FLIGHT = 4  # decode steps enqueued ahead of the one being read (the engine's ring holds 8)


# The step plan's options (include/atomflow/step_plan.h): f16_activations is a user setting (default
# from ATOMFLOW_BF16_ACTS) and prefill_fp8 a recipe; skinny_gemm changes a prompt chunk's rounding (step_plan.h);
# the others change the schedule, never the bits. All but f16_activations are for comparisons.
PLAN_OPTIONS = (
    "f16_activations",
    "fused_tail",
    "short_steps",
    "cluster_merge",
    "staged_pair",
    "tickets",
    "prefill_fp8",
    "gemm_pdl",
    "skinny_gemm",
    "skinny_rope",
    "skinny_norm",
)


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def options_from_env() -> dict[str, bool]:
    """The environment, read in this one place and passed down as options: ATOMFLOW_EAGER=1 runs the
    decode step without the CUDA graph, ATOMFLOW_BF16_ACTS=1 decodes with bf16 activations from the
    start (any value but empty or 0 sets a switch). They are the defaults of the eager argument and
    the f16_activations option. (The core reads one debug switch itself: ATOMFLOW_NO_PDL.)"""
    return {"eager": _flag("ATOMFLOW_EAGER"), "f16_activations": not _flag("ATOMFLOW_BF16_ACTS")}


def plan_option(text: str) -> tuple[str, bool]:
    """A tool's `--option NAME=0|1` -> (NAME, on); ValueError unless NAME is one of PLAN_OPTIONS."""
    name, _, value = text.partition("=")
    if value not in ("0", "1"):
        raise ValueError(f"--option: NAME=0 or NAME=1, got {text!r}")
    if name not in PLAN_OPTIONS:
        raise ValueError(f"--option: unknown plan option {name!r}; known: {', '.join(PLAN_OPTIONS)}")
    return name, value == "1"


def engine_options(eager: bool | None = None, **plan) -> dict[str, bool]:
    """options_from_env() with the explicit arguments on top: eager (None: from the environment) and
    any of PLAN_OPTIONS; anything else is a ValueError."""
    unknown = sorted(set(plan) - set(PLAN_OPTIONS))
    if unknown:
        raise ValueError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(PLAN_OPTIONS)}")
    opts = options_from_env()
    if eager is not None:
        opts["eager"] = bool(eager)
    opts.update({k: bool(v) for k, v in plan.items()})
    return opts


def plan_for(model: AtomflowFile, max_context: int, eager: bool | None = None, **plan) -> dict:
    """The step plan an engine of this model and options would make on this GPU (`atomflow info
    --plan`), without loading the weights. BackendUnavailableError without a usable GPU."""
    core = _core_module()
    return core.plan_for(model.spec.to_dict(), int(max_context), **engine_options(eager, **plan))


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
    from the ATOMFLOW_EAGER environment variable. prefill_chunk: rows per prefill pass (default the
    step plan's for the model on this GPU, 2048 or 4096: `step_plan["prefill_chunk"]`; at most max_context). plan:
    overrides of the step plan (PLAN_OPTIONS), e.g. f16_activations=False (default from
    ATOMFLOW_BF16_ACTS) or fused_tail=False."""

    name = "cuda"

    def __init__(
        self,
        model: AtomflowFile,
        max_context: int,
        eager: bool | None = None,
        verbose: bool = True,
        prefill_chunk: int | None = None,
        **plan: bool,
    ):
        if model.spec.cuda_unsupported():  # before the core sees a spec it has no kernels for
            raise UnsupportedModelError(model.spec.cuda_unsupported() + " (--backend cpu runs it)")
        core = _core_module()
        if isinstance(max_context, bool) or not isinstance(max_context, (int, np.integer)) or max_context < 1:
            raise ValueError(f"max_context must be a positive integer, got {max_context!r}")
        options = engine_options(eager, **plan)
        if prefill_chunk is not None:
            if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
                raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
            options["prefill_chunk"] = int(prefill_chunk)
        self.spec = model.spec
        self.max_context = int(max_context)
        self._run: _Run | None = None  # the generate_ids() run that drives the pipeline now
        self.engine = core.Engine(
            str(model.path),
            model.spec.to_dict(),
            model.tensor_table(),
            np.ascontiguousarray(model.spec.rope_inv_freq(), dtype=np.float32),
            self.max_context,
            verbose=verbose,
            **options,
        )

    # -- the backend contract -------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.engine.position

    @property
    def eager(self) -> bool:
        return not self.engine.graph_enabled

    @property
    def step_plan(self) -> dict:
        """Every launch decision of the decode step, made at load (as `atomflow info --plan`)."""
        return self.engine.step_plan

    # -- what the core reports about itself ------------------------------------------------------
    @property
    def prefill_chunk(self) -> int:
        """Rows per prefill pass: the one asked for, or the core's default, at most max_context."""
        return self.engine.prefill_chunk

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
        ids = check_ids(ids, self.spec.vocab_size)
        self._end_run()
        return self.engine.prefill(ids)

    def decode(self, token: int) -> np.ndarray:
        self._end_run()
        return self.engine.decode(int(token))

    def probed_prefill(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """prefill() run eagerly, returning the validator's probes (see CpuBackend)."""
        ids = check_ids(ids, self.spec.vocab_size)
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

    def generate_ids(self, prompt_ids: np.ndarray, params: SamplingParams, start: int = 0) -> Iterator[int]:
        """Rolls back to `start` (0: resets; the cache must hold prompt_ids[:start]), prefills the
        rest, then yields up to params.max_new_tokens sampled ids (fewer when the context fills).
        prompt_ids: checked ids (atomflow.tokens.check_ids) that fit. Checks `start` now, not at the
        first next()."""
        ids = np.asarray(prompt_ids, dtype=np.int32)
        if len(ids) > self.max_context:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_context {self.max_context}")
        self._end_run()  # the position is exact only once no run is in flight
        if not 0 <= start < len(ids) or start > self.engine.position:
            raise ValueError(f"start {start} must be in [0, {len(ids)}) and at most the position {self.engine.position}")
        return self._generate(ids, params, int(start))

    # -- internals ------------------------------------------------------------------------------
    def _generate(self, ids: np.ndarray, params: SamplingParams, start: int) -> Iterator[int]:
        budget = generation_budget(len(ids), params.max_new_tokens, self.max_context)
        seed = 0 if params.seed is None else int(params.seed)
        top_p = float(1.0 if params.top_p is None else params.top_p)
        self._start(start, (float(params.temperature), int(params.top_k or 0), top_p, seed))
        if len(ids) - start == 1:  # the prompt's one new token is the first decode step's input
            yield from self._pipeline(budget, keep=len(ids) - 1, token=int(ids[-1]))
        else:  # the first token sampled on the device from the prompt's last row (no decode step for it)
            yield from self._pipeline(budget, keep=len(ids) - 1, prompt=ids[start:])

    def _start(self, start: int, sampling: tuple) -> None:
        """No run in flight, the cache rolled back to `start` (0: reset; it holds the prompt's first
        `start` ids), the device sampler set to `sampling` (temperature, top_k, top_p, seed)."""
        self._end_run()
        if start:
            self.engine.set_position(start)  # the cache already holds ids[:start] (a reused prefix)
        else:
            self.engine.reset()
        self.engine.set_sampling(*sampling)

    def _pipeline(self, budget: int, keep: int, token: int | None = None, prompt: np.ndarray | None = None) -> Iterator[int]:
        """`budget` tokens, up to IN_FLIGHT steps enqueued ahead of the one read; yields each sampled
        token as it lands in the ring. The first step: a decode step fed `token` at position `keep`, or
        the sample of `prompt`'s last row (ids to prefill, at least 2, their last at `keep`;
        Engine.begin_prompt, its logits checked to be finite)."""
        eng = self.engine
        if prompt is not None:
            eng.begin_prompt(prompt)
        else:
            eng.begin(token)
        run = self._run = _Run(keep=keep)
        enqueued, yielded = int(prompt is not None), 0
        try:
            while yielded < budget:
                if self._run is not run:
                    raise RuntimeError("this generation was ended by a later call on the same backend")
                ahead = min(IN_FLIGHT, budget - yielded) - (enqueued - yielded)
                if ahead > 0:
                    eng.enqueue(ahead)
                    enqueued += ahead
                (sampled,) = eng.wait(1)
                # NaN/Inf in the weights reaches every row. The logits stay on the device: the prompt's row
                # is checked there (prompt_finite), and a step the sampler drew nothing from gives -1.
                first_of_prompt = prompt is not None and yielded == 0
                if sampled < 0 or (first_of_prompt and not eng.prompt_finite()):
                    raise NonFiniteLogitsError(f"non-finite logits at position {run.keep}", run.keep)
                yielded += 1
                run.keep += 1
                yield sampled
        finally:
            if self._run is run:
                self._end_run()

    # -- speculative decoding (atomflow/speculate.py) -----------------------------------------------
    @property
    def verify_rows(self) -> int:
        """The most rows a verify chunk runs on the small-M GEMV (the decode step's bits per row), its
        head included (the engine's logit_rows)."""
        return min(int(self.step_plan["prefill_small_m_max_rows"]), int(self.engine.logit_rows))

    # Verify rows equal decode steps bit for bit: they run the decode step's activations (fp16 with its
    # overflow flag, or bf16), whichever the engine is in.
    exact_verify = True

    def spec_prefill(self, ids: np.ndarray, start: int) -> int | None:
        """As generate_ids: the cache then holds ids (from `start`), greedy sampling set, and the first token
        is generate_ids' own: sampled on the device from the prompt's last row (Engine.begin_prompt, the
        same chunks and bits), so speculative output equals plain greedy output from the first token on.
        None when only the last id is new: the first verify (or decode) step feeds it, as generate_ids'
        first decode step does."""
        ids = np.asarray(ids, dtype=np.int32)
        self._end_run()
        if not 0 <= start < len(ids) or start > self.engine.position:
            raise ValueError(f"start {start} must be in [0, {len(ids)}) and at most the position {self.engine.position}")
        self._start(start, (0.0, 0, 1.0, 0))
        if len(ids) - start == 1:
            return None
        with contextlib.closing(self._pipeline(1, keep=len(ids) - 1, prompt=ids[start:])) as first:
            return int(next(first))  # closed: the cache holds the prompt, the token not fed

    def verify(self, ids: np.ndarray) -> np.ndarray | None:
        """Appends ids (one chunk of <= verify_rows) at the position; int32 [len(ids)]: each row's greedy
        token, chosen on the device (-1 where a row holds a NaN or +Inf or only -Inf, as the sampler). None,
        with nothing appended, where an fp16 activation passed fp16's range: decode on with steps."""
        ids = check_ids(ids, self.spec.vocab_size)
        self._end_run()
        return self.engine.verify_greedy(ids)

    def steps(self, token: int, n: int) -> Iterator[int]:
        """n pipelined decode steps from `token` with the sampling last set (spec_prefill: greedy)."""
        self._end_run()
        return self._pipeline(int(n), keep=self.engine.position, token=int(token))

    def hold(self, keep: int) -> _Run:
        """A speculative run owns the cache: a later call ends it, rolling back to `keep`."""
        self._run = _Run(keep=keep)
        return self._run

    def hold_of(self):
        return self._run

    def _end_run(self) -> None:
        """Stops the unfinished generate_ids() run, if any: drops the steps it enqueued past the
        consumer's last token and rolls the cache back to its prompt + yielded tokens but the last
        (the last one was never fed)."""
        run, self._run = self._run, None
        if run is not None:
            self.engine.synchronize()
            self.engine.set_position(run.keep)
