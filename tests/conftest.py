"""Shared fixtures: a tiny random Llama (HF directory) and its quantized .atomflow file, made
once per session; GPU tests skipped cleanly where there is no CUDA core or no GPU."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    """Import tools/<name>.py as a module (tools/ is scripts, not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _cuda_status() -> tuple[bool, str]:
    from atomflow.device import cuda_status

    return cuda_status()


def pytest_collection_modifyitems(config, items):
    ok, why = _cuda_status()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"gpu: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def make_tiny_model():
    return load_tool("make_tiny_model")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, make_tiny_model) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny"
    make_tiny_model.make_model(out, preset="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_model_file(tmp_path_factory, tiny_hf_dir) -> Path:
    from atomflow.model.quantize import quantize

    out = tmp_path_factory.mktemp("model") / "tiny.atomflow"
    quantize(tiny_hf_dir, out, progress=False, log=lambda s: None)
    return out


@pytest.fixture(scope="session")
def arch_model(tmp_path_factory):
    """(preset, seed) -> (HF directory, quantized .atomflow path) of tools/make_tiny_arch.py's random
    model of that architecture preset, made on first use and kept for the session."""
    from atomflow.model.quantize import quantize

    made: dict[tuple[str, int], tuple[Path, Path]] = {}

    def get(preset: str, seed: int) -> tuple[Path, Path]:
        if (preset, seed) not in made:
            hf = load_tool("make_tiny_arch").make_arch_model(tmp_path_factory.mktemp(preset) / "hf", preset, seed=seed)
            path = hf.parent / "m.atomflow"
            quantize(hf, path, progress=False, log=lambda s: None)
            made[preset, seed] = (hf, path)
        return made[preset, seed]

    return get


@pytest.fixture(scope="session")
def loud(tmp_path_factory, make_tiny_model):
    """The tiny model with every post-attention norm weight x 300: gate and up ~300x larger, so
    SwiGLU's output passes fp16's range in every decode step (bf16 holds it)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from atomflow.model.fileformat import AtomflowFile
    from atomflow.model.quantize import quantize

    root = tmp_path_factory.mktemp("loud")
    hf = make_tiny_model.make_model(root / "hf", preset="tiny", seed=0, dtype="fp32")
    for f in hf.glob("*.safetensors"):
        t = load_file(f)
        for name in t:
            if name.endswith("post_attention_layernorm.weight"):
                t[name] = t[name] * np.float32(300)
        save_file(t, f, metadata={"format": "pt"})
    quantize(hf, root / "loud.atomflow", progress=False, log=lambda s: None)
    return AtomflowFile(root / "loud.atomflow")


@pytest.fixture
def rng():
    """A fresh generator per test, its seed printed (replay: ATOMFLOW_TEST_SEED=...)."""
    import numpy as np

    seed = int(os.environ.get("ATOMFLOW_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"rng seed {seed} (replay: ATOMFLOW_TEST_SEED={seed})")
    return np.random.default_rng(seed)
