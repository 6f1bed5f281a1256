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
from atomflow.model.fileformat import AtomflowFile
from atomflow.model.tokenizer import IncrementalDecoder, Tokenizer
from atomflow.sampling import SamplingParams, StopChecker

DEFAULT_MAX_CONTEXT = 8192


@dataclass
class GenerationStats:
    """Timings of the last generate call, in the llama.cpp summary's terms."""
    load_s: float = 0.0
    prompt_tokens: int = 0
    prompt_s: float = 0.0      # prefill + the first sampled token (time to first token)
    generated_tokens: int = 0
    decode_s: float = 0.0      # every token after the first
    stop_reason: str = ""      # eos | stop | length | context

    @property
    def ms_per_token(self) -> float:
        n = self.generated_tokens - 1
        return 1e3 * self.decode_s / n if n > 0 else float("nan")


class Engine:
    def __init__(self, model: AtomflowFile, backend, tokenizer: Tokenizer, load_s: float):
        self.model, self.backend, self.tokenizer = model, backend, tokenizer
        self.spec = model.spec
        self.stats = GenerationStats(load_s=load_s)

    @classmethod
    def load(cls, path: str | os.PathLike, backend: str = "auto", max_context: int | None = None,
             eager: bool | None = None, verify: bool = False, verbose: bool = False) -> Engine:
        """backend: auto (cuda when usable, else cpu) | cuda | cpu. max_context: KV cache length
        (default min(8192, the model's max_position_embeddings)). eager: run CUDA without the
        graph (default: the ATOMFLOW_EAGER environment variable)."""
        t0 = time.perf_counter()
        model = AtomflowFile(path, verify=verify)
        limit = model.spec.max_context_limit  # max_position_embeddings, or a smaller sliding window
        if max_context is None:
            max_context = min(DEFAULT_MAX_CONTEXT, limit)
        if not isinstance(max_context, int) or not 1 <= max_context <= limit:
            what = ("the model's sliding_window: beyond it full attention is not the model's attention"
                    if limit < model.spec.max_position_embeddings else "the model's max_position_embeddings")
            raise ValueError(f"max_context must be an integer in [1, {limit}] ({what}), got {max_context!r}")
        be = make_backend(backend, model, max_context, eager=eager, verbose=verbose)
        tok = Tokenizer.from_metadata(model.raw_metadata["tokenizer"], model.metadata_json("tokenizer_config", {}),
                                      model.raw_metadata.get("chat_template", ""),
                                      model.metadata_json("generation_config", {}))
        return cls(model, be, tok, time.perf_counter() - t0)

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
        return self.backend.prefill(self._check_ids(ids, room=0))

    def decode(self, token: int) -> np.ndarray:
        """Appends one token; its fp32 logits [vocab]."""
        self._check_ids([token], room=0)
        return self.backend.decode(int(token))

    def reset(self) -> None:
        self.backend.reset()

    # -- generation ----------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool | None = None) -> np.ndarray:
        """Text -> ids (through the chat template when the model has one, unless chat=False)."""
        if isinstance(prompt, str):
            if chat is None:
                chat = self.tokenizer.has_chat_template
            return np.asarray(self.tokenizer.encode_prompt(prompt, chat=chat), dtype=np.int32)
        return np.asarray(prompt, dtype=np.int32)

    def generate_tokens(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                        chat: bool | None = None) -> Iterator[int]:
        """Yields sampled token ids; stops at an EOS id (not yielded; unless ignore_eos), at
        max_new_tokens, or when the context is full. Starts a fresh conversation."""
        params = params or SamplingParams()
        ids = self._check_ids(self.encode(prompt, chat), room=1)
        stats = self.stats = GenerationStats(load_s=self.stats.load_s, prompt_tokens=len(ids))
        eos = set() if params.ignore_eos else self.tokenizer.eos_token_ids
        budget = min(params.max_new_tokens, self.max_context - len(ids) + 1)
        stats.stop_reason = "length" if budget == params.max_new_tokens else "context"
        gen = self.backend.generate_ids(ids, params)
        t0 = t_first = time.perf_counter()
        try:
            for token in gen:
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

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 chat: bool | None = None) -> Iterator[str]:
        """Streams text: incremental, UTF-8 safe, cut at the first stop string."""
        params = params or SamplingParams()
        decoder, stopper = IncrementalDecoder(self.tokenizer), StopChecker(params.stop)
        tokens = self.generate_tokens(prompt, params, chat)
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
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("empty prompt: nothing to run")
        vocab = self.spec.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise ValueError(f"token id {bad} out of range [0, {vocab})")
        if room and len(ids) + room > self.max_context:
            raise ValueError(f"prompt has {len(ids)} tokens; it does not fit max_context {self.max_context} "
                             f"(leave room for at least {room} generated token)")
        if not room and self.position + len(ids) > self.max_context:
            raise ValueError(f"{len(ids)} tokens at position {self.position} do not fit max_context {self.max_context}")
        return ids.astype(np.int32)
