"""Iteration-level (continuous) batching over the paged KV pool, as in Orca / vLLM, small.

Every step() is one forward pass over: one decode token of each running sequence, plus at most
one prefill chunk of the sequence being admitted (chunked prefill rides along with decode, so a
long prompt never stalls the running batch for more than one chunk). Sequences join between
steps when the block manager can hold their prompt, and leave as soon as they finish; their
blocks go back to the pool (full ones stay findable by the prefix cache until evicted).

When a decode step would need more blocks than the pool has, the latest admitted sequences are
preempted (their blocks freed, the request re-queued at the front to be recomputed from its
prompt plus what it generated so far): the block manager decides who (preemption_victims).

Greedy decoding only; `model` is a SandboxModel (GPU) or a FakeModel (CPU, same contract).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from atomflow.sandbox.model import ext


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    cursor: int = 0  # tokens of `pending` whose KV is in the cache
    pending: list[int] = field(default_factory=list)  # what the next admission prefills
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (last admission)
    t_add: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass
class StepReport:
    n_decode: int
    n_prefill: int
    tokens: list[tuple[int, int]]  # (rid, token) produced this step
    device_ms: float
    wall_ms: float
    preempted: list[int]


class Scheduler:
    def __init__(
        self,
        model,
        block_size: int | None = None,
        max_batch: int | None = None,
        prefill_chunk: int = 256,
        prefix_caching: bool = True,
        eos_ids=(),
        watermark: bool = True,
    ):
        self.model = model
        self.block_size = block_size or model.block_size
        if self.block_size != model.block_size:
            raise ValueError(f"block_size {self.block_size} differs from the model pool's {model.block_size}")
        self.max_batch = min(max_batch or model.max_seqs, model.max_seqs)
        self.prefill_chunk = min(prefill_chunk, model.max_rows - self.max_batch)
        if self.prefill_chunk < 1:
            raise ValueError("the model's max_rows leaves no room for a prefill chunk")
        self.bm = ext().BlockManager(model.num_blocks, self.block_size, prefix_caching)
        self.eos = set(int(t) for t in eos_ids)
        self.watermark = watermark
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # decode phase, admission order (= priority)
        self.prefilling: Request | None = None
        self.finished: dict[int, Request] = {}
        self._next_rid = 0
        self.steps = 0

    # -- requests ------------------------------------------------------------------------
    def add(self, prompt, max_new_tokens: int) -> int:
        prompt = [int(t) for t in prompt]
        if not prompt or max_new_tokens < 1:
            raise ValueError("a request needs a non-empty prompt and max_new_tokens >= 1")
        need = -(-(len(prompt) + max_new_tokens) // self.block_size)
        if need > self.model.num_blocks or need > self.model.max_blocks_per_seq:
            raise ValueError(
                f"a request of {len(prompt)} + {max_new_tokens} tokens needs {need} blocks; the pool has "
                f"{self.model.num_blocks}, a table at most {self.model.max_blocks_per_seq}"
            )
        r = Request(self._next_rid, prompt, max_new_tokens, pending=list(prompt), t_add=time.perf_counter())
        self._next_rid += 1
        self.waiting.append(r)
        return r.rid

    def fork(self, rid: int) -> int:
        """A copy of running request `rid` sharing all its blocks (copy-on-write from here on)."""
        parent = next((r for r in self.running if r.rid == rid), None)
        if parent is None:
            raise ValueError(f"request {rid} is not running (only decode-phase requests fork)")
        if len(self.running) + (self.prefilling is not None) >= self.max_batch:
            raise ValueError(f"fork: the batch is full ({self.max_batch} sequences)")
        child = Request(
            self._next_rid,
            list(parent.prompt),
            parent.max_new_tokens,
            output=list(parent.output),
            cursor=parent.cursor,
            pending=list(parent.pending),
            t_add=time.perf_counter(),
            t_first=parent.t_first,
        )
        self._next_rid += 1
        self.bm.fork(parent.rid, child.rid)
        self.running.append(child)
        return child.rid

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def run(self, max_steps: int | None = None) -> dict[int, list[int]]:
        while self.has_work and (max_steps is None or self.steps < max_steps):
            self.step()
        return {rid: r.output for rid, r in sorted(self.finished.items())}

    # -- one iteration -------------------------------------------------------------------
    def _admit(self) -> None:
        if self.prefilling is not None or not self.waiting or len(self.running) >= self.max_batch:
            return
        r = self.waiting[0]
        # Leave one block per running sequence so admitting this one does not preempt them next step.
        reserve = len(self.running) if self.watermark else 0
        if self.bm.blocks_needed(r.pending) > self.bm.num_available - reserve or not self.bm.can_allocate(r.pending):
            return
        self.waiting.popleft()
        r.cursor = r.cached_tokens = self.bm.allocate(r.rid, r.pending)
        self.prefilling = r

    def _preempt(self, r: Request) -> None:
        self.bm.free(r.rid)
        r.pending = r.prompt + r.output  # recompute everything, the last token included
        r.cursor = 0
        r.preemptions += 1
        self.waiting.appendleft(r)

    def _make_room(self) -> list[int]:
        """Preempts until every running sequence can append one token."""
        OutOfBlocks = ext().OutOfBlocks
        while True:
            try:
                victims = self.bm.preemption_victims([r.rid for r in self.running])
                break
            except OutOfBlocks:
                if self.prefilling is None:
                    raise
                self._preempt(self.prefilling)  # give its blocks to the running ones
                self.prefilling = None
        gone = set(victims)
        for r in reversed([r for r in self.running if r.rid in gone]):
            self._preempt(r)
        self.running = [r for r in self.running if r.rid not in gone]
        return victims

    def step(self) -> StepReport:
        t0 = time.perf_counter()
        self._admit()
        preempted = self._make_room() if self.running else []
        bs = self.block_size
        tokens, positions, slots, copies = [], [], [], []
        dec = self.running
        for r in dec:
            slot, copy = self.bm.append(r.rid, r.output[-1])
            tokens.append(r.output[-1])
            positions.append(self.bm.num_tokens(r.rid) - 1)
            slots.append(slot)
            if copy is not None:
                copies.append(copy)
        n_dec = len(dec)
        dec_lens = np.array([self.bm.num_tokens(r.rid) for r in dec], np.int32)
        stride = max(1, max((-(-int(n) // bs) for n in dec_lens), default=1))
        dec_tables = self.bm.table_array([r.rid for r in dec], stride) if n_dec else None
        logit_rows = list(range(n_dec))

        pf, n_pf, pf_table, pf_len = self.prefilling, 0, None, 0
        if pf is not None:
            n_pf = min(self.prefill_chunk, len(pf.pending) - pf.cursor)
            table = np.array(self.bm.block_table(pf.rid), np.int32)
            pos = np.arange(pf.cursor, pf.cursor + n_pf, dtype=np.int32)
            tokens += pf.pending[pf.cursor : pf.cursor + n_pf]
            positions += pos.tolist()
            slots += (table[pos // bs] * bs + pos % bs).tolist()
            pf_table, pf_len = table, pf.cursor + n_pf
            if pf_len == len(pf.pending):
                logit_rows.append(n_dec + n_pf - 1)
        if not tokens:  # nothing admitted and nothing running: the pool is too full to start anyone
            raise ext().OutOfBlocks("no request can be admitted: the pool cannot hold the next prompt")

        self.model.copy_blocks(copies)
        a = lambda x: np.ascontiguousarray(x, dtype=np.int32)  # noqa: E731
        nxt = self.model.step(
            a(tokens), a(positions), a(slots), n_dec, dec_tables, dec_lens if n_dec else None, pf_table, pf_len, a(logit_rows)
        )
        self.steps += 1
        now = time.perf_counter()

        produced = []
        for i, r in enumerate(dec):
            self.bm.commit(r.rid, self.bm.num_tokens(r.rid))
            produced.append(self._emit(r, int(nxt[i]), now))
        if pf is not None:
            self.bm.commit(pf.rid, pf_len)
            pf.cursor = pf_len
            if pf_len == len(pf.pending):
                self.prefilling = None
                self.running.append(pf)
                produced.append(self._emit(pf, int(nxt[-1]), now))
        for r in [r for r in self.running if r.done or (r.output and r.output[-1] in self.eos)]:
            self.bm.free(r.rid)
            r.t_done = now
            self.finished[r.rid] = r
        self.running = [r for r in self.running if r.rid not in self.finished]
        return StepReport(n_dec, n_pf, produced, float(getattr(self.model, "last_step_ms", 0.0)), 1e3 * (now - t0), preempted)

    def _emit(self, r: Request, token: int, now: float) -> tuple[int, int]:
        if not r.output:
            r.t_first = now
        r.output.append(token)
        return r.rid, token
