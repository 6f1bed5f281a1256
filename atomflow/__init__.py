"""atomflow: a single-stream FP8 LLM decode engine. CUDA kernels do the work; this is the front."""

__version__ = "0.1.0"

from atomflow.errors import AtomflowError, BackendUnavailableError, FormatError, UnsupportedModelError  # noqa: E402
from atomflow.model.spec import ModelSpec  # noqa: E402


def __getattr__(name):  # Engine and SamplingParams pull in tokenizers/jinja2: import on first use
    if name == "Engine":
        from atomflow.engine import Engine

        return Engine
    if name == "SamplingParams":
        from atomflow.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)


__all__ = [
    "Engine",
    "SamplingParams",
    "ModelSpec",
    "AtomflowError",
    "FormatError",
    "UnsupportedModelError",
    "BackendUnavailableError",
    "__version__",
]
