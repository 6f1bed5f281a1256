"""Prefix reuse in the Engine facade (the server's conversation reuse): a prompt that shares a
prefix with what the cache holds prefills only the rest, and generates what a fresh run does."""

import numpy as np
import pytest

from atomflow import Engine, SamplingParams


@pytest.fixture(scope="module")
def eng(tiny_model_file):
    return Engine.load(tiny_model_file, backend="cpu", max_context=512)


def greedy(n):
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def test_cached_ids_follow_the_cache(eng):
    eng.reset()
    assert eng.cached_ids == []
    eng.prefill([5, 6, 7])
    eng.decode(8)
    assert eng.cached_ids == [5, 6, 7, 8] and eng.position == 4
    out = list(eng.generate_tokens([1, 2, 3], greedy(5)))
    assert eng.cached_ids == [1, 2, 3] + out[:-1]  # the last sampled token is never fed
    eng.backend.reset()  # driven around the facade: nothing is claimed
    assert eng.cached_ids == [] and eng.common_prefix([1, 2, 3]) == 0


def test_turn_two_prefills_only_its_new_tokens(eng):
    turn1 = eng.encode("Tell me about the cache, at length please.")
    reply = list(eng.generate_tokens(turn1, greedy(10), reuse_prefix=True))
    turn2 = np.concatenate([turn1, reply, eng.encode("And then?", chat=False)])
    second = list(eng.generate_tokens(turn2, greedy(8), reuse_prefix=True))
    # the cache held turn1 + reply[:-1]: everything but the last reply token and the new text is kept
    assert eng.stats.reused_tokens == len(turn1) + len(reply) - 1
    assert eng.stats.prefilled_tokens == len(turn2) - eng.stats.reused_tokens
    eng.reset()
    fresh = list(eng.generate_tokens(turn2, greedy(8)))
    assert eng.stats.reused_tokens == 0 and eng.stats.prefilled_tokens == len(turn2)
    assert second == fresh


def test_same_prompt_runs_its_last_token_and_replays_a_seed(eng):
    ids = eng.encode("Once upon a time")
    p = SamplingParams(temperature=1.0, seed=11, max_new_tokens=12, ignore_eos=True)
    eng.reset()
    a = list(eng.generate_tokens(ids, p, reuse_prefix=True))
    b = list(eng.generate_tokens(ids, p, reuse_prefix=True))
    assert eng.stats.reused_tokens == len(ids) - 1 and eng.stats.prefilled_tokens == 1
    assert a == b


def test_diverging_prompt_rolls_back_to_the_common_prefix(eng):
    eng.reset()
    list(eng.generate_tokens([1, 2, 3, 4, 5, 6], greedy(4), reuse_prefix=True))
    got = list(eng.generate_tokens([1, 2, 3, 9, 9], greedy(3), reuse_prefix=True))
    assert eng.stats.reused_tokens == 3 and eng.stats.prefilled_tokens == 2
    eng.reset()
    assert list(eng.generate_tokens([1, 2, 3, 9, 9], greedy(3))) == got
    # reuse off: the cache starts over whatever it holds
    list(eng.generate_tokens([1, 2, 3, 9, 9], greedy(3)))
    assert eng.stats.reused_tokens == 0


def test_cancelled_generation_leaves_a_reusable_cache(eng):
    ids = eng.encode("A long story")
    gen = eng.generate_tokens(ids, greedy(50), reuse_prefix=True)
    got = [next(gen) for _ in range(5)]
    gen.close()
    assert eng.cached_ids == ids.tolist() + got[:-1]
    list(eng.generate_tokens(np.concatenate([ids, got]), greedy(2), reuse_prefix=True))
    assert eng.stats.reused_tokens == len(ids) + 4


# -- the CUDA backend: the same contract (skipped without a GPU) ---------------------------------


def test_closing_an_older_generation_keeps_the_newer_cache_record(eng):
    """A generator left open while a later call refills the cache, closed afterwards: the record of
    what the cache holds stays the later call's, so a reuse after it is the fresh run's output; and
    resuming the superseded generator is an error, not a decode at the other run's position."""
    eng.reset()
    a, b = list(range(10, 60)), list(range(100, 120))
    g1 = eng.generate_tokens(a, greedy(20), reuse_prefix=True)
    out_a = [next(g1) for _ in range(5)]
    out_b = list(eng.generate_tokens(b, greedy(20), reuse_prefix=True))
    with pytest.raises(RuntimeError, match="ended by a later call"):
        next(g1)
    g1.close()
    assert eng.cached_ids == b + out_b[:-1]
    prompt = a + out_a + [7, 8, 9]
    reused = list(eng.generate_tokens(prompt, greedy(8), reuse_prefix=True))
    eng.reset()
    assert reused == list(eng.generate_tokens(prompt, greedy(8)))


@pytest.fixture(scope="module")
def cuda_eng(tiny_model_file):
    from atomflow.device import cuda_status

    if not cuda_status()[0]:
        pytest.skip("gpu: " + cuda_status()[1])
    return Engine.load(tiny_model_file, backend="cuda", max_context=512)


@pytest.mark.gpu
def test_cuda_turn_two_reuses_and_matches_a_fresh_run(cuda_eng):
    eng = cuda_eng
    turn1 = eng.encode("Tell me about the cache, at length please.")
    reply = list(eng.generate_tokens(turn1, greedy(10), reuse_prefix=True))
    assert eng.cached_ids == turn1.tolist() + reply[:-1] and eng.position == len(turn1) + 9
    turn2 = np.concatenate([turn1, reply, eng.encode("And then?", chat=False)])
    second = list(eng.generate_tokens(turn2, greedy(8), reuse_prefix=True))
    assert eng.stats.reused_tokens == len(turn1) + len(reply) - 1
    eng.reset()
    # bf16 KV written by two prefills vs one: the same greedy tokens on this model (no near ties)
    assert list(eng.generate_tokens(turn2, greedy(8))) == second


@pytest.mark.gpu
def test_cuda_same_prompt_and_cancel(cuda_eng):
    eng = cuda_eng
    ids = eng.encode("Once upon a time")
    p = SamplingParams(temperature=1.0, seed=11, max_new_tokens=12, ignore_eos=True)
    eng.reset()
    a = list(eng.generate_tokens(ids, p, reuse_prefix=True))
    b = list(eng.generate_tokens(ids, p, reuse_prefix=True))
    assert eng.stats.prefilled_tokens == 1 and a == b  # the draw is keyed by (seed, position)
    gen = eng.generate_tokens(ids, greedy(200), reuse_prefix=True)
    got = [next(gen) for _ in range(5)]
    gen.close()  # ends the pipeline: the steps enqueued past the 5th are dropped
    assert eng.position == len(ids) + 4 and eng.cached_ids == ids.tolist() + got[:-1]
    list(eng.generate_tokens(np.concatenate([ids, got]), greedy(2), reuse_prefix=True))
    assert eng.stats.reused_tokens == len(ids) + 4
