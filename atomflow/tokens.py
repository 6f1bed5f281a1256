"""Token ids and the generation budget: checked and computed here once, for the facade and both
backends (the bindings check again, as a binding checks every argument)."""

from __future__ import annotations

import numpy as np


def check_ids(ids, vocab_size: int) -> np.ndarray:
    """Any integer sequence -> 1-D int32 ids, each in [0, vocab_size). ValueError names the problem."""
    a = np.asarray(ids)
    if a.dtype == object or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"token ids must be integers, got dtype {a.dtype}")
    a = a.reshape(-1)
    if a.size == 0:
        raise ValueError("empty prompt: nothing to run")
    bad = (a < 0) | (a >= vocab_size)
    if bad.any():
        raise ValueError(f"token id {int(a[bad][0])} out of range [0, {vocab_size})")
    return a.astype(np.int32)


def generation_budget(n_prompt: int, max_new_tokens: int, max_context: int) -> int:
    """Tokens a generation may yield: decode steps run at positions n_prompt - 1 .. max_context - 1
    (the last prompt token is the first step's input), so at most max_context - n_prompt + 1."""
    return min(int(max_new_tokens), max_context - n_prompt + 1)
