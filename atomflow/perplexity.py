"""`atomflow perplexity`: quality on real text, by llama.cpp's llama-perplexity method.

The text is tokenized once (no chat template). Windows of `ctx` tokens start every `stride`
tokens (default stride = ctx: llama-perplexity's disjoint chunks); each window is run from an
empty cache, and the tokens of its second half that no earlier window scored are scored: the
negative log-likelihood of each given everything before it in the window. So every scored token
sees at least ctx/2 tokens of context. When the tokenizer adds BOS, a window's first token is
replaced by BOS, as llama-perplexity does.

    ppl = exp(mean NLL)       stderr = ppl * std(NLL) / sqrt(n)   (the delta method, as llama.cpp)

The same windows can be scored by Hugging Face transformers on the source weights (an HF
directory or a GGUF file, fp32, CPU), so the ratio isolates what quantization costs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass
class PerplexityResult:
    who: str
    ppl: float
    stderr: float
    mean_nll: float
    scored_tokens: int
    evaluated_tokens: int  # tokens run through the model (windows overlap when stride < ctx)
    windows: int
    ctx: int
    stride: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.evaluated_tokens / self.seconds if self.seconds > 0 else float("nan")

    def line(self) -> str:
        return (
            f"{self.who}: ppl {self.ppl:.4f} +- {self.stderr:.4f} over {self.scored_tokens} tokens "
            f"({self.windows} windows of {self.ctx}, stride {self.stride}; {self.tokens_per_second:.1f} tokens/s)"
        )

    def to_dict(self) -> dict:
        return dict(asdict(self), tokens_per_second=self.tokens_per_second)


def windows(n_tokens: int, ctx: int, stride: int | None = None, max_windows: int | None = None) -> list[tuple[int, int]]:
    """[(window start, first scored position within the window)], by the rule in the module docstring."""
    stride = stride or ctx
    if ctx < 2 or ctx % 2:
        raise ValueError(f"--ctx must be an even number >= 2, got {ctx}")
    if not 1 <= stride <= ctx // 2 and stride != ctx:
        raise ValueError(f"--stride must be ctx or in [1, ctx/2] (every token scored once), got {stride}")
    if n_tokens < ctx:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than one window of --ctx {ctx}")
    out, scored_to = [], 0
    for start in range(0, n_tokens - ctx + 1, stride):
        first = max(ctx // 2, scored_to - start)
        if first < ctx:
            out.append((start, first))
            scored_to = start + ctx
        if max_windows and len(out) >= max_windows:
            break
    return out


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=-1))
    return lse - x[np.arange(len(targets)), targets]


def score(
    who: str,
    tokens: np.ndarray,
    ctx: int,
    stride: int | None,
    logits_fn: Callable[[np.ndarray, int], np.ndarray],
    bos: int | None = None,
    max_windows: int | None = None,
    progress: bool = False,
) -> PerplexityResult:
    """logits_fn(window_ids, first) -> fp32 logits [ctx - first, vocab] of positions first-1 .. ctx-2
    (each predicts the next token)."""
    wins = windows(len(tokens), ctx, stride, max_windows)
    nll = []
    t0 = time.perf_counter()
    from tqdm import tqdm

    for start, first in tqdm(wins, desc=who, disable=not progress, leave=False):
        ids = np.array(tokens[start : start + ctx], dtype=np.int64)
        if bos is not None:
            ids[0] = bos
        logits = logits_fn(ids, first)
        nll.append(_nll(logits, ids[first:]))
    seconds = time.perf_counter() - t0
    nll = np.concatenate(nll)
    mean = float(nll.mean())
    ppl = math.exp(mean)
    stderr = ppl * float(nll.std()) / math.sqrt(len(nll))
    return PerplexityResult(who, ppl, stderr, mean, len(nll), len(wins) * ctx, len(wins), ctx, stride or ctx, seconds)


def engine_logits_fn(engine) -> Callable[[np.ndarray, int], np.ndarray]:
    """The engine's backend: all logits of one prefill where it can (CPU), else a prefill of the
    first half and a decode step per scored token (the backend contract: any backend)."""
    backend = engine.backend

    def fn(ids: np.ndarray, first: int) -> np.ndarray:
        backend.reset()
        ref = getattr(backend, "ref", None)
        if ref is not None:  # the numpy reference: every position's logits from one pass
            return ref.forward(ids, all_logits=True)[first - 1 : -1]
        out = [backend.prefill(ids[:first].astype(np.int32))]
        out += [backend.decode(int(t)) for t in ids[first:-1]]
        return np.stack(out)

    return fn


def hf_logits_fn(source: str | Path) -> tuple[Callable[[np.ndarray, int], np.ndarray], str]:
    """transformers (fp32, CPU) on the source weights: an HF directory or a .gguf file."""
    import torch
    from transformers import AutoModelForCausalLM

    source = Path(source)
    if source.suffix.lower() == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.eval()

    def fn(ids: np.ndarray, first: int) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor(ids[None]), use_cache=False).logits[0, first - 1 : -1].float().numpy()

    return fn, f"transformers {source.name}"


def read_text(paths: list[str]) -> str:
    """Files joined by blank lines."""
    parts = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"no such text file: {p}")
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n\n".join(parts)
