"""The iteration-level scheduler (atomflow/sandbox/scheduler.py) with the C++ block manager,
on the CPU: FakeModel stores a hash of the token prefix in every KV slot and reads it back
through the block tables, so a batched run reproduces single-stream generation only if every
slot, table, copy-on-write copy, prefix hit and preemption was right."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("atomflow._sandbox", reason="the sandbox extension is not built")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st

from atomflow.sandbox.model import FakeModel  # noqa: E402
from atomflow.sandbox.scheduler import Scheduler  # noqa: E402

VOCAB = 50


def run_workload(seed, block_size, num_blocks, max_batch, chunk, caching, n_requests, shared, fork_p=0.1, late_p=0.3):
    rng = random.Random(seed)
    model = FakeModel(
        num_blocks, block_size, VOCAB, max_batch=max_batch, prefill_chunk=chunk, max_context=num_blocks * block_size
    )
    sch = Scheduler(model, prefix_caching=caching)
    system = [rng.randrange(VOCAB) for _ in range(shared)]
    want, later, parents = {}, [], {}
    for _ in range(n_requests):
        prompt = system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))]
        n = rng.randint(1, 24)
        if -(-(len(prompt) + n) // block_size) > num_blocks:
            continue
        if rng.random() < late_p:  # joins the running batch later
            later.append((prompt, n))
        else:
            want[sch.add(prompt, n)] = (prompt, n)
    while sch.has_work or later:
        if later and rng.random() < 0.3:  # sequences join between steps
            prompt, n = later.pop()
            want[sch.add(prompt, n)] = (prompt, n)
        if not sch.has_work:
            continue
        sch.step()
        sch.bm.check()
        if sch.running and rng.random() < fork_p and len(sch.running) + (sch.prefilling is not None) < sch.max_batch:
            parent = rng.choice(sch.running).rid
            parents[sch.fork(parent)] = parent
    out = {rid: r.output for rid, r in sch.finished.items()}
    for rid, (prompt, n) in want.items():
        assert out[rid] == FakeModel.reference(prompt, n, VOCAB), f"request {rid} differs from single-stream"
    for child, parent in parents.items():
        root = parent
        while root in parents:
            root = parents[root]
        assert out[child] == out[root], f"fork {child} of {root} differs"
    assert sch.bm.num_used == 0, "blocks still held after every request finished"
    return sch, model


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 4, 16]),
    num_blocks=st.integers(8, 64),
    max_batch=st.integers(1, 8),
    chunk=st.integers(1, 40),
    caching=st.booleans(),
    n=st.integers(1, 12),
    shared=st.integers(0, 40),
)
def test_batched_equals_single_stream(seed, block_size, num_blocks, max_batch, chunk, caching, n, shared):
    run_workload(seed, block_size, num_blocks, max_batch, chunk, caching, n, shared)


def test_preemption_recomputes_and_still_matches():
    # A pool far smaller than the batch's total need: sequences must be preempted and recomputed.
    sch, _ = run_workload(1, 4, 12, 6, 8, True, 12, 0, fork_p=0.0)
    assert sum(r.preemptions for r in sch.finished.values()) > 0


def test_prefix_caching_skips_the_shared_prompt():
    def prefill_rows(caching):
        rng = random.Random(7)
        model = FakeModel(256, 16, VOCAB, max_batch=4, prefill_chunk=64, max_context=4096)
        sch = Scheduler(model, prefix_caching=caching)
        system = [rng.randrange(VOCAB) for _ in range(160)]
        rows = 0
        for _i in range(8):
            sch.add(system + [rng.randrange(VOCAB) for _ in range(20)], 4)
        while sch.has_work:
            rows += sch.step().n_prefill
        return rows, sch.bm.stats

    cold, _ = prefill_rows(False)
    warm, stats = prefill_rows(True)
    assert cold == 8 * 180
    assert stats["cached_tokens"] >= 7 * 160 and warm == cold - stats["cached_tokens"]


def test_request_too_large_for_the_pool_is_rejected():
    sch = Scheduler(FakeModel(4, 4, VOCAB, max_batch=2, prefill_chunk=8, max_context=16))
    with pytest.raises(ValueError, match="blocks"):
        sch.add(list(range(20)), 1)
    with pytest.raises(ValueError):
        sch.add([], 1)
