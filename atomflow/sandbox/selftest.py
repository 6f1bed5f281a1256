"""`atomflow sandbox test-blocks`: a randomized self-test of the block manager and the scheduler
that runs anywhere (no GPU): random allocate / append / fork / free / commit against a shadow of
the device (each KV slot holds the token prefix ending there), invariants checked after every
operation; then random continuous-batching workloads through the scheduler on FakeModel, whose
tokens must equal single-stream generation. tests/test_sandbox_blocks.py is the same idea under
hypothesis."""

from __future__ import annotations

import random

from atomflow.sandbox.model import FakeModel, ext


def stress_block_manager(num_blocks: int, block_size: int, ops: int, seed: int, prefix_caching: bool = True) -> dict:
    sb = ext()
    rng = random.Random(seed)
    bm = sb.BlockManager(num_blocks, block_size, prefix_caching)
    data: dict[int, tuple] = {}
    tokens: dict[int, list] = {}
    counts = dict(allocate=0, append=0, fork=0, free=0, out_of_blocks=0, copies=0)
    next_id = 0

    def write(seq, p):
        slot = bm.slot(seq, p)
        if bm.refcount(slot // block_size) != 1:
            raise AssertionError(f"write into a shared block (sequence {seq}, position {p})")
        data[slot] = tuple(tokens[seq][: p + 1])

    for _ in range(ops):
        op = rng.choices(["allocate", "append", "fork", "free"], [3, 8, 1, 2])[0]
        live = list(tokens)
        if op == "allocate" or not live:
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, 4 * block_size))]
            try:
                cached = bm.allocate(next_id, prompt)
            except sb.OutOfBlocks:
                counts["out_of_blocks"] += 1
                continue
            tokens[next_id] = prompt
            for p in range(cached):
                if data.get(bm.slot(next_id, p)) != tuple(prompt[: p + 1]):
                    raise AssertionError("a prefix hit returned different KV")
            for p in range(cached, len(prompt)):
                write(next_id, p)
            bm.commit(next_id, len(prompt))
            next_id += 1
        elif op == "append":
            seq = rng.choice(live)
            t = rng.randrange(3)
            try:
                slot, copy = bm.append(seq, t)
            except sb.OutOfBlocks:
                counts["out_of_blocks"] += 1
                continue
            if copy is not None:
                counts["copies"] += 1
                for o in range(block_size):
                    if copy[0] * block_size + o in data:
                        data[copy[1] * block_size + o] = data[copy[0] * block_size + o]
            tokens[seq].append(t)
            write(seq, len(tokens[seq]) - 1)
            if rng.random() < 0.7:
                bm.commit(seq, len(tokens[seq]))
        elif op == "fork":
            parent = rng.choice(live)
            bm.fork(parent, next_id)
            tokens[next_id] = list(tokens[parent])
            next_id += 1
        else:
            seq = rng.choice(live)
            bm.free(seq)
            del tokens[seq]
        counts[op] += 1
        bm.check()
        for s, toks in tokens.items():
            for p in range(len(toks)):
                if data.get(bm.slot(s, p)) != tuple(toks[: p + 1]):
                    raise AssertionError(f"sequence {s} reads foreign KV at position {p}")
    for s in list(tokens):
        bm.free(s)
    bm.check()
    if bm.num_used:
        raise AssertionError(f"{bm.num_used} blocks leaked")
    return dict(counts, stats=bm.stats)


def stress_scheduler(runs: int, seed: int) -> dict:
    from atomflow.sandbox.scheduler import Scheduler

    rng = random.Random(seed)
    totals = dict(requests=0, steps=0, preemptions=0, cached_tokens=0, cow_copies=0)
    for _ in range(runs):
        bs = rng.choice([1, 4, 16])
        nb = rng.randint(8, 64)
        model = FakeModel(nb, bs, 50, max_batch=rng.randint(1, 8), prefill_chunk=rng.randint(1, 40), max_context=nb * bs)
        sch = Scheduler(model, prefix_caching=rng.random() < 0.8)
        system = [rng.randrange(50) for _ in range(rng.randint(0, 40))]
        want = {}
        for _ in range(rng.randint(1, 12)):
            prompt = system + [rng.randrange(50) for _ in range(rng.randint(1, 24))]
            n = rng.randint(1, 24)
            if -(-(len(prompt) + n) // bs) <= nb:
                want[sch.add(prompt, n)] = (prompt, n)
        forks = {}
        while sch.has_work:
            sch.step()
            sch.bm.check()
            if sch.running and rng.random() < 0.1 and len(sch.running) + (sch.prefilling is not None) < sch.max_batch:
                parent = rng.choice(sch.running).rid
                forks[sch.fork(parent)] = parent
        for rid, (prompt, n) in want.items():
            if sch.finished[rid].output != FakeModel.reference(prompt, n, 50):
                raise AssertionError(f"scheduler run: request {rid} differs from single-stream generation")
        for child, parent in forks.items():
            if sch.finished[child].output != sch.finished[parent].output:
                raise AssertionError(f"scheduler run: fork {child} differs from its parent {parent}")
        if sch.bm.num_used:
            raise AssertionError("scheduler run leaked blocks")
        totals["requests"] += len(want) + len(forks)
        totals["steps"] += sch.steps
        totals["preemptions"] += sum(r.preemptions for r in sch.finished.values())
        totals["cached_tokens"] += sch.bm.stats["cached_tokens"]
        totals["cow_copies"] += sch.bm.stats["cow_copies"]
    return totals
