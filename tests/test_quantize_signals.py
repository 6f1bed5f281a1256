"""An interrupted quantize leaves nothing behind: each catchable signal that would end the process
(quantize_io.CLEANUP_SIGNALS) makes it remove its OUT.tmp-<pid> and exit 128 + signum with one line;
SIGKILL cannot be caught, so the next quantize to the same output sweeps the stale temporary.

The writer is slowed (a sleep per write) so that the signal lands mid-file. Every signal runs in a
child forked from this process (cheap: no interpreter start); SIGTERM, SIGINT and SIGKILL also
run against the real command in a subprocess."""

import os
import signal
import subprocess
import sys
import time

import pytest

from atomflow.errors import signal_name
from atomflow.model.quantize_io import CLEANUP_SIGNALS

SLOW_WRITER = """
import signal, sys, time
import atomflow.model.fileformat as ff
from atomflow.model.quantize_io import CLEANUP_SIGNALS
write = ff.FileWriter.write
def slow(self, name, a):
    time.sleep(0.05)
    return write(self, name, a)
ff.FileWriter.write = slow
for s in CLEANUP_SIGNALS:  # whatever the test runner's shell left ignored, these start at their defaults
    signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
"""


def _wait_for_temp(outdir, proc_alive, limit=30.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        tmps = list(outdir.glob("m.atomflow.tmp-*"))
        if tmps:
            return tmps[0]
        assert proc_alive(), "quantize ended before its temporary file appeared"
        time.sleep(0.005)
    raise AssertionError("no temporary file appeared")


def _forked_quantize(hf, outdir, errfile):
    pid = os.fork()
    if pid == 0:  # child: the CLI's code path, slowed, stderr to a file
        code = 99
        try:
            sys.stderr = open(errfile, "w")  # noqa: SIM115 - pytest's capture is not the child's
            exec(SLOW_WRITER, {})
            from atomflow.cli import main

            code = main(["quantize", str(hf), "-o", str(outdir / "m.atomflow"), "-q"])
        finally:
            sys.stderr.flush()
            os._exit(code)
    return pid


def test_every_catchable_signal_removes_the_temporary(tiny_hf_dir, tmp_path):
    sigs = list(CLEANUP_SIGNALS)
    assert {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT} <= set(sigs)
    failures = []
    for i in range(0, len(sigs), 8):  # eight at a time
        running = []
        for s in sigs[i : i + 8]:
            d = tmp_path / f"sig{int(s)}"
            d.mkdir()
            pid = _forked_quantize(tiny_hf_dir, d, tmp_path / f"err{int(s)}")
            running.append((s, pid, d))
        for s, pid, d in running:
            _wait_for_temp(d, lambda pid=pid: os.waitpid(pid, os.WNOHANG) == (0, 0))
            os.kill(pid, s)
        for s, pid, d in running:
            _, status = os.waitpid(pid, 0)
            err = (tmp_path / f"err{int(s)}").read_text()
            name = signal_name(s)
            if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == (128 + s) % 256):
                failures.append(f"{name}: status {status}, stderr {err!r}")
            elif err.strip() != f"atomflow: error: interrupted by {name}; nothing was written":
                failures.append(f"{name}: stderr {err!r}")
            elif os.listdir(d):
                failures.append(f"{name}: left {os.listdir(d)}")
    assert not failures, failures
    assert not list(tiny_hf_dir.glob("*.tmp-*"))


def _cli_quantize(hf, out, slow=True):
    code = (SLOW_WRITER if slow else "") + "from atomflow.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", "import sys\n" + code, "quantize", str(hf), "-o", str(out), "-q"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_real_command_signal(tiny_hf_dir, tmp_path, sig):
    p = _cli_quantize(tiny_hf_dir, tmp_path / "m.atomflow")
    _wait_for_temp(tmp_path, lambda: p.poll() is None)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, err
    assert err.strip().splitlines() == [f"atomflow: error: interrupted by {signal.Signals(sig).name}; nothing was written"]
    assert os.listdir(tmp_path) == []


def test_sigkill_leftover_is_swept_by_the_next_run(tiny_hf_dir, tmp_path):
    out = tmp_path / "m.atomflow"
    p = _cli_quantize(tiny_hf_dir, out)
    stale = _wait_for_temp(tmp_path, lambda: p.poll() is None)
    p.kill()
    p.wait(timeout=60)
    assert stale.exists() and not out.exists()  # SIGKILL: nothing could clean up
    q = _cli_quantize(tiny_hf_dir, out, slow=False)
    _, err = q.communicate(timeout=120)
    assert q.returncode == 0, err
    assert f"removed {stale}" in err
    assert os.listdir(tmp_path) == ["m.atomflow"]


def test_a_signal_that_breaks_a_cleanup_is_still_the_signal(tiny_hf_dir, tmp_path, monkeypatch):
    """A signal that lands inside a library's `try: lock.acquire() ... finally: lock.release()` surfaces
    as that cleanup's RuntimeError ("release unlocked lock"); quantize reports the signal (the CLI's exit
    128 + signum and its one line), and nothing is left behind."""
    import threading

    from atomflow.errors import InterruptedBySignal
    from atomflow.model import quantize as q

    def broken(source, out, *args):
        q.temp_path(out).write_bytes(b"partial")
        lock = threading.Lock()
        try:
            raise InterruptedBySignal(signal.SIGTERM)  # as the handler raises it, before acquire() took the lock
        finally:
            lock.release()  # RuntimeError: release unlocked lock

    monkeypatch.setattr(q, "_quantize", broken)
    out = tmp_path / "m.atomflow"
    with pytest.raises(InterruptedBySignal) as e:
        q.quantize(tiny_hf_dir, out, progress=False, log=lambda s: None)
    assert e.value.signum == signal.SIGTERM
    assert not list(tmp_path.iterdir())
