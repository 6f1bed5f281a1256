"""Runs `atomflow serve` as a real process on a free loopback port for the server tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


class Server:
    """`with Server(model_file, tmp_path, "--queue", "4") as s:` -> s.url, s.get(...), s.rss_kib().
    Port 0: uvicorn picks a free port, read back from its log line."""

    def __init__(self, model, log_dir: Path, *args: str, api_key: str | None = None, ready_s: float = 90):
        self.key = api_key
        self.log_path = Path(log_dir) / f"serve-{os.getpid()}-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "atomflow.cli", "serve", str(model), "--port", "0", "--backend", "cpu", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {
            **os.environ,  # as tests/test_cli.py: the atomflow that the tests import (PYTHONPATH or installed)
            # BLAS on one thread: the event loop needs a core, and on a small shared machine a BLAS
            # pool spinning against it stalls a CPU prefill by hundreds of ms.
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        }
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.url = self._wait_ready(ready_s)

    def _wait_ready(self, limit: float) -> str:
        t0, url = time.monotonic(), None
        while time.monotonic() - t0 < limit:
            if self.proc.poll() is not None:
                raise RuntimeError(f"atomflow serve exited {self.proc.returncode}:\n{self.log()}")
            if url is None:
                m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", self.log())
                url = m.group(1) if m else None
            if url is not None:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"atomflow serve not ready after {limit} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=30, **kw)

    def post(self, path: str, json=None, **kw) -> httpx.Response:
        return httpx.post(
            self.url + path, json=json, headers={**self.headers, **kw.pop("headers", {})}, timeout=kw.pop("timeout", 60), **kw
        )

    def metric(self, name: str) -> float:
        """The value of an unlabelled metric (a counter's _total) from /metrics."""
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def wait_idle(self, limit: float) -> float:
        """Seconds until /health says the engine is free (raises past `limit`)."""
        with httpx.Client(timeout=5) as c:  # one client: a new one per poll costs more than a step
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < limit:
                h = c.get(self.url + "/health").json()
                if not h["busy"] and not h["queued"]:
                    return time.perf_counter() - t0
                time.sleep(0.002)
        raise AssertionError(f"the engine still busy after {limit} s")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
