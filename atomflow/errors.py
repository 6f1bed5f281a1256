"""The exceptions the front raises for bad input. The CLI prints each as one line and exits 1."""


class AtomflowError(Exception):
    """Base class: an error the user can act on (bad file, bad model, bad argument)."""


class FormatError(AtomflowError, ValueError):
    """A .atomflow file that is not one, is truncated, corrupt or inconsistent."""


class UnsupportedModelError(AtomflowError, ValueError):
    """A model the engine cannot run (architecture, head_dim, rope type, ...)."""


class BackendUnavailableError(AtomflowError, RuntimeError):
    """The requested backend cannot run here (no CUDA core built, no GPU)."""
