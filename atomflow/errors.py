"""The exceptions the front raises for bad input. The CLI prints each as one line and exits 1."""


class AtomflowError(Exception):
    """Base class: an error the user can act on (bad file, bad model, bad argument)."""


class FormatError(AtomflowError, ValueError):
    """A .atomflow file that is not one, is truncated, corrupt or inconsistent."""


class UnsupportedModelError(AtomflowError, ValueError):
    """A model the engine cannot run (architecture, head_dim, rope type, ...)."""


class BackendUnavailableError(AtomflowError, RuntimeError):
    """The requested backend cannot run here (no CUDA core built, no GPU)."""


class ChatTemplateError(AtomflowError, ValueError):
    """A model's chat template that does not compile or fails to render a conversation."""


class NonFiniteLogitsError(AtomflowError, ValueError):
    """Logits with NaN or Inf: the weights (or their scales) hold values the engine cannot use."""

    def __init__(self, message: str, position: int | None = None):
        super().__init__(message)
        self.position = position


class OutputPathError(AtomflowError, ValueError):
    """An output path that cannot be written (a directory, an existing file without --force, ...)."""


class InterruptedBySignal(KeyboardInterrupt):
    """A catchable signal arrived during a job that cleans up after itself (quantize). A
    KeyboardInterrupt, not an AtomflowError, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal_name(signum)}")


def signal_name(signum: int) -> str:
    """SIGTERM, ..., and SIGRTMIN+n for the real-time signals (which signal.Signals does not name)."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}"
