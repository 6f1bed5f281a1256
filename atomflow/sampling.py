"""Sampling: the validated parameters, the CPU sampler that defines what the device sampler must do,
and the stop-string filter for streamed text."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import numpy as np

from atomflow.errors import NonFiniteLogitsError

SEED_LIMIT = 2**63


@dataclass(frozen=True)
class SamplingParams:
    """temperature: 0 = greedy, else logits / temperature.  top_k: keep the k highest logits
    (0 = off; ties with the k-th are kept).  top_p: then keep the fewest most-probable tokens
    whose mass reaches top_p (1 = off).  seed: with the position, keys the draw; None draws one
    from os.urandom at construction and stores it, so `params.seed` always replays the run.
    max_new_tokens: the most tokens generated.  stop: strings that end generation (the text is
    cut before them).  ignore_eos: keep going past EOS ids."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        def check(name, kind, ok, allowed):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, kind) or not ok(v):  # NaN fails every `ok`
                raise ValueError(f"{name} must be {allowed}, got {v!r}")
            return float(v) if kind is numbers.Real else int(v)

        t = check("temperature", numbers.Real, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0 (0 = greedy)")
        p = check("top_p", numbers.Real, lambda v: 0 < v <= 1, "in (0, 1]")
        k = check("top_k", numbers.Integral, lambda v: v >= 0, "an integer >= 0 (0 = off)")
        n = check("max_new_tokens", numbers.Integral, lambda v: v >= 1, "an integer >= 1")
        if self.seed is None:
            seed = int.from_bytes(os.urandom(8), "little") % SEED_LIMIT
        else:
            seed = check("seed", numbers.Integral, lambda v: 0 <= v < SEED_LIMIT, "an integer in [0, 2**63) or None")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for name, v in (
            ("temperature", t),
            ("top_p", p),
            ("top_k", k),
            ("max_new_tokens", n),
            ("seed", seed),
            ("stop", tuple(stop)),
            ("ignore_eos", bool(self.ignore_eos)),
        ):
            object.__setattr__(self, name, v)  # frozen: normalize once, here

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def uniform(seed: int, position: int) -> float:
    """The draw for one position, u in [0, 1): numpy's Generator(Philox(key=seed, counter=position))
    .random(). Spelled out for the device: Philox4x64-10 with key (seed, 0) on the counter
    (position + 1, 0, 0, 0); u = (first 64-bit output word >> 11) * 2**-53."""
    return float(np.random.Generator(np.random.Philox(key=seed, counter=position)).random())


def allowed_tokens(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Boolean mask [vocab] of the tokens a non-greedy draw may return."""
    return _filter(logits, params)[0]


def _filter(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(kept mask, z).  z = logits / T (float64).  top_k > 0: keep z >= the k-th largest z.  top_p < 1: p = softmax
    of the kept z; sort descending, n = the fewest tokens whose cumulative p >= top_p, keep
    p >= p of the n-th (ties at the cut are kept, like top-k's, so a threshold search works)."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1) / params.temperature
    keep = np.ones(z.shape, dtype=bool)
    if 0 < params.top_k < z.size:
        kth = np.partition(z, z.size - params.top_k)[z.size - params.top_k]
        keep = z >= kth
    if params.top_p < 1:
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        p /= p.sum()
        sorted_p = np.sort(p)[::-1]
        n = min(int(np.searchsorted(np.cumsum(sorted_p), params.top_p, side="left")), z.size - 1)
        keep &= p >= sorted_p[n]
    return keep, z


def sample_numpy(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """One token from fp32 logits [vocab]; the reference semantics of the device sampler.

    temperature 0: argmax, the lowest index on ties.  Otherwise the allowed set above, its
    probabilities renormalized, and the inverse CDF in token-index order: the smallest kept i with
    sum_{kept j <= i} w_j > u * sum_kept w, where w = exp(z - max z) and u = uniform(seed, position).
    Logits with NaN or Inf are refused (NonFiniteLogitsError), never sampled."""
    if not np.isfinite(logits).all():
        raise NonFiniteLogitsError(f"non-finite logits at position {position}", position)
    if params.temperature == 0:
        return int(np.argmax(logits))
    keep, z = _filter(logits, params)
    w = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    cdf = np.cumsum(w)
    i = int(np.searchsorted(cdf, uniform(params.seed, position) * cdf[-1], side="right"))
    return min(i, z.size - 1)


class StopChecker:
    """Cuts streamed text at the first stop string.

    feed(piece) -> (text safe to emit, stopped). Text that could be the start of a stop string
    is held back until the next piece decides it; once a stop string completes, everything before
    its start is emitted, stopped is True, and later feeds return ("", True). flush() at the end
    returns what is still held (it was not a stop string after all)."""

    def __init__(self, stop_strings=()):
        self.stops = tuple(s for s in stop_strings if s)
        self.held = ""
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self.held + piece
        if not self.stops:
            self.held = ""
            return text, False
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held, self.stopped = "", True
            return text[: min(hits)], True
        hold = self._partial_len(text)
        self.held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        text, self.held = ("" if self.stopped else self.held), ""
        return text

    def _partial_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        for n in range(min(len(text), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
