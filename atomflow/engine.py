"""Engine: the Python facade. Loads a .atomflow file, picks a backend, tokenizes, and streams.

eng = Engine.load("model.atomflow", max_context=8192)
for text in eng.generate("Hello", SamplingParams(temperature=0.7, max_new_tokens=64)):
    print(text, end="", flush=True)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from atomflow.backends import make_backend
from atomflow.errors import FormatError, NonFiniteLogitsError
from atomflow.model.fileformat import AtomflowFile
from atomflow.model.tokenizer import IncrementalDecoder, Tokenizer
from atomflow.sampling import SamplingParams, StopChecker
from atomflow.speculate import SpecConfig, SpecStats, check_greedy, parse_speculate, speculative_ids
from atomflow.tokens import check_ids, generation_budget

DEFAULT_MAX_CONTEXT = 8192


@dataclass
class GenerationStats:
    """Timings of the last generate call, in the llama.cpp summary's terms."""

    load_s: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens already in the cache (reuse_prefix), not prefilled again
    prompt_s: float = 0.0  # prefill + the first sampled token (time to first token)
    generated_tokens: int = 0
    decode_s: float = 0.0  # every token after the first
    stop_reason: str = ""  # eos | stop | length | context
    speculation: SpecStats | None = None  # what speculative decoding did (None: plain decoding)

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens this call ran through the model (prompt_tokens - reused_tokens)."""
        return self.prompt_tokens - self.reused_tokens

    @property
    def ms_per_token(self) -> float:
        n = self.generated_tokens - 1
        return 1e3 * self.decode_s / n if n > 0 else float("nan")


class Engine:
    def __init__(self, model: AtomflowFile, backend, tokenizer: Tokenizer, load_s: float, speculate: SpecConfig | None = None):
        self.model, self.backend, self.tokenizer = model, backend, tokenizer
        self.speculate = speculate  # the default of generate_tokens(speculate=...)
        self.spec = model.spec
        self.stats = GenerationStats(load_s=load_s)
        self._cached: list[int] = []  # the token ids the cache holds, in order (len == position)
        self._run: object | None = None  # the generate_tokens() run whose tokens the cache holds

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        backend: str = "auto",
        max_context: int | None = None,
        eager: bool | None = None,
        verify: bool = False,
        verbose: bool = False,
        speculate: str | SpecConfig | None = None,
        prefill_recipe: str = "w8a16",
        plan: dict[str, bool] | None = None,
    ) -> Engine:
        """backend: auto (cuda when usable, else cpu) | cuda | cpu. max_context: KV cache length
        (default min(8192, the model's max_position_embeddings)). eager: run CUDA without the
        graph (default: the ATOMFLOW_EAGER environment variable). speculate: "ngram" or "ngram:K"
        (atomflow/speculate.py), greedy only: generation drafts from n-grams of the sequence and
        verifies K at a time; a verify chunk's rows run the decode step's activations (fp16 with its
        overflow flag, or bf16 after an overflow), so they equal decode steps bit for bit and the output
        equals plain greedy decoding's on the same engine.
        prefill_recipe: "w8a16" (default) or "w8a8": prompt chunks of 256+ rows quantize their activations
        to FP8 per token per 128 columns (FP8 tensor cores, ~1.2x the products' speed; other bits, its
        quality in docs/design/gemm_w8a8_sm90.md); the CPU backend emulates it.
        plan: step plan options of the CUDA backend (atomflow/backends/cuda.py PLAN_OPTIONS), for A/B runs."""
        t0 = time.perf_counter()
        spec = parse_speculate(speculate)
        model = AtomflowFile(path, verify=verify)
        limit = model.spec.max_context_limit  # max_position_embeddings, or a smaller sliding window
        if max_context is None:
            max_context = min(DEFAULT_MAX_CONTEXT, limit)
        if not isinstance(max_context, int) or not 1 <= max_context <= limit:
            what = (
                "the model's sliding_window: beyond it full attention is not the model's attention"
                if limit < model.spec.max_position_embeddings
                else "the model's max_position_embeddings"
            )
            raise ValueError(f"max_context must be an integer in [1, {limit}] ({what}), got {max_context!r}")
        tok = model.tokenizer()  # checked before the (slow) backend load: parses, fits the vocab, template renders
        be = make_backend(
            backend, model, max_context, eager=eager, verbose=verbose, prefill_recipe=prefill_recipe, **(plan or {})
        )
        return cls(model, be, tok, time.perf_counter() - t0, speculate=spec)

    # -- low level: logits ---------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def max_context(self) -> int:
        return self.backend.max_context

    @property
    def position(self) -> int:
        return self.backend.position

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Appends token ids to the cache; fp32 logits [vocab] of the last one."""
        ids = self._check_ids(ids, room=0)
        self._run = None
        self._cached = self.cached_ids  # what the cache held before (or [] if unknown)
        logits = self.backend.prefill(ids)
        self._cached += ids.tolist()
        return self._finite(logits, self.position)

    def decode(self, token: int) -> np.ndarray:
        """Appends one token; its fp32 logits [vocab]."""
        self._check_ids([token], room=0)
        self._run = None
        self._cached = self.cached_ids
        logits = self.backend.decode(int(token))
        self._cached.append(int(token))
        return self._finite(logits, self.position)

    def _finite(self, logits: np.ndarray, position: int) -> np.ndarray:
        if not np.isfinite(logits).all():
            raise self._nonfinite(position)
        return logits

    def _nonfinite(self, position: int) -> FormatError:
        """Non-finite logits are the file's fault (a valid file cannot produce them): said so, never sampled."""
        return FormatError(
            f"{self.model.path}: the file's weights produce NaN/Inf (logits after position "
            f"{position}); `atomflow info --verify` checks every value"
        )

    def reset(self) -> None:
        self.backend.reset()
        self._run = None
        self._cached = []

    @property
    def cached_ids(self) -> list[int]:
        """The token ids the KV cache holds (positions 0 .. position-1), as far as this facade has
        seen them fill it; [] when the backend was driven around the facade (the lengths disagree)."""
        return list(self._cached) if len(self._cached) == self.backend.position else []

    def common_prefix(self, ids: Sequence[int]) -> int:
        """How many leading ids the cache already holds: what generate_tokens(reuse_prefix=True)
        skips, except that at least the last prompt token always runs."""
        cached = self.cached_ids
        n = min(len(cached), len(ids))
        if n == 0:
            return 0
        diff = np.flatnonzero(np.asarray(cached[:n], dtype=np.int64) != np.asarray(ids[:n], dtype=np.int64))
        return int(diff[0]) if diff.size else n

    # -- generation ----------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool | None = None) -> np.ndarray:
        """Text -> ids (through the chat template when the model has one, unless chat=False)."""
        if isinstance(prompt, str):
            if chat is None:
                chat = self.tokenizer.has_chat_template
            return np.asarray(self.tokenizer.encode_prompt(prompt, chat=chat), dtype=np.int32)
        return np.asarray(prompt, dtype=np.int32)

    def generate_tokens(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        chat: bool | None = None,
        reuse_prefix: bool = False,
        speculate: str | SpecConfig | None = "default",
    ) -> Iterator[int]:
        """Yields sampled token ids; stops at an EOS id (not yielded; unless ignore_eos), at
        max_new_tokens, or when the context is full. Starts a fresh conversation, unless
        reuse_prefix: then the longest common prefix of the prompt and the ids the cache holds
        (cached_ids) stays, and only the rest is prefilled (llama-server's cache_prompt); at least
        the last prompt token runs. stats.reused_tokens says how many were kept. speculate: the
        engine's setting (Engine.load(speculate=...)) by default, "off" for plain decoding, or
        another "ngram[:K]"."""
        params = params or SamplingParams()
        spec = self.speculate if speculate == "default" else parse_speculate(speculate)
        check_greedy(spec, params.temperature)
        if spec is not None and not self.backend.exact_verify:
            raise ValueError("speculation on this backend would not reproduce plain greedy decoding (its verify is not exact)")
        ids = self._check_ids(self.encode(prompt, chat), room=1)
        start = min(self.common_prefix(ids), len(ids) - 1) if reuse_prefix else 0
        stats = self.stats = GenerationStats(load_s=self.stats.load_s, prompt_tokens=len(ids), reused_tokens=start)
        eos = set() if params.ignore_eos else self.tokenizer.eos_token_ids
        budget = generation_budget(len(ids), params.max_new_tokens, self.max_context)
        stats.stop_reason = "length" if budget == params.max_new_tokens else "context"
        self._cached = self._cached[:start]
        run = self._run = object()
        if spec is None:
            gen = self.backend.generate_ids(ids, params, start=start)
        else:
            stats.speculation = SpecStats()
            gen = speculative_ids(self.backend, ids, params.max_new_tokens, start, spec, stats.speculation)
        sampled: list[int] = []  # every id the backend yielded (an EOS too): the cache keeps all but the last
        t0 = t_first = time.perf_counter()
        try:
            for token in _reraise_nonfinite(gen, self):
                sampled.append(token)
                now = time.perf_counter()
                if stats.generated_tokens == 0:
                    stats.prompt_s, t_first = now - t0, now
                stats.generated_tokens += 1
                stats.decode_s = now - t_first
                if token in eos:
                    stats.stop_reason = "eos"
                    return
                yield token
                if stats.generated_tokens >= budget:
                    return
        finally:
            gen.close()
            if self._run is run:  # not when a later call has filled the cache since
                self._cached = (ids.tolist() + sampled)[: self.backend.position]  # prompt + sampled but the last

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        chat: bool | None = None,
        speculate: str | SpecConfig | None = "default",
    ) -> Iterator[str]:
        """Streams text: incremental, UTF-8 safe, cut at the first stop string."""
        params = params or SamplingParams()
        decoder, stopper = IncrementalDecoder(self.tokenizer), StopChecker(params.stop)
        tokens = self.generate_tokens(prompt, params, chat, speculate=speculate)
        try:
            for token in tokens:
                text, stopped = stopper.feed(decoder.feed(token))
                if text:
                    yield text
                if stopped:
                    self.stats.stop_reason = "stop"
                    return
            text, _ = stopper.feed(decoder.flush())
            text += stopper.flush()
            if text:
                yield text
        finally:
            tokens.close()

    def _check_ids(self, ids, room: int) -> np.ndarray:
        """ids as int32, each in [0, vocab), with `room` free cache slots left after them."""
        ids = check_ids(ids, self.spec.vocab_size)
        if room and len(ids) + room > self.max_context:
            raise ValueError(
                f"prompt has {len(ids)} tokens; it does not fit max_context {self.max_context} "
                f"(leave room for at least {room} generated token)"
            )
        if not room and self.position + len(ids) > self.max_context:
            raise ValueError(f"{len(ids)} tokens at position {self.position} do not fit max_context {self.max_context}")
        return ids


def _reraise_nonfinite(gen: Iterator[int], engine: Engine) -> Iterator[int]:
    """The backend's sampler refuses non-finite logits (NonFiniteLogitsError): said as the file's fault.
    The CPU backend samples through sampling.sample_numpy, which checks; the CUDA backend samples
    on the device and does not (see docs/FORMAT.md)."""
    try:
        yield from gen
    except NonFiniteLogitsError as e:
        raise engine._nonfinite(engine.position if e.position is None else e.position) from None
