"""Our engine's side of `atomflow bench`: each test timed through the public paths a user runs,
random token ids (no tokenizer, no text), greedy, EOS ignored.

  pp<P>     Engine.prefill of P tokens from an empty cache (returns once the logits are on the
            host); TTFT = the pipelined generate path's first token from the same prompt.
  tg<N>@dD  the pipelined generate path from a prompt of D + 1 tokens (prefilled, the first token
            sampled from its last row; D = 0: the one token fed to a decode step); TPOT = the intervals between consecutive tokens
            as the host receives them, N - 1 per repetition; prefill time excluded.
  --speculate (tg tests only), on an engine loaded for it: the same test plain (engine
            "atomflow plain") and speculative (engine "atomflow ngram:K"): tokens per step, accepted
            tokens per verify step, the verify step's time and the effective TPOT (generation time /
            (N - 1)) in the row.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from atomflow.bench.bandwidth import PREFILL_CHUNK, prompt_bytes_per_token, token_bytes
from atomflow.bench.plan import BenchOptions, BenchTest, prompt_ids
from atomflow.bench.result import measured_row
from atomflow.engine import Engine
from atomflow.sampling import SamplingParams
from atomflow.speculate import SpecStats

WARMUP_TOKENS = 16


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def head_bytes(eng: Engine) -> int:
    """Final norm + lm_head (the embedding when tied): what a prefill reads once, not per chunk."""
    t = eng.model.tensors
    names = ["final_norm"] + (["lm_head", "lm_head.scale"] if "lm_head" in t else ["embed"])
    return sum(t[n].nbytes for n in names if n in t)


def time_pp(eng: Engine, test: BenchTest, opts: BenchOptions) -> dict:
    """Prompt tokens/s (Engine.prefill) and TTFT (the first token of generate_tokens) of the test's
    prompt after its depth of cached tokens (prefilled untimed before each run; the prompt's TTFT run
    reuses them as a cached prefix, as a later turn of a conversation does)."""
    d = test.depth
    ids = prompt_ids(eng.spec.vocab_size, d + test.n_prompt, opts.seed)

    def fill() -> None:
        eng.reset()
        if d:
            eng.prefill(ids[:d])

    if opts.warmup:
        fill()
        eng.prefill(ids[d:])
    tps, ttft = [], []
    for _ in range(opts.repetitions):
        fill()
        t0 = time.perf_counter()
        eng.prefill(ids[d:])
        tps.append(test.n_prompt / (time.perf_counter() - t0))
        fill()
        tokens = eng.generate_tokens(ids, greedy(1), reuse_prefix=True)
        t0 = time.perf_counter()
        next(tokens)
        ttft.append(1e3 * (time.perf_counter() - t0))
        if eng.stats.reused_tokens != d:
            raise RuntimeError(f"{test.name}: the engine reused {eng.stats.reused_tokens} cached tokens, not {d}")
        tokens.close()
    eng.reset()
    return dict(tokens_per_s=tps, ttft_ms=ttft)


def time_tg(eng: Engine, test: BenchTest, opts: BenchOptions) -> dict:
    ids = prompt_ids(eng.spec.vocab_size, test.depth + 1, opts.seed)
    n = test.n_gen
    if opts.warmup and test.depth == 0:  # deeper tests run the same graph: warm by then
        list(eng.generate_tokens(ids, greedy(min(n, WARMUP_TOKENS))))
    tps, gaps = [], []
    for _ in range(opts.repetitions):
        stamps = [time.perf_counter() for _ in eng.generate_tokens(ids, greedy(n))]
        if len(stamps) != n:
            raise RuntimeError(f"{test.name}: the engine generated {len(stamps)} tokens, not {n}")
        tps.append((n - 1) / (stamps[-1] - stamps[0]))
        gaps.append(list(np.diff(stamps) * 1e3))
    eng.reset()
    return dict(tokens_per_s=tps, tpot_ms=gaps)


def time_tg_speculate(eng: Engine, test: BenchTest, opts: BenchOptions, speculate: str) -> dict:
    ids = prompt_ids(eng.spec.vocab_size, test.depth + 1, opts.seed)
    n = test.n_gen
    if opts.warmup:
        list(eng.generate_tokens(ids, greedy(min(n, WARMUP_TOKENS)), speculate=speculate))
    tps, gaps, spec = [], [], []
    for _ in range(opts.repetitions):
        stamps = [time.perf_counter() for _ in eng.generate_tokens(ids, greedy(n), speculate=speculate)]
        if len(stamps) != n:
            raise RuntimeError(f"{test.name}: the engine generated {len(stamps)} tokens, not {n}")
        tps.append((n - 1) / (stamps[-1] - stamps[0]))
        gaps.append(list(np.diff(stamps) * 1e3))
        spec.append(eng.stats.speculation)
    eng.reset()
    out = dict(tokens_per_s=tps, tpot_ms=gaps, tpot_effective_ms=float(np.mean([1e3 / x for x in tps])))
    if spec[0] is not None:
        t = SpecStats.total(spec)

        def rate(v: float) -> float | None:  # the JSON's "not defined" (no drafts, no verify steps)
            return None if math.isnan(v) else v

        out.update(
            speculate=speculate,
            acceptance=rate(t.acceptance),
            tokens_per_step=t.tokens_per_step if t.verify_steps + t.plain_steps else 0.0,
            accepted_per_verify=rate(t.accepted_per_verify),
            verify_ms=rate(t.verify_ms),
            verify_steps=t.verify_steps,
            plain_steps=t.plain_steps,
        )
    return out


def run_speculate_tests(eng: Engine, opts: BenchOptions, bandwidth_gbs: float | None, log: Callable[[str], None]) -> list[dict]:
    rows = []
    for test in opts.tests:
        if test.kind != "tg":
            continue
        nbytes = token_bytes(eng.spec, eng.model.weight_bytes, test.mean_context)
        for engine, spec in (("atomflow plain", "off"), (f"atomflow {opts.speculate}", opts.speculate)):
            log(f"{engine}: {test.name}")
            s = time_tg_speculate(eng, test, opts, spec)
            rows.append(measured_row(engine, test, bytes_per_token=nbytes, bandwidth_gbs=bandwidth_gbs, weight_dtype="fp8", **s))
    return rows


def run_engine_tests(
    eng: Engine,
    opts: BenchOptions,
    bandwidth_gbs: float | None,
    log: Callable[[str], None],
    engine: str = "atomflow",
    kinds: tuple[str, ...] = ("pp", "tg"),
) -> list[dict]:
    """The tests of `kinds` on `eng`, rows named `engine`."""
    rows = []
    for test in opts.tests:
        if test.kind not in kinds:
            continue
        log(f"{engine}: {test.name}")
        if test.kind == "pp":
            s = time_pp(eng, test, opts)
            chunk = getattr(eng.backend, "prefill_chunk", PREFILL_CHUNK)
            nbytes = prompt_bytes_per_token(eng.spec, eng.model.weight_bytes, head_bytes(eng), test.n_prompt, chunk)
        else:
            s = time_tg(eng, test, opts)
            nbytes = token_bytes(eng.spec, eng.model.weight_bytes, test.mean_context)
        rows.append(measured_row(engine, test, bytes_per_token=nbytes, bandwidth_gbs=bandwidth_gbs, weight_dtype="fp8", **s))
    return rows
