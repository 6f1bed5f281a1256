"""Speculative decoding with n-gram drafts (prompt lookup), greedy only.

The drafter looks for the longest suffix of the sequence (prompt + output), n_max..n_min tokens,
that occurred earlier, and proposes the up to k tokens that followed its most recent earlier
occurrence. The backend verifies the last accepted token and the k drafts as one chunk of k + 1
rows (on CUDA: the small-M GEMV, whose rows are the decode step's bits in the engine's activations)
and returns every row's greedy token; the longest draft prefix the model's own greedy choice
confirms is kept, plus the model's token after it, and the KV position rolls back past the rejected
rows. So the tokens equal plain greedy decoding's, token for token, wherever the verify rows equal
decode steps (README: exactness). A verify whose fp16 activations passed fp16's range appends
nothing (backend.verify gives None): a plain step goes on from there, and reruns in bf16 as plain
decoding does. k adapts (halves on a full miss, doubles on a full accept) and
speculation pauses for a while when the recent acceptance says it does not pay. Where no draft is
found, a run of plain_run pipelined plain steps goes on before the next lookup: one step at a time
would wait for each (a run pays that once), and a draft found after its first token is still there,
one token on, after its last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from atomflow.errors import NonFiniteLogitsError
from atomflow.tokens import generation_budget

METHODS = ("ngram",)
# The defaults: tools/speculate_sim.py on the prompts' recorded greedy tokens with SmolLM2's verify costs per
# row count (H200) predicted plain runs of 3 and k 10..15 ahead of runs of 1 and k 8 (copy 1.77 -> 1.80-1.82x,
# chat 1.08 -> 1.11-1.12x, open 1.04 -> 1.09-1.10x; with a 3B's costs alike); tools/speculate_bench.py -n 128
# on an H200, two rounds in one call, plain runs of 3: k 8 / 10 / 11 copy 1.73-1.75 / 1.81-1.82 / 1.79-1.85x,
# chat 1.11-1.12 / 1.11-1.12 / 1.10-1.11x, open 1.06 / 1.05 / 1.03-1.05x (docs/perf-log.md 2026-11-28 g).
DEFAULT_K = 10
DEFAULT_PLAIN_RUN = 3
# The pause threshold of a run that has not yet timed both a verify step and a plain step.
FALLBACK_MIN_ACCEPT = 0.6
MAX_ROWS = 16  # a verify chunk's rows: the small-M GEMV's limit on CUDA (StepPlan::small_m_max_rows)


@dataclass(frozen=True)
class SpecConfig:
    """k_max: the most drafted tokens per verify step (1..MAX_ROWS - 1). n_max..n_min: the suffix
    lengths looked up, longest first (a one-token suffix is too weak a match to draft from: n_min 2).
    window, min_accept: speculation pauses when the last `window` verify steps accepted fewer than
    min_accept drafted tokens per step on average; None: the break-even measured in the run (a verify
    step's time over a plain step's, minus one). It pauses for pause_tokens plain tokens, doubling on
    each pause in a row up to max_pause_tokens. plain_run: the pipelined plain steps taken where no draft is
    found, before the next lookup (at least 1)."""

    method: str = "ngram"
    k_max: int = DEFAULT_K
    n_max: int = 3
    n_min: int = 2
    window: int = 8
    min_accept: float | None = None
    pause_tokens: int = 16
    max_pause_tokens: int = 256
    plain_run: int = DEFAULT_PLAIN_RUN

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculate method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.k_max <= MAX_ROWS - 1:
            raise ValueError(f"speculate k must be in [1, {MAX_ROWS - 1}], got {self.k_max}")
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"n-gram lengths need 1 <= n_min <= n_max, got {self.n_min}..{self.n_max}")
        if self.window < 1 or self.pause_tokens < 1 or self.max_pause_tokens < self.pause_tokens or self.plain_run < 1:
            raise ValueError("window, pause_tokens and plain_run must be >= 1, max_pause_tokens >= pause_tokens")
        if self.min_accept is not None and not self.min_accept >= 0:
            raise ValueError(f"min_accept must be >= 0 or None (measured), got {self.min_accept}")

    def __str__(self) -> str:
        return f"{self.method}:{self.k_max}"


def parse_speculate(value: str | SpecConfig | None) -> SpecConfig | None:
    """The one parser of --speculate / speculate=: "ngram" or "ngram:K" (K drafted tokens at most,
    1..15); None, "" or "off" -> None (plain decoding). ValueError with one line otherwise."""
    if value is None or isinstance(value, SpecConfig):
        return value
    if not isinstance(value, str):
        raise ValueError(f"speculate must be a string like 'ngram' or 'ngram:4', got {value!r}")
    text = value.strip().lower()
    if text in ("", "off", "none"):
        return None
    method, sep, k = text.partition(":")
    if method not in METHODS:
        raise ValueError(f"--speculate must be ngram or ngram:K (K in 1..{MAX_ROWS - 1}), got {value!r}")
    if not sep:
        return SpecConfig(method)
    if not k.isdigit() or not 1 <= int(k) <= MAX_ROWS - 1:
        raise ValueError(f"--speculate ngram:K needs an integer K in 1..{MAX_ROWS - 1}, got {value!r}")
    return SpecConfig(method, k_max=int(k))


def with_keywords(cfg: SpecConfig, text: str) -> SpecConfig:
    """cfg with the SpecConfig keywords of "KEY=VALUE,..." (integers, decimals or None) replaced: the tools'
    --config. ValueError (or TypeError for an unknown key) when the result is not a valid config."""
    kw: dict[str, int | float | None] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        kw[key.strip()] = None if value.strip() == "None" else float(value) if "." in value else int(value)
    return dataclasses.replace(cfg, **kw)


def check_greedy(spec: SpecConfig | None, temperature: float) -> None:
    """Speculation keeps greedy output exact; sampling would need the rejection rule: refused."""
    if spec is not None and temperature != 0:
        raise ValueError(f"--speculate supports greedy decoding only (temperature 0), got temperature {temperature:g}")


# ---------------------------------------------------------------------------------------- drafter
class NgramDrafter:
    """The sequence so far and, per n-gram length, where each n-gram last ended with a token after it.

    index[n][gram] = e: seq[e - n:e] == gram and e < len(seq), the largest such e. The current
    suffix (e == len(seq)) is indexed only once a token follows it, so a lookup finds an earlier
    occurrence; its continuation seq[e:e + k] may run into the suffix itself (a repeating pattern)."""

    def __init__(self, ids: Sequence[int], n_max: int = 3, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min
        self.seq: list[int] = []
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.extend(ids)

    def extend(self, ids: Sequence[int]) -> None:
        for t in ids:
            self.seq.append(int(t))
            end = len(self.seq) - 1  # the n-grams ending here now have a follower
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.index[n][tuple(self.seq[end - n : end])] = end

    def match(self) -> tuple[int, int]:
        """(n, e): the longest suffix length with an earlier occurrence and where that one ended;
        (0, -1) when none."""
        for n in range(min(self.n_max, len(self.seq)), self.n_min - 1, -1):
            e = self.index[n].get(tuple(self.seq[-n:]))
            if e is not None:
                return n, e
        return 0, -1

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching
        suffix; [] when no suffix of n_min..n_max tokens occurred before (or k < 1)."""
        if k < 1:
            return []
        n, e = self.match()
        return self.seq[e : e + k] if n else []


# ----------------------------------------------------------------------------------- adaptive k
class AdaptiveK:
    """How many tokens to draft now. k halves on a full miss (bound 1) and doubles on a full accept
    (bound k_max). Over the last `window` verify steps, fewer than min_accept accepted tokens per
    step pauses speculation for `pause` plain tokens (doubling while pauses repeat, up to
    max_pause_tokens); then it probes again with the k it had. Without a configured min_accept the
    threshold is where speculation stops paying on this backend, from the times the loop reports
    (observe_verify, observe_plain): a verify step yields accepted + 1 tokens for its time, a plain
    step one, so it pays while accepted > verify time / plain time - 1."""

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.k = cfg.k_max
        self.recent: deque[int] = deque(maxlen=cfg.window)  # accepted drafts per verify step
        self.pause = cfg.pause_tokens  # the next pause's length
        self.paused_left = 0  # plain tokens to go before speculating again
        self.pauses = 0
        self.verify_s, self.verifies = 0.0, 0
        self.plain_s, self.plains = 0.0, 0

    @property
    def paused(self) -> bool:
        return self.paused_left > 0

    def want(self) -> int:
        """Tokens to draft now (0 while paused)."""
        return 0 if self.paused else self.k

    def observe_verify(self, seconds: float) -> None:
        self.verify_s, self.verifies = self.verify_s + seconds, self.verifies + 1

    def observe_plain(self, seconds: float) -> None:
        self.plain_s, self.plains = self.plain_s + seconds, self.plains + 1

    @property
    def min_accept(self) -> float:
        """Accepted drafts per verify step below which speculation pauses (see the class)."""
        if self.cfg.min_accept is not None:
            return self.cfg.min_accept
        if not self.verifies or not self.plains or self.plain_s <= 0:
            return FALLBACK_MIN_ACCEPT
        return max(0.0, (self.verify_s / self.verifies) / (self.plain_s / self.plains) - 1.0)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed < 1:
            return
        if accepted == proposed:
            self.k = min(self.cfg.k_max, 2 * self.k)
        elif accepted == 0:
            self.k = max(1, self.k // 2)
        self.recent.append(accepted)
        if len(self.recent) == self.cfg.window:
            if sum(self.recent) < self.min_accept * self.cfg.window:
                self.paused_left, self.pauses = self.pause, self.pauses + 1
                self.pause = min(self.cfg.max_pause_tokens, 2 * self.pause)
                self.recent.clear()
            else:
                self.pause = self.cfg.pause_tokens  # paying: the next pause starts short again

    def plain_tokens(self) -> int:
        """Plain decode steps to run now: the rest of a pause, or a run of plain_run when no draft was found."""
        return self.paused_left if self.paused else self.cfg.plain_run

    def ran_plain(self, n: int) -> None:
        self.paused_left = max(0, self.paused_left - n)


# ------------------------------------------------------------------------------------ the loop
@dataclass
class SpecStats:
    """What one speculative generation did. verify_steps: chunks verified; drafted / accepted: draft
    tokens proposed / confirmed; plain_steps: single decode steps (no draft, or paused); verify_s:
    wall time inside the backend's verify calls; pauses: times speculation paused; overflowed_verifies:
    verifies dropped because an fp16 activation passed fp16's range (a plain step went on instead)."""

    config: str = ""
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0
    verify_s: float = 0.0
    pauses: int = 0
    overflowed_verifies: int = 0

    @classmethod
    def total(cls, runs: list[SpecStats]) -> SpecStats:
        """The counters of several runs (of one config) added up, so the rates below cover them all."""
        return cls(
            config=runs[0].config if runs else "",
            verify_steps=sum(r.verify_steps for r in runs),
            drafted=sum(r.drafted for r in runs),
            accepted=sum(r.accepted for r in runs),
            plain_steps=sum(r.plain_steps for r in runs),
            verify_s=sum(r.verify_s for r in runs),
            pauses=sum(r.pauses for r in runs),
            overflowed_verifies=sum(r.overflowed_verifies for r in runs),
        )

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """Tokens per forward pass (verify steps and plain steps), prefill's first token excluded."""
        steps = self.verify_steps + self.plain_steps
        return (self.accepted + self.verify_steps + self.plain_steps) / steps if steps else float("nan")

    @property
    def accepted_per_verify(self) -> float:
        """Tokens a verify step yields: accepted drafts + the model's own token."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else float("nan")

    @property
    def verify_ms(self) -> float:
        return 1e3 * self.verify_s / self.verify_steps if self.verify_steps else float("nan")


def greedy_rows(logits: np.ndarray, position: int) -> np.ndarray:
    """argmax of each row (the lowest index on ties, as sample_numpy); non-finite logits refused."""
    if not np.isfinite(logits).all():
        raise NonFiniteLogitsError(f"non-finite logits at position {position}", position)
    return np.argmax(logits, axis=-1)


def speculative_ids(
    backend, prompt_ids: np.ndarray, max_new_tokens: int, start: int, cfg: SpecConfig, stats: SpecStats
) -> Iterator[int]:
    """Greedy generation with n-gram drafts: the ids plain greedy generate_ids(prompt_ids, start=start)
    yields, in as few forward passes as the drafts allow. The backend provides spec_prefill (the
    prompt prefilled and its first greedy token, generate_ids' own; None when only the last id is new:
    the cache then holds all of the sequence but its last token), verify (ids appended, every row's
    greedy token, -1 for non-finite logits), steps (plain greedy decode steps, pipelined), rollback and hold (this run owns the
    cache; a later call on the backend ends it, as it ends a generate_ids run). While suspended,
    the cache holds the prompt and every yielded token but the last."""
    ids = np.asarray(prompt_ids, dtype=np.int32)
    n = len(ids)
    budget = generation_budget(n, max_new_tokens, backend.max_context)
    max_rows = min(MAX_ROWS, backend.verify_rows)
    stats.config = str(cfg)
    first = backend.spec_prefill(ids, start)  # the prompt's last row's greedy token, or None (only the last id is new)
    drafter = NgramDrafter(ids.tolist(), cfg.n_max, cfg.n_min)
    policy = AdaptiveK(cfg)
    yielded = 0
    last = int(ids[-1])
    run = backend.hold(n - 1)

    def owned() -> None:
        if backend.hold_of() is not run or backend.position != n - 1 + yielded:
            raise RuntimeError("this generation was ended by a later call on the same backend")

    try:
        if first is not None:
            last, yielded = int(first), 1
            drafter.extend([last])
            run = backend.hold(n - 1 + yielded)
            yield last
        while yielded < budget:
            owned()
            remaining = budget - yielded
            pos = n - 1 + yielded  # the cache holds the sequence but `last`
            k = min(policy.want(), remaining - 1, max_rows - 1)
            draft = drafter.propose(k) if k > 0 else []
            g = None
            if draft:
                t0 = time.perf_counter()
                g = backend.verify(np.asarray([last] + draft, dtype=np.int32))  # each row's greedy token
                dt = time.perf_counter() - t0
                if g is None:  # an fp16 activation overflowed: nothing appended, one plain step instead
                    stats.overflowed_verifies += 1
            if g is None:
                # Plain steps own the cache while they run (a later call ends them the same way).
                count = 1 if draft else min(remaining, policy.plain_tokens())
                with contextlib.closing(backend.steps(last, count)) as steps:
                    it = iter(steps)
                    while True:
                        t0 = time.perf_counter()
                        t = next(it, None)  # timed apart from the consumer's time between tokens
                        if t is None:
                            break
                        policy.observe_plain(time.perf_counter() - t0)
                        last = int(t)
                        drafter.extend([last])
                        yielded += 1
                        stats.plain_steps += 1
                        if not draft:
                            policy.ran_plain(1)
                        yield last
                if backend.position != n - 1 + yielded:
                    raise RuntimeError("this generation was ended by a later call on the same backend")
                run = backend.hold(n - 1 + yielded)
                continue
            stats.verify_s += dt
            policy.observe_verify(dt)
            if (g < 0).any():
                raise NonFiniteLogitsError(f"non-finite logits at position {pos}", pos)
            a = 0
            while a < len(draft) and draft[a] == int(g[a]):
                a += 1
            new = draft[:a] + [int(g[a])]
            backend.rollback(pos + a + 1)  # keep `last` and the accepted drafts; drop the rejected rows
            stats.verify_steps += 1
            stats.drafted += len(draft)
            stats.accepted += a
            pauses = policy.pauses
            policy.update(len(draft), a)
            stats.pauses += policy.pauses - pauses
            drafter.extend(new)
            for t in new:
                yielded += 1
                last = t
                run = backend.hold(n - 1 + yielded)  # closed now: the cache keeps the sequence but t
                yield t
                if backend.hold_of() is not run:
                    raise RuntimeError("this generation was ended by a later call on the same backend")
    finally:
        if backend.hold_of() is run:
            backend.rollback(n - 1 + yielded)
