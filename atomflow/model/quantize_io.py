"""What quantize reads and writes, checked: the model directory's JSON files, index and shards
(every one it cannot take is a one-line UnsupportedModelError naming the file), the output path
(before any work), the temporaries of killed runs, and the signals that must not leave one behind."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import threading
from pathlib import Path

from safetensors import safe_open

from atomflow.errors import InterruptedBySignal, OutputPathError, UnsupportedModelError
from atomflow.model import filecheck
from atomflow.model.spec import ModelSpec


def weight_map(index: Path) -> dict[str, str]:
    """The index's weight_map: tensor name -> a shard file in the same directory."""
    d = read_json_object(index)
    wm = d.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise UnsupportedModelError(f"{index}: no weight_map (an object of tensor name -> shard file)")
    for name, shard in wm.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise UnsupportedModelError(
                f"{index}: weight_map[{name!r}] must name a file in the same directory, got {shard!r:.60}"
            )
    return wm


@contextlib.contextmanager
def open_shard(path: Path):
    """safe_open, its errors (not safetensors, truncated, ...) one line naming the shard."""
    try:
        f = safe_open(path, "numpy")
    except Exception as e:  # safetensors raises SafetensorError (an Exception) and OSError
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UnsupportedModelError(f"{path}: not a readable safetensors file ({msg[:120]})") from None
    with f:
        yield f


def read_json_object(path: Path, missing_ok: bool = False) -> dict:
    """A JSON object from `path` ({} when missing and missing_ok); else one-line UnsupportedModelError."""
    if missing_ok and not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UnsupportedModelError(f"{path}: not valid JSON ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(d, dict):
        raise UnsupportedModelError(f"{path}: must hold a JSON object, got a {type(d).__name__}")
    return d


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UnsupportedModelError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def generation_config(hf_dir: Path, config: dict, gen: dict, vocab: int) -> dict:
    """The file's generation_config from generation_config.json (and config.json's ids): EOS and
    BOS ids in the vocab, default sampling values the sampler takes, else a one-line error."""

    def where(key: str) -> Path:
        return hf_dir / ("generation_config.json" if key in gen else "config.json")

    def token_id(key: str, v) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
            raise UnsupportedModelError(f"{where(key)}: {key} must be token ids in [0, {vocab}), got {v!r:.60}")
        return v

    eos: list[int] = []
    for src in (gen.get("eos_token_id"), config.get("eos_token_id")):
        for e in src if isinstance(src, list) else [] if src is None else [src]:
            if token_id("eos_token_id", e) not in eos:
                eos.append(e)
    bos = gen.get("bos_token_id", config.get("bos_token_id"))
    out = dict(bos_token_id=None if bos is None else token_id("bos_token_id", bos), eos_token_ids=eos)
    for key, ok, want in (
        ("temperature", lambda v: 0 <= v <= 1e6, "a number >= 0"),
        ("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
        ("top_k", lambda v: isinstance(v, int) and 0 <= v < 2**31, "an integer >= 0"),
    ):
        v = gen.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v)):
            raise UnsupportedModelError(f"{hf_dir / 'generation_config.json'}: {key} must be {want}, got {v!r:.60}")
        out[key] = v
    return out


def check_tokenizer(hf_dir: Path, meta: dict[str, str], spec: ModelSpec) -> None:
    """What the reader will check of the file's metadata, checked now: the tokenizer loads and fits
    the vocab, the chat template renders, the documents have their types."""
    from atomflow.errors import FormatError
    from atomflow.model.tokenizer import checked_tokenizer

    try:
        docs = filecheck.check_documents(hf_dir, meta, spec)
        checked_tokenizer(
            hf_dir / "tokenizer.json",
            meta["tokenizer"],
            docs["tokenizer_config"],
            meta["chat_template"],
            docs["generation_config"],
            spec.vocab_size,
        )
    except FormatError as e:
        raise UnsupportedModelError(str(e)) from None


def check_output_path(out: str | Path, hf_dir: Path, force: bool = False) -> Path:
    """Before any work: `out` must be a file path in a writable directory, not a file of the source
    model, and not an existing file unless force."""
    if not str(out).strip():
        raise OutputPathError("no output file given (the path is empty)")
    out = Path(out)
    if out.is_dir():
        raise OutputPathError(f"{out}: is a directory; name the output file (e.g. {out / 'model.atomflow'})")
    parent = out.parent
    if not parent.is_dir():
        raise OutputPathError(f"{out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{out}: directory {parent} is not writable")
    if out.exists():
        for f in hf_dir.iterdir() if hf_dir.is_dir() else [hf_dir]:  # a directory, or one .gguf file
            with contextlib.suppress(OSError):
                if f.is_file() and os.path.samefile(f, out):
                    raise OutputPathError(f"{out}: is {f.name} of the source model {hf_dir}; choose another output path")
        if not out.is_file():
            raise OutputPathError(f"{out}: exists and is not a regular file")
        if not force:
            raise OutputPathError(f"{out}: exists; pass --force to overwrite it")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def sweep_stale_temps(out: Path, log) -> list[Path]:
    """Removes OUT.tmp-<pid> files left by quantize runs to the same output that are gone (killed
    by SIGKILL, the machine lost power): nothing else can remove them."""
    removed = []
    for p in out.parent.glob(glob.escape(out.name) + ".tmp-*"):
        pid = p.name.rsplit(".tmp-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)) and p.is_file():
            p.unlink(missing_ok=True)
            removed.append(p)
            log(f"atomflow: removed {p}, the temporary file of an interrupted quantize (pid {pid})")
    return removed


# Signals whose default action ends the process and that a handler can catch (SIGKILL and
# SIGSTOP cannot be; SIGPIPE and SIGXFSZ Python ignores, so a write fails with an exception instead;
# the synchronous faults SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT are not for Python handlers).
CLEANUP_SIGNALS = tuple(
    getattr(signal, n)
    for n in (
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGTERM",
        "SIGUSR1",
        "SIGUSR2",
        "SIGALRM",
        "SIGXCPU",
        "SIGVTALRM",
        "SIGPROF",
        "SIGIO",
        "SIGPWR",
    )
    if hasattr(signal, n)
) + tuple(range(signal.SIGRTMIN, signal.SIGRTMAX + 1))


@contextlib.contextmanager
def raise_on_signals():
    """Inside: each catchable signal (CLEANUP_SIGNALS) that would end the process raises
    InterruptedBySignal in the main thread instead, so the temporary file is removed on the way
    out; after the first, the rest are ignored until the cleanup is done. Signals the caller
    ignores (nohup) stay ignored. Only the main thread can install handlers: elsewhere, no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {}

    def handler(signum, frame):
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        raise InterruptedBySignal(signum)

    for s in CLEANUP_SIGNALS:
        with contextlib.suppress(OSError, ValueError):
            if signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler):
                old[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def signal_behind(e: BaseException) -> InterruptedBySignal | None:
    """The InterruptedBySignal that `e` is, or that it arose while handling (its __cause__ /
    __context__ chain), else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, InterruptedBySignal):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def check_spec(hf_dir: Path, spec: ModelSpec, weight_map: dict[str, str]) -> None:
    """Before a tensor table is built from config.json: its sizes within the reader's bounds (it
    would refuse the file) and its layer count the checkpoint's, so an absurd config costs
    nothing."""
    for name, limit in filecheck.SPEC_LIMITS.items():
        v = getattr(spec, name, None)
        if isinstance(v, int) and v > limit:
            raise UnsupportedModelError(f"{hf_dir / 'config.json'}: {name} {v} is past what atomflow reads ({limit})")
    layers = {int(k.split(".")[2]) for k in weight_map if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    if layers and (len(layers) != spec.num_layers or max(layers) != spec.num_layers - 1):
        raise UnsupportedModelError(
            f"{hf_dir / 'config.json'}: num_hidden_layers {spec.num_layers}, but the checkpoint holds {len(layers)} layers"
        )
