"""The CPU sampler is the specification the device sampler is tested against, so its semantics
(validation, greedy ties, top-k/top-p sets, seeded draws, stop strings) are pinned down here."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atomflow.sampling import SamplingParams, StopChecker, allowed_tokens, sample_numpy, uniform


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0 (0 = greedy), got -0.1"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0 (0 = greedy), got inf"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0 (0 = greedy), got nan"),
        (dict(temperature="0.7"), "temperature must be a finite number >= 0 (0 = greedy), got '0.7'"),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (dict(top_p=float("nan")), "top_p must be in (0, 1], got nan"),
        (dict(top_k=-1), "top_k must be an integer >= 0 (0 = off), got -1"),
        (dict(top_k=2.5), "top_k must be an integer >= 0 (0 = off), got 2.5"),
        (dict(top_k=True), "top_k must be an integer >= 0 (0 = off), got True"),
        (dict(seed=-1), "seed must be an integer in [0, 2**63) or None, got -1"),
        (dict(seed=2**63), f"seed must be an integer in [0, 2**63) or None, got {2**63}"),
        (dict(seed=1.0), "seed must be an integer in [0, 2**63) or None, got 1.0"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
        (dict(stop=("ok", "")), "stop must be a sequence of non-empty strings, got ('ok', '')"),
        (dict(stop=3), "stop must be a sequence of non-empty strings, got 3"),
        (dict(ignore_eos="no"), "ignore_eos must be True or False, got 'no'"),
    ],
)
def test_invalid_params_rejected_with_one_line_message(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value) == message


def test_params_normalized_and_seed_resolved_once():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(4), stop=["a", "bc"])
    assert (p.temperature, p.top_k, p.stop) == (0.5, 4, ("a", "bc"))
    assert type(p.top_k) is int and isinstance(p.seed, int) and 0 <= p.seed < 2**63
    assert SamplingParams(stop="END").stop == ("END",)
    assert len({SamplingParams().seed for _ in range(8)}) == 8  # drawn from os.urandom


def test_greedy_is_argmax_lowest_index_on_ties():
    logits = np.array([0.5, 3.0, -1.0, 3.0, 2.9], dtype=np.float32)
    p = SamplingParams(temperature=0.0, seed=1)
    assert all(sample_numpy(logits, p, pos) == 1 for pos in range(20))
    rng = np.random.default_rng(0)
    for _ in range(50):
        x = rng.standard_normal(1000).astype(np.float32)
        assert sample_numpy(x, SamplingParams(temperature=0, top_k=5, top_p=0.3), 7) == int(np.argmax(x))


def test_draw_is_philox4x64_keyed_by_seed_and_position():
    """uniform() is what a device Philox must reproduce: checked against a pure-Python Philox4x64-10."""
    m64 = (1 << 64) - 1

    def philox4x64_10(ctr, key):
        for r in range(10):
            if r:
                key = [(key[0] + 0x9E3779B97F4A7C15) & m64, (key[1] + 0xBB67AE8584CAA73B) & m64]
            p0, p1 = 0xD2E7470EE14C6C93 * ctr[0], 0xCA5A826395121157 * ctr[2]
            ctr = [(p1 >> 64) ^ ctr[1] ^ key[0], p1 & m64, (p0 >> 64) ^ ctr[3] ^ key[1], p0 & m64]
        return ctr

    for seed, pos in [(0, 0), (1, 1), (12345, 999), (2**63 - 1, 2**40)]:
        word = philox4x64_10([pos + 1, 0, 0, 0], [seed, 0])[0]
        assert uniform(seed, pos) == (word >> 11) * 2.0**-53


def test_same_seed_same_tokens_other_seed_other_tokens():
    x = np.random.default_rng(3).standard_normal(500).astype(np.float32)
    run = lambda seed: [sample_numpy(x, SamplingParams(temperature=1.0, seed=seed), pos) for pos in range(64)]
    assert run(11) == run(11)
    assert run(11) != run(12)
    assert len(set(run(11))) > 20  # the position changes the draw


def _brute_force_allowed(logits, temperature, top_k, top_p):
    """The definition, written the slow obvious way."""
    z = [float(v) / temperature for v in logits]
    kept = set(range(len(z)))
    if 0 < top_k < len(z):
        kth = sorted(z, reverse=True)[top_k - 1]
        kept = {i for i in kept if z[i] >= kth}
    if top_p < 1:
        m = max(z[i] for i in kept)
        total = sum(math.exp(z[i] - m) for i in kept)
        prob = {i: math.exp(z[i] - m) / total for i in kept}
        mass, cut = 0.0, None
        for i in sorted(kept, key=lambda i: -prob[i]):
            mass += prob[i]
            cut = prob[i]
            if mass >= top_p:
                break
        kept = {i for i in kept if prob[i] >= cut}
    return kept


@settings(max_examples=200, deadline=None, database=None)
@given(
    logits=st.lists(st.integers(-40, 40).map(lambda v: v / 8), min_size=2, max_size=40),
    temperature=st.sampled_from([0.3, 1.0, 2.5]),
    top_k=st.integers(0, 45),
    top_p=st.sampled_from([0.05, 0.5, 0.9, 0.99, 1.0]),
    seed=st.integers(0, 2**63 - 1),
    position=st.integers(0, 10**6),
)
def test_top_k_top_p_never_leave_the_allowed_set(logits, temperature, top_k, top_p, seed, position):
    """Coarse logits (multiples of 1/8) make ties common, which is where the sets are subtle."""
    x = np.array(logits, dtype=np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    mask = allowed_tokens(x, params)
    expect = _brute_force_allowed(logits, temperature, top_k, top_p)
    assert set(np.flatnonzero(mask).tolist()) == expect
    if 0 < top_k < len(logits) and top_p == 1.0:
        assert mask.sum() >= top_k  # ties with the k-th are kept
    assert sample_numpy(x, params, position) in expect


def test_temperature_frequencies_match_softmax():
    """20000 draws (positions 0..N-1): a chi-square far beyond chance would mean a biased sampler.
    Deterministic (fixed seed), so this never flakes; the bound is the 1e-6 tail for 7 dof (~41)."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5], dtype=np.float32)
    for temperature in (0.7, 1.0, 1.8):
        p = np.exp(logits / temperature)
        p /= p.sum()
        params = SamplingParams(temperature=temperature, seed=2024)
        n = 20000
        counts = np.bincount([sample_numpy(logits, params, pos) for pos in range(n)], minlength=len(logits))
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 41.0, (temperature, counts, n * p)


def test_top_k_1_and_tiny_top_p_are_greedy():
    x = np.random.default_rng(5).standard_normal(300).astype(np.float32)
    best = int(np.argmax(x))
    for pos in range(30):
        assert sample_numpy(x, SamplingParams(temperature=1.3, top_k=1, seed=pos), pos) == best
        assert sample_numpy(x, SamplingParams(temperature=0.8, top_p=1e-9, seed=pos), pos) == best


def _stream(stops, pieces):
    c = StopChecker(stops)
    out, stopped = [], False
    for piece in pieces:
        text, stopped = c.feed(piece)
        out.append(text)
        if stopped:
            break
    return "".join(out) + c.flush(), stopped, out


def test_stop_string_split_across_pieces():
    text, stopped, out = _stream(["</s>"], ["Hello <", "/", "s> never shown"])
    assert (text, stopped) == ("Hello ", True)
    assert out == ["Hello ", "", ""]  # "<" and "</" are held, not emitted


def test_stop_cuts_at_the_earliest_completed_stop():
    assert _stream(["cd", "b"], ["abcd"])[:2] == ("a", True)
    assert _stream(["STOP"], ["xSTOPySTOP"])[:2] == ("x", True)
    assert _stream(["\n\n"], ["one\n", "\ntwo"])[:2] == ("one", True)


def test_no_false_hold_back():
    # a prefix of a stop string that never completes comes out by the end (flush) ...
    text, stopped, out = _stream(["<|end|>"], ["a <|e", "nd is near", " <|en"])
    assert (text, stopped) == ("a <|end is near <|en", False)
    assert out == ["a ", "<|end is near", " "]  # "<|en" could still become "<|end|>": held
    # ... text that cannot start a stop string is never held
    assert _stream(["xyz"], ["abc", "def"])[2] == ["abc", "def"]
    assert _stream([], ["a", "b"])[2] == ["a", "b"]


def test_after_stop_everything_is_swallowed():
    c = StopChecker(["."])
    assert c.feed("end. more") == ("end", True)
    assert c.feed("again") == ("", True)
    assert c.flush() == ""
