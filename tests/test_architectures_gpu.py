"""Rung 3 for the architectures beyond Llama: Qwen2 (QKV bias), Qwen3 (per-head q/k RMSNorm before RoPE,
head_dim free of hidden / heads) and Mistral, as tiny random models made by transformers' own classes
(tools/make_tiny_arch.py, shapes the CUDA kernels take today), quantized, and run by the CUDA engine
against the numpy reference backend on the same file: logits cosine >= 0.9999 at every step, a prompt
longer than a prefill chunk (256 rows) included, the same greedy tokens, in graph and eager mode; the
step plan's QKV path; the load-time checks of the extra tensors. Skipped without a GPU (conftest)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from engine_util import assert_close, cos_rel, cpu, cuda, prompt

from atomflow.model.fileformat import AtomflowFile
from atomflow.sampling import SamplingParams

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# preset -> the decode step's QKV path (StepPlan::fused_qkv)
PRESETS = {"qwen2-g2": "fused", "qwen3-d128": "attention", "mistral": "fused"}


@pytest.fixture(scope="module")
def arch_files(arch_model):
    """preset -> AtomflowFile (conftest's arch_model, seed 3)."""
    yield {preset: AtomflowFile(arch_model(preset, 3)[1]) for preset in PRESETS}
    gc.collect()


def test_presets_run_on_cuda(arch_files):
    for preset, model in arch_files.items():
        s = model.spec
        assert s.cuda_unsupported() is None, (preset, s.cuda_unsupported())
    assert arch_files["qwen2-g2"].spec.attention_bias and not arch_files["qwen2-g2"].spec.qk_norm
    q3 = arch_files["qwen3-d128"].spec
    assert q3.qk_norm and q3.head_dim * q3.num_heads != q3.hidden_size


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_logits_match_reference(arch_files, preset, eager):
    """A 300-token prompt in two calls (37, then 263 = prefill chunks of 256 + 7), then decode steps fed
    with the reference's greedy token: cosine >= 0.9999 and rel-L2 <= 1e-2 at every step."""
    model = arch_files[preset]
    ids = prompt(300, model.spec.vocab_size, seed=1)
    ref, eng = cpu(model, 512), cuda(model, 512, eager=eager, prefill_chunk=256)
    assert eng.eager == eager
    for i, part in enumerate((ids[:37], ids[37:])):
        want, got = ref.prefill(part), eng.prefill(part)
        assert_close(got, want, f"{preset}: prefill part {i} ({len(part)} tokens)")
    for step in range(12):
        token = int(np.argmax(want))
        want, got = ref.decode(token), eng.decode(token)
        assert_close(got, want, f"{preset}: decode step {step} (position {ref.position - 1})")
    assert eng.position == ref.position == 312


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_greedy_tokens_match_reference(arch_files, preset, eager):
    """Greedy generation on the device (pipelined, sampled inside the graph) gives the reference's
    tokens. A step whose top two reference logits lie closer than the engine's error could flip; it
    would end the comparison there, with the margin said (a seeded model: it does or does not, always)."""
    model = arch_files[preset]
    ids = prompt(40, model.spec.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, seed=0)
    got = list(cuda(model, 256, eager=eager).generate_ids(ids, params))
    ref = cpu(model, 256)
    ref.prefill(ids[:-1])
    token = int(ids[-1])
    for step, t in enumerate(got):
        logits = ref.decode(token)
        want = int(np.argmax(logits))
        if t != want:
            top2 = np.sort(logits)[-2:]
            margin = float(top2[1] - top2[0])
            assert margin < 1e-3 * float(np.std(logits)), (
                f"{preset}: step {step}: token {t}, reference {want} (top-2 margin {margin:.3e})"
            )
            break
        token = t
    assert len(got) == 16


@pytest.mark.parametrize("preset", list(PRESETS))
def test_plan_says_the_qkv_path(arch_files, preset, capsys):
    """The step plan chooses the QKV path from the spec (data, not a switch in the forward pass):
    `atomflow info MODEL --plan` prints it, and the engine's plan is the same."""
    from atomflow.backends.cuda import plan_for
    from atomflow.cli import main

    model = arch_files[preset]
    path = PRESETS[preset]
    plan = plan_for(model, 1024)
    assert plan["qkv_path"] == path
    qkv = next(r for r in plan["products"] if (r["product"], r["when"]) == ("qkv", "decode"))
    assert qkv["kernel"].startswith("gemv_w8a16<RopeKV" if path == "fused" else "gemv_w8a16<Store")
    # Qwen2's q/k/v biases take the fused product's bias instance; every other model the one without
    assert qkv["kernel"].endswith(", bias>") == (preset == "qwen2-g2"), qkv["kernel"]
    # the split path's decode attention takes the product's raw row (attention_qkv's policy)
    for row in plan["attention"]:
        # the instance it launches: qwen3-d128's 4 heads per kv head on two blocks of 2 (halved)
        want = "attention_kernel<HeadMapped<RopedKV>, 128, 2, 1>" if path == "attention" else "attention_kernel<ContiguousKV"
        assert row["kernel"].startswith(want), row["kernel"]
        assert row["halved"] == (path == "attention")  # AttnPlan::halved: the roped model's every path
    # a halved plan's splits stop at 32 (two blocks per kv head: the unhalved plan's grid), others at 64
    long = next(r for r in plan_for(model, 2048)["attention"] if r["when"] == "decode")
    assert long["keys"] == 2048 and long["splits"] == (32 if path == "attention" else 64)
    # a chunk of a few rows (a verify's) fuses RoPE + KV append into its small-M QKV product where the
    # decode step does
    assert plan["prefill_small_m_rope"] == (path == "fused")
    # and so does a skinny chunk's (5..32 rows; no per-head q/k norm there either)
    assert plan["prefill_skinny_rope"] == (path == "fused" and plan["prefill_skinny_max_rows"] is not None)
    eng = cuda(model, 1024)
    assert eng.step_plan["qkv_path"] == path
    assert main(["info", str(model.path), "--plan", "--max-context", "1024"]) == 0
    assert f"qkv path    {path}:" in capsys.readouterr().out


def test_llama_keeps_the_fused_path(tiny_model_file):
    from atomflow.backends.cuda import plan_for

    with AtomflowFile(tiny_model_file) as m:
        plan = plan_for(m, 1024)
    assert plan["qkv_path"] == "fused"
    qkv = next(r for r in plan["products"] if (r["product"], r["when"]) == ("qkv", "decode"))
    assert qkv["kernel"].startswith("gemv_w8a16<RopeKV") and not qkv["kernel"].endswith(", bias>")


@pytest.mark.parametrize("preset", ["qwen2-g2", "qwen3-d128"])
def test_probed_steps_match_reference(arch_files, preset):
    """The validator's probed prefill and decode (the norms apart, rope_kv_append for the QKV extras)."""
    model = arch_files[preset]
    ids = prompt(20, model.spec.vocab_size, seed=4)
    ref, eng = cpu(model, 64), cuda(model, 64)
    want, got = ref.probed_prefill(ids), eng.probed_prefill(ids)
    assert_close(got["logits"][-1], want["logits"][-1], f"{preset}: probed prefill logits")
    token = int(np.argmax(want["logits"][-1]))
    want, got = ref.probed_decode(token), eng.probed_decode(token)
    assert_close(got["logits"][-1], want["logits"][-1], f"{preset}: probed decode logits")
    for layer in range(model.spec.num_layers):  # a layer's output alone: a looser bound, a wrong head fails it
        cos, _ = cos_rel(got[f"attn_out.{layer}"][-1], want[f"attn_out.{layer}"][-1])
        assert cos >= 0.999, f"{preset}: attn_out.{layer} cosine {cos:.6f}"


def test_extra_tensors_are_checked_at_load(arch_files):
    """A file whose bqkv / q_norm / k_norm is missing, mis-shaped, or present without its spec field
    is refused before anything is allocated, naming the tensor and the field."""
    from atomflow import _core

    def load(model, table, **spec_over):
        spec = dict(model.spec.to_dict(), **spec_over)
        return _core.Engine(str(model.path), spec, table, model.spec.rope_inv_freq(), 64, verbose=False)

    q2, q3 = arch_files["qwen2-g2"], arch_files["qwen3-d128"]
    table = [t for t in q2.tensor_table() if t["name"] != "layers.1.bqkv"]
    with pytest.raises(ValueError, match=r"no tensor 'layers\.1\.bqkv'.*attention_bias"):
        load(q2, table)
    with pytest.raises(ValueError, match=r"'layers\.0\.bqkv' but the spec's attention_bias is false"):
        load(q2, q2.tensor_table(), attention_bias=False)
    table = [t for t in q3.tensor_table() if t["name"] != "layers.0.k_norm"]
    with pytest.raises(ValueError, match=r"no tensor 'layers\.0\.k_norm'.*qk_norm"):
        load(q3, table)
    table = [dict(t, dtype="F32", nbytes=2 * t["nbytes"]) if t["name"] == "layers.0.q_norm" else t for t in q3.tensor_table()]
    with pytest.raises(ValueError, match=r"'layers\.0\.q_norm' is F32"):
        load(q3, table)
    with pytest.raises(ValueError, match=r"'layers\.0\.q_norm' but the spec's qk_norm is false"):
        load(q3, q3.tensor_table(), qk_norm=False)


def test_sandbox_refuses_the_qwen_extras(arch_files):
    from atomflow.errors import UnsupportedModelError
    from atomflow.sandbox.model import SandboxModel

    for preset in ("qwen2-g2", "qwen3-d128"):
        with pytest.raises(UnsupportedModelError) as e:
            SandboxModel.load(arch_files[preset].path, max_batch=1, max_context=64)
        assert "sandbox runs Llama and Mistral models only" in str(e.value) and "\n" not in str(e.value)
