"""The Engine facade on the CPU backend: logits equal the reference, generation honours every
stopping rule, the KV position is rolled back as documented, bad input is refused."""

import numpy as np
import pytest

from atomflow import BackendUnavailableError, Engine, SamplingParams
from atomflow.device import cuda_status
from atomflow.model.fileformat import AtomflowFile
from atomflow.model.reference import ReferenceModel


@pytest.fixture(scope="module")
def eng(tiny_model_file):
    return Engine.load(tiny_model_file, backend="cpu", max_context=256)


def test_prefill_decode_equal_reference(eng, tiny_model_file):
    ref = ReferenceModel(AtomflowFile(tiny_model_file), 256)
    eng.reset()
    ids = np.random.default_rng().integers(0, eng.spec.vocab_size, 17)
    np.testing.assert_array_equal(eng.prefill(ids), ref.forward(ids))
    np.testing.assert_array_equal(eng.decode(5), ref.forward(np.array([5])))
    assert eng.position == 18


def test_greedy_generation_is_deterministic_and_rolls_back(eng):
    p = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    a = list(eng.generate_tokens("The cache", p))
    b = list(eng.generate_tokens("The cache", p))
    assert a == b and len(a) == 12
    assert eng.position == eng.stats.prompt_tokens + 12 - 1  # the last token is never fed
    # greedy tokens are the argmax of the logits the engine computes step by step
    eng.reset()
    logits = eng.prefill(eng.encode("The cache"))
    for t in a:
        assert t == int(np.argmax(logits))
        logits = eng.decode(t)


def test_closing_early_leaves_prompt_plus_yielded_but_last(eng):
    gen = eng.generate_tokens("Hello there", SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True))
    got = [next(gen) for _ in range(4)]
    gen.close()
    assert len(got) == 4 and eng.position == eng.stats.prompt_tokens + 3


def test_seeds(eng):
    def run(seed):
        return list(eng.generate_tokens("Once", SamplingParams(temperature=1.0, seed=seed, max_new_tokens=16, ignore_eos=True)))

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_text_stream_equals_decoded_tokens_and_stops(eng):
    p = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    tokens = list(eng.generate_tokens("A story", p))
    text = "".join(eng.generate("A story", p))
    assert text == eng.tokenizer.decode(tokens, skip_special_tokens=True)
    assert eng.stats.stop_reason == "length"
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        cut = "".join(eng.generate("A story", SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=(stop,))))
        assert cut == text[: text.index(stop)] and eng.stats.stop_reason == "stop"


def test_eos_stops_unless_ignored(eng, monkeypatch):
    """A random model rarely samples EOS by itself, so the sampler is steered: the third token it
    draws is an EOS id. Generation must end there without yielding it, unless ignore_eos."""
    import atomflow.backends.cpu as backend

    eos = min(eng.tokenizer.eos_token_ids)
    draws = iter([5, 6, eos, 7, 8, 9])
    monkeypatch.setattr(backend, "sample_numpy", lambda logits, params, position: next(draws))
    toks = list(eng.generate_tokens("Once", SamplingParams(temperature=1.0, seed=3, max_new_tokens=6)))
    assert toks == [5, 6] and eng.stats.stop_reason == "eos"

    draws = iter([5, 6, eos, 7, 8, 9])
    toks = list(eng.generate_tokens("Once", SamplingParams(temperature=1.0, seed=3, max_new_tokens=6, ignore_eos=True)))
    assert toks == [5, 6, eos, 7, 8, 9] and eng.stats.stop_reason == "length"


def test_context_limit(tiny_model_file):
    eng = Engine.load(tiny_model_file, backend="cpu", max_context=16)
    with pytest.raises(ValueError, match="does not fit max_context 16"):
        list(eng.generate_tokens(list(range(16)), SamplingParams(max_new_tokens=4)))
    toks = list(eng.generate_tokens(list(range(1, 13)), SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)))
    assert len(toks) == 16 - 12 + 1 and eng.stats.stop_reason == "context"


@pytest.mark.parametrize(
    "bad,needle", [([0, 10**6], "token id 1000000 out of range"), ([], "empty prompt"), ([-1], "token id -1")]
)
def test_bad_ids(eng, bad, needle):
    with pytest.raises(ValueError, match=needle):
        list(eng.generate_tokens(bad, SamplingParams()))


def test_bad_max_context(tiny_model_file):
    with pytest.raises(ValueError, match="max_context must be an integer in"):
        Engine.load(tiny_model_file, backend="cpu", max_context=10**9)


@pytest.mark.skipif(cuda_status()[0], reason="a usable GPU is present")
def test_cuda_backend_unavailable_is_plain(tiny_model_file):
    with pytest.raises(BackendUnavailableError, match="cuda backend unavailable"):
        Engine.load(tiny_model_file, backend="cuda")
