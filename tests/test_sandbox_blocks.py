"""The sandbox's C++ block manager (atomflow._sandbox.BlockManager), on the CPU.

A hypothesis state machine drives random allocate / append / fork / free / commit sequences and
models the device with a Python shadow: every KV slot holds the token prefix ending at it (real
KV depends on the whole prefix), written when the caller would run the forward pass, copied when
the manager hands back a copy-on-write pair. After every step: no block leaked or double-freed,
refcounts equal the tables holding each block, every sequence reads back exactly its own prefix
(so copy-on-write never changed another sequence's data, and a prefix hit returned identical
KV), new blocks only ever come from blocks no sequence held (eviction of unreferenced blocks
only), and out-of-blocks raised without changing anything."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule  # noqa: E402

_sandbox = pytest.importorskip("atomflow._sandbox", reason="the sandbox extension is not built")
BlockManager, OutOfBlocks = _sandbox.BlockManager, _sandbox.OutOfBlocks


def snapshot(bm):
    seqs = bm.sequences()
    return (
        bm.num_available,
        bm.num_cached_idle,
        tuple(seqs),
        tuple(tuple(bm.block_table(s)) for s in seqs),
        tuple(tuple(bm.tokens(s)) for s in seqs),
        tuple(bm.refcount(b) for b in range(bm.num_blocks)),
    )


class BlockMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.bs = block_size
        self.data: dict[int, tuple] = {}  # the device: slot -> token prefix ending there
        self.tokens: dict[int, list] = {}  # the expected token list of every live sequence
        self.next_id = 0

    # -- helpers ---------------------------------------------------------------------------
    def held(self) -> set[int]:
        return {b for s in self.bm.sequences() for b in self.bm.block_table(s)}

    def write(self, seq: int, p: int) -> None:
        slot = self.bm.slot(seq, p)
        assert self.bm.refcount(slot // self.bs) == 1, "writing into a block another sequence holds"
        self.data[slot] = tuple(self.tokens[seq][: p + 1])

    # -- rules -----------------------------------------------------------------------------
    # Tokens from a 3-symbol alphabet so prompts share prefixes often.
    @rule(target=seqs, prompt=st.lists(st.integers(0, 2), min_size=1, max_size=40))
    def allocate(self, prompt):
        seq, before, held = self.next_id, snapshot(self.bm), self.held()
        self.next_id += 1
        fits = self.bm.can_allocate(prompt)
        try:
            cached = self.bm.allocate(seq, prompt)
        except OutOfBlocks:
            assert not fits, "can_allocate said yes, allocate said no"
            assert snapshot(self.bm) == before, "a failed allocate changed the state"
            return hypothesis.stateful.multiple()
        assert fits
        assert cached % self.bs == 0 and 0 <= cached < len(prompt)
        table = self.bm.block_table(seq)
        hits, fresh = table[: cached // self.bs], table[cached // self.bs :]
        assert not (set(fresh) & held), "a block some sequence held was handed out as new"
        assert all(self.bm.is_cached(b) for b in hits)
        self.tokens[seq] = list(prompt)
        for p in range(cached):  # a prefix hit must hold exactly this prompt's KV
            assert self.data.get(self.bm.slot(seq, p)) == tuple(prompt[: p + 1]), "prefix hit with different KV"
        for p in range(cached, len(prompt)):
            self.write(seq, p)
        self.bm.commit(seq, len(prompt))
        return seq

    @rule(seq=seqs, token=st.integers(0, 2), commit=st.booleans())
    def append(self, seq, token, commit):
        if not self.bm.has(seq):
            return
        before, held, cost = snapshot(self.bm), self.held(), self.bm.append_cost(seq)
        try:
            slot, copy = self.bm.append(seq, token)
        except OutOfBlocks:
            assert cost == 1 and self.bm.num_available == 0
            assert snapshot(self.bm) == before, "a failed append changed the state"
            return
        assert cost == (1 if copy is not None or self.bm.num_tokens(seq) % self.bs == 1 or self.bs == 1 else 0)
        new_block = slot // self.bs
        if cost:
            assert new_block not in held, "append took a block some sequence held"
        if copy is not None:
            src, dst = copy
            assert dst == new_block and src in held
            for o in range(self.bs):
                if src * self.bs + o in self.data:
                    self.data[dst * self.bs + o] = self.data[src * self.bs + o]
        self.tokens[seq].append(token)
        self.write(seq, len(self.tokens[seq]) - 1)
        if commit:
            self.bm.commit(seq, len(self.tokens[seq]))

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if not self.bm.has(parent):
            return hypothesis.stateful.multiple()
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if self.bm.has(seq):
            self.bm.free(seq)
            del self.tokens[seq]

    @rule(seq=seqs)
    def commit_all(self, seq):
        if self.bm.has(seq):
            self.bm.commit(seq, self.bm.num_tokens(seq))

    @rule()
    def preemption_plan(self):
        running = self.bm.sequences()
        try:
            victims = self.bm.preemption_victims(running)
        except OutOfBlocks:
            return
        assert victims == list(reversed(running))[: len(victims)], "victims must be the latest ones"
        # Freeing the victims must really let every remaining sequence append one token.
        bm, bs = self.bm, self.bs
        refs = [bm.refcount(b) for b in range(bm.num_blocks)]
        for v in victims:
            for b in bm.block_table(v):
                refs[b] -= 1
        freed = sum(1 for b in range(bm.num_blocks) if refs[b] == 0 and bm.refcount(b) > 0)
        left = [s for s in running if s not in victims]
        need = sum(1 if bm.num_tokens(s) % bs == 0 or refs[bm.block_table(s)[-1]] > 1 else 0 for s in left)
        assert need <= bm.num_available + freed
        if victims:  # and preempting one fewer would not have been enough
            spared = victims[-1]
            for b in bm.block_table(spared):
                refs[b] += 1
            freed = sum(1 for b in range(bm.num_blocks) if refs[b] == 0 and bm.refcount(b) > 0)
            need = sum(1 if bm.num_tokens(s) % bs == 0 or refs[bm.block_table(s)[-1]] > 1 else 0 for s in left + [spared])
            assert need > bm.num_available + freed, "preempted more than needed"

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        bm.check()  # the C++ side's own view
        refs = [0] * bm.num_blocks
        for s in bm.sequences():
            for b in bm.block_table(s):
                refs[b] += 1
        assert [bm.refcount(b) for b in range(bm.num_blocks)] == refs, "refcount != tables holding the block"
        held = {b for b, r in enumerate(refs) if r}
        assert bm.num_used == len(held) and bm.num_available + len(held) == bm.num_blocks, "a block leaked"
        assert set(bm.sequences()) == set(self.tokens)
        for s, toks in self.tokens.items():
            assert list(bm.tokens(s)) == toks
            for p in range(len(toks)):  # every token written so far reads back as this sequence's prefix
                assert self.data.get(bm.slot(s, p)) == tuple(toks[: p + 1]), f"sequence {s} lost its KV at {p}"


BlockMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_manager_state_machine = BlockMachine.TestCase


# ----------------------------------------------------------------------------- direct cases


def test_out_of_blocks_is_a_clean_error():
    bm = BlockManager(2, 4)
    bm.allocate(0, [1] * 8)
    before = snapshot(bm)
    with pytest.raises(OutOfBlocks, match="out of KV blocks"):
        bm.allocate(1, [2])
    with pytest.raises(OutOfBlocks):
        bm.append(0, 3)
    assert snapshot(bm) == before
    bm.check()


def test_bad_calls_raise_value_error():
    bm = BlockManager(4, 4)
    bm.allocate(0, [1, 2])
    with pytest.raises(ValueError):
        bm.allocate(0, [1])  # exists
    with pytest.raises(ValueError):
        bm.allocate(1, [])  # empty
    with pytest.raises(ValueError):
        bm.append(7, 1)  # unknown
    with pytest.raises(ValueError):
        bm.commit(0, 3)  # past its tokens
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    bm.check()


def test_prefix_hit_shares_full_blocks_but_never_the_last_token():
    bm = BlockManager(16, 4)
    prompt = list(range(12))  # three full blocks
    assert bm.allocate(0, prompt) == 0
    assert bm.allocate(1, prompt) == 0, "nothing is cached before commit (the KV is not written yet)"
    bm.commit(0, 12)
    # The block holding the last token is recomputed: 8 of 12 tokens hit.
    assert bm.allocate(2, prompt) == 8
    assert bm.block_table(2)[:2] == bm.block_table(0)[:2] and bm.block_table(2)[2] != bm.block_table(0)[2]
    assert bm.refcount(bm.block_table(0)[0]) == 2
    assert bm.allocate(3, prompt + [99]) == 12
    assert bm.allocate(4, [0, 1, 2, 3, 7, 7, 7, 7, 9]) == 4  # diverges in block 1
    assert bm.stats["cached_tokens"] == 24
    bm.check()


def test_prefix_caching_off_never_hits():
    bm = BlockManager(16, 4, prefix_caching=False)
    bm.allocate(0, list(range(12)))
    bm.commit(0, 12)
    assert bm.allocate(1, list(range(12))) == 0
    assert not any(bm.is_cached(b) for b in range(16))


def test_lru_evicts_least_recently_freed_and_only_unreferenced():
    bm = BlockManager(4, 2)
    bm.allocate(0, [1, 1, 1])  # blocks for [1,1] (cacheable) and [1]
    bm.commit(0, 3)
    bm.allocate(1, [2, 2, 2])
    bm.commit(1, 3)
    bm.free(0)
    bm.free(1)
    assert bm.num_cached_idle == 2 and bm.num_available == 4
    # Four fresh blocks needed: the two free ones first, then the cached ones, oldest first.
    bm.allocate(2, [5, 6, 7, 8, 9, 9, 9])
    assert bm.stats["evictions"] == 2 and bm.num_cached_idle == 0
    assert bm.allocate(3, [1, 1, 1]) == 0 if bm.num_available else True
    bm.check()


def test_idle_cached_block_is_revived_by_a_hit():
    bm = BlockManager(3, 2)
    bm.allocate(0, [4, 4, 4])
    bm.commit(0, 3)
    cached_block = bm.block_table(0)[0]
    bm.free(0)
    assert bm.allocate(1, [4, 4, 5]) == 2 and bm.block_table(1)[0] == cached_block
    assert bm.refcount(cached_block) == 1 and bm.stats["evictions"] == 0
    bm.check()


def test_copy_on_write_after_fork():
    bm = BlockManager(8, 4)
    bm.allocate(0, [1, 2, 3, 4, 5, 6])  # second block half full
    bm.commit(0, 6)
    bm.fork(0, 1)
    shared = bm.block_table(0)[1]
    assert bm.refcount(shared) == 2 and bm.append_cost(0) == 1
    slot, copy = bm.append(0, 7)
    assert copy == (shared, slot // 4) and slot % 4 == 2
    assert bm.block_table(1)[1] == shared and bm.refcount(shared) == 1
    slot, copy = bm.append(1, 8)  # the child now owns the old block alone: no copy
    assert copy is None and slot == shared * 4 + 2
    assert bm.stats["cow_copies"] == 1
    bm.check()


def test_preemption_victims_latest_first():
    bm = BlockManager(3, 2)
    for s in range(3):
        bm.allocate(s, [s, s])  # each holds one full block: the next append needs a new one
    assert bm.num_available == 0
    assert bm.preemption_victims([0, 1, 2]) == [2, 1]
    assert bm.preemption_victims([0]) == [] if bm.num_available else True
    bm2 = BlockManager(1, 2)
    bm2.allocate(0, [1, 1])
    with pytest.raises(OutOfBlocks):
        bm2.preemption_victims([0])


def test_table_array():
    bm = BlockManager(8, 4)
    bm.allocate(5, list(range(9)))
    bm.allocate(6, [1])
    t = bm.table_array([6, 5], 4)
    assert t.shape == (2, 4) and t.dtype.name == "int32"
    assert t[1, :3].tolist() == bm.block_table(5) and t[0, 0] == bm.block_table(6)[0]
    with pytest.raises(ValueError):
        bm.table_array([5], 2)
