"""The sandbox (docs/SANDBOX.md): paged KV attention, a block manager and iteration-level batching,
built from the same kernels as the engine in a second extension, atomflow._sandbox, that never
links the core. This module is the thin Python side:

    ext()                  the extension (BlockManager needs no GPU; everything else does)
    SandboxModel.load(..)  a .atomflow file's FP8 weights + a paged KV pool on the GPU
    FakeModel(..)          a CPU stand-in with the same step() contract (tests, dry runs)

The scheduler is in scheduler.py, the benchmark drivers in bench.py, the self-test in
selftest.py, the `atomflow sandbox ...` subcommands in cli.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from atomflow.backends.cuda import options_from_env
from atomflow.errors import BackendUnavailableError, UnsupportedModelError

# The paged attention is built for these (csrc/kernels/attention_decode.cu); the core engine runs more.
SANDBOX_HEAD_DIMS = (64, 128)


def ext():
    """atomflow._sandbox, or BackendUnavailableError saying why it is missing."""
    try:
        from atomflow import _sandbox  # type: ignore[attr-defined]
    except ImportError as e:
        raise BackendUnavailableError(f"the sandbox extension was not built ({e}); reinstall with nvcc on the PATH") from None
    return _sandbox


def cuda_status() -> tuple[bool, str]:
    try:
        return tuple(ext().cuda_available())  # type: ignore[return-value]
    except BackendUnavailableError as e:
        return False, str(e)


def BlockManager(num_blocks: int, block_size: int, prefix_caching: bool = True):
    """The C++ block manager (csrc/sandbox/block_manager.h); works without a GPU."""
    return ext().BlockManager(num_blocks, block_size, prefix_caching)


def OutOfBlocks() -> type:
    return ext().OutOfBlocks


# ---------------------------------------------------------------------------------------
class SandboxModel:
    """A .atomflow model on the GPU for batched decode over a paged KV pool (greedy).

    step(tokens, positions, slots, n_decode, decode_tables, decode_lens, prefill_table,
         prefill_len, logit_rows, want_logits=False) -> next tokens [len(logit_rows)]
    runs one scheduler iteration: rows [0, n_decode) are one decode token per sequence, the
    remaining rows one prefill chunk of one sequence (see csrc/sandbox/paged_model.h)."""

    def __init__(
        self, impl, spec, num_blocks: int, block_size: int, max_rows: int, max_seqs: int, max_blocks_per_seq: int, path: Path
    ):
        self.impl, self.spec, self.path = impl, spec, path
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_rows, self.max_seqs, self.max_blocks_per_seq = max_rows, max_seqs, max_blocks_per_seq
        self.vocab_size = spec.vocab_size

    @classmethod
    def load(
        cls,
        path,
        block_size: int = 16,
        max_batch: int = 64,
        prefill_chunk: int = 256,
        max_context: int = 4096,
        num_blocks: int | None = None,
    ) -> SandboxModel:
        """Uploads every tensor into its own device buffer and makes a pool of num_blocks KV blocks
        (default: max_batch * max_context tokens' worth, the contiguous-equivalent)."""
        from atomflow.model.fileformat import AtomflowFile

        ok, why = cuda_status()
        if not ok:
            raise BackendUnavailableError(f"the sandbox model needs a GPU: {why}")
        model = AtomflowFile(path)
        spec = model.spec
        if spec.cuda_unsupported():
            raise UnsupportedModelError(f"{path}: {spec.cuda_unsupported()}")
        if spec.head_dim not in SANDBOX_HEAD_DIMS:
            raise UnsupportedModelError(
                f"{path}: the sandbox's paged attention runs head_dim {', '.join(map(str, SANDBOX_HEAD_DIMS))} only "
                f"(this model's is {spec.head_dim})"
            )
        if spec.attention_bias or spec.qk_norm:  # PagedModel is Llama's forward pass (csrc/sandbox/paged_model.h)
            raise UnsupportedModelError(
                f"{path}: the sandbox runs Llama and Mistral models only, not {spec.arch} "
                "(QKV bias or per-head q/k RMSNorm); the core engine runs it"
            )
        if model.quantization.get("lm_head", "fp8") != "fp8":
            raise UnsupportedModelError(
                f"{path}: the sandbox runs files with an fp8 lm_head only "
                f"(this one is {model.quantization.get('lm_head')}); re-quantize with --lm-head fp8"
            )
        max_blocks = math.ceil(max_context / block_size)
        num_blocks = num_blocks or max_batch * max_blocks
        f16 = options_from_env()["f16_activations"]  # ATOMFLOW_BF16_ACTS, read where the core engine's is
        impl = ext().PagedModel(
            spec.to_dict(), num_blocks, block_size, max_batch + prefill_chunk, max_batch, max_blocks, f16_activations=f16
        )
        for t in model.tensor_table():
            impl.upload(t["name"], model.array(t["name"]).view(np.uint8))
        impl.upload_inv_freq(spec.rope_inv_freq())
        model.close()
        return cls(impl, spec, num_blocks, block_size, max_batch + prefill_chunk, max_batch, max_blocks, Path(path))

    def step(self, *args, **kwargs):
        return self.impl.step(*args, **kwargs)

    def copy_blocks(self, copies) -> None:
        if len(copies):
            self.impl.copy_blocks(np.asarray(copies, dtype=np.int32).reshape(-1, 2))

    def clear(self) -> None:
        self.impl.clear_pool()

    @property
    def last_step_ms(self) -> float:
        return self.impl.last_step_ms

    @property
    def pool_bytes(self) -> int:
        return self.impl.pool_bytes

    @property
    def block_bytes(self) -> int:
        return self.impl.block_bytes


# ---------------------------------------------------------------------------------------
_MASK = (1 << 64) - 1
_ROOT = 0x243F6A8885A308D3


def _chain(h: int, token: int) -> int:
    """splitmix64 of (h, token): the fake KV of a token is a hash of the whole prefix ending there."""
    x = (h ^ (token * 0x9E3779B97F4A7C15)) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class FakeModel:
    """CPU stand-in for SandboxModel with the same step() contract. Each KV slot holds a hash of
    the token prefix ending at it (real KV depends on the whole prefix too), read back through the
    block table exactly as attention would; the next token is a function of that hash. A wrong
    slot, table, missed copy-on-write copy or a bad prefix hit changes the tokens (or reads an
    unwritten slot and raises), so "batched == single-stream" tests the scheduler and the block
    manager end to end without a GPU."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int = 1000,
        max_batch: int = 64,
        prefill_chunk: int = 256,
        max_context: int = 4096,
        strict: bool = True,
    ):
        self.num_blocks, self.block_size, self.vocab_size = num_blocks, block_size, vocab_size
        self.strict = strict  # False: an unwritten slot reads as the empty prefix (synthetic-KV benchmarks)
        self.max_seqs, self.max_rows = max_batch, max_batch + prefill_chunk
        self.max_blocks_per_seq = math.ceil(max_context / block_size)
        self.pool: dict[int, int] = {}
        self.last_step_ms = 0.0
        self.steps = 0

    @staticmethod
    def reference(prompt, n: int, vocab_size: int = 1000) -> list[int]:
        """Single-stream greedy generation: what every batched run must reproduce."""
        h = _ROOT
        for t in prompt:
            h = _chain(h, int(t))
        out = []
        for _ in range(n):
            t = h % vocab_size
            out.append(t)
            h = _chain(h, t)
        return out

    def _read(self, table, p: int) -> int:
        if p < 0:
            return _ROOT
        slot = int(table[p // self.block_size]) * self.block_size + p % self.block_size
        if slot not in self.pool:
            if not self.strict:
                return _ROOT
            raise RuntimeError(f"FakeModel: read of unwritten KV slot {slot} (position {p})")
        return self.pool[slot]

    def step(
        self,
        tokens,
        positions,
        slots,
        n_decode,
        decode_tables=None,
        decode_lens=None,
        prefill_table=None,
        prefill_len=0,
        logit_rows=(),
        want_logits=False,
    ):
        self.steps += 1
        row_hash = []
        for r in range(len(tokens)):
            table = decode_tables[r] if r < n_decode else prefill_table
            p = int(positions[r])
            if r < n_decode and int(decode_lens[r]) != p + 1:
                raise RuntimeError(f"FakeModel: decode row {r} at position {p} with len {decode_lens[r]}")
            if r >= n_decode and p >= prefill_len:
                raise RuntimeError(f"FakeModel: prefill row {r} at position {p} past prefill_len {prefill_len}")
            want = int(table[p // self.block_size]) * self.block_size + p % self.block_size
            if int(slots[r]) != want:
                raise RuntimeError(f"FakeModel: row {r} writes slot {slots[r]}, its table says {want}")
            h = _chain(self._read(table, p - 1), int(tokens[r]))
            self.pool[want] = h
            row_hash.append(h)
        out = np.array([row_hash[int(r)] % self.vocab_size for r in logit_rows], dtype=np.int32)
        return (out, None) if want_logits else out

    def copy_blocks(self, copies) -> None:
        for src, dst in copies:
            for o in range(self.block_size):
                s, d = int(src) * self.block_size + o, int(dst) * self.block_size + o
                if s in self.pool:
                    self.pool[d] = self.pool[s]
                else:
                    self.pool.pop(d, None)

    def clear(self) -> None:
        self.pool.clear()
