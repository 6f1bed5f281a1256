"""tools/timeline.py's bookkeeping, on made-up kernel intervals (the CUPTI part needs a GPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import timeline  # noqa: E402

QKV = "void atomflow::kernels::gemv_w8a16_kernel<(atomflow::kernels::Ep)3, (atomflow::kernels::In)2, true>(...)"
ADD = "void atomflow::kernels::gemv_w8a16_kernel<(atomflow::kernels::Ep)1, (atomflow::kernels::In)1, true>(...)"
HEAD = "void atomflow::kernels::gemv_w8a16_kernel<(atomflow::kernels::Ep)0, (atomflow::kernels::In)2, false>(...)"
ATTN = "void atomflow::kernels::attention_kernel<atomflow::kernels::ContiguousKV, 128, 3, 1>(...)"


def test_charges_add_up_to_the_step_span_whatever_overlaps():
    # qkv 0-10; attention starts early (PDL) at 8, ends 14; o starts at 12, ends 15; down 15-20.
    step = [(0.0, 10.0, QKV), (8.0, 14.0, ATTN), (12.0, 15.0, ADD), (15.0, 20.0, ADD)]
    rows = timeline.charge(step)
    assert [r["label"] for r in rows] == ["gemv qkv+norm+rope", "attention_kernel", "gemv o", "gemv down"]
    assert [r["charged"] for r in rows] == [10.0, 4.0, 1.0, 5.0]
    assert sum(r["charged"] for r in rows) == 20.0
    assert [r["gap"] for r in rows] == [0.0, -2.0, -2.0, 0.0]
    assert [r["duration"] for r in rows] == [10.0, 6.0, 3.0, 5.0]


def test_a_kernel_inside_anothers_shadow_is_charged_nothing():
    rows = timeline.charge([(0.0, 10.0, QKV), (2.0, 5.0, ATTN)])
    assert [r["charged"] for r in rows] == [10.0, 0.0]


def test_labels():
    assert timeline.label(HEAD, 0) == "lm_head"
    assert timeline.label(HEAD.replace("false>", "false, true>"), 0) == "lm_head"  # the tail-group instance
    bias = QKV.replace("true>", "true, false, true>")  # the QKV product with Qwen2's biases
    assert timeline.label(bias, 0) == "gemv qkv+norm+rope"
    assert timeline.label(ADD, 0) == "gemv o" and timeline.label(ADD, 1) == "gemv down"
    assert timeline.label("void atomflow::kernels::sample_kernel<(int)1>(float const*)", 0) == "sample_kernel"
    anon = "void atomflow::kernels::(anonymous namespace)::attention_prefill_kernel<128, 2>(atomflow::kernels::PfArgs)"
    assert timeline.label(anon, 0) == "attention_prefill_kernel"


def skinny(ep: int) -> str:
    return (
        "void atomflow::kernels::(anonymous namespace)::gemm_skinny_kernel<4, (atomflow::kernels::Epilogue)"
        f"{ep}, (atomflow::kernels::Act)1, false>(atomflow::kernels::(anonymous namespace)::SkArgs)"
    )


def test_a_prompt_chunks_skinny_products_are_named_by_their_place():
    # Two layers of a prompt chunk: qkv+rope, attention, o, norm, gate_up, down each.
    layer = [skinny(3), ATTN, skinny(1), "void atomflow::kernels::rmsnorm_kernel<256>(...)", skinny(2), skinny(1)]
    step = [(float(i), float(i + 1), name) for i, name in enumerate(layer + layer)]
    want = ["skinny qkv+rope", "attention_kernel", "skinny o", "rmsnorm_kernel", "skinny gate_up", "skinny down"]
    assert [r["label"] for r in timeline.charge(step)] == want + want


def test_timeline_rejects_a_bad_option(capsys):
    """--option takes NAME=0|1 and says so before it needs a GPU."""
    with pytest.raises(SystemExit) as e:
        timeline.main(["model.atomflow", "--prefill", "32", "--option", "skinny_norm"])
    assert e.value.code == 2
    assert "NAME=0 or NAME=1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a name the plan does not have, before loading anything
        timeline.main(["model.atomflow", "--prefill", "32", "--option", "skiny_norm=0"])
    assert e.value.code == 2
    assert "unknown plan option 'skiny_norm'" in capsys.readouterr().err


def test_plan_option_parses_the_tools_flag():
    """`--option NAME=0|1` (timeline.py, prefill_profile.py, prefill_recipe_quality.py) -> (NAME, on), NAME one
    of the CUDA backend's plan options."""
    from atomflow.backends.cuda import PLAN_OPTIONS, plan_option

    assert plan_option("skinny_norm=0") == ("skinny_norm", False)
    assert plan_option("gemm_pdl=1") == ("gemm_pdl", True)
    assert all(plan_option(f"{n}=1") == (n, True) for n in PLAN_OPTIONS)
    for bad in ("skinny_norm", "skinny_norm=2", "skinny_norm=true", "=1", "nope=1"):
        with pytest.raises(ValueError, match="--option"):
            plan_option(bad)
