"""One engine, one thread, one stream at a time: a bounded FIFO of jobs in front of the Engine.

The asyncio side submits a Job and reads its events from an asyncio.Queue; the engine thread
runs jobs in arrival order, posting events through loop.call_soon_threadsafe:
  ("start",)              the run began (the job left the queue)
  ("text", str)           one token's new text (UTF-8 safe, stop strings cut; "" while a
                          character or a possible stop string is incomplete, so that a stream
                          shows every token's timing, even of ids the tokenizer lacks)
  ("done", Result)        the run ended
  ("error", ApiError)     it could not run
Cancellation is a flag the generation loop reads after every token: set it and the run ends
within a step, closing the engine's generator (which ends the CUDA pipeline and leaves the
cache holding what was computed, for the next request's prefix reuse).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from atomflow.model.tokenizer import IncrementalDecoder
from atomflow.sampling import SamplingParams, StopChecker
from atomflow.serve.metrics import Metrics
from atomflow.serve.protocol import ApiError

log = logging.getLogger("atomflow.serve")


@dataclass
class Result:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length | cancelled
    ttft_s: float  # arrival to first token
    decode_s: float  # first token to last


class Job:
    def __init__(self, ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop):
        self.ids, self.params, self.loop = ids, params, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.cancel_time: float | None = None
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Thread-safe; the engine thread stops this job's run at its next token (or skips it)."""
        if not self._cancel.is_set():
            self.cancel_time = time.perf_counter()
            self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def post(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass


class EngineWorker:
    """load: () -> Engine, called on the engine thread. max_queue: jobs that may wait."""

    def __init__(self, load: Callable, max_queue: int, metrics: Metrics):
        self._load, self.max_queue, self.metrics = load, max_queue, metrics
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self.engine = None
        self.load_error: str | None = None
        self.current: Job | None = None
        self.loaded = threading.Event()  # set when the engine is ready or failed to load
        self._thread = threading.Thread(target=self._main, name="atomflow-engine", daemon=True)

    # -- the asyncio side ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            for job in self._queue:
                job.cancel()
            self._queue.clear()
            if self.current is not None:
                self.current.cancel()
            self._cv.notify_all()
        self._thread.join(timeout=10)

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def busy(self) -> bool:
        return self.current is not None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, job: Job) -> None:
        """Queues the job, or raises the 503 to answer when max_queue jobs already wait."""
        with self._cv:
            idle = self.current is None and not self._queue and self.ready  # it starts at once: no place taken
            if len(self._queue) >= self.max_queue and not idle:
                self.metrics.rejected.labels("queue_full").inc()
                raise ApiError(
                    503,
                    f"the server is busy: {self.max_queue} requests are already waiting (--queue); retry later",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._cv.notify()

    def withdraw(self, job: Job) -> bool:
        """Takes a job that has not started out of the queue; False if it already started."""
        with self._cv:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
            self.metrics.queue_depth.set(len(self._queue))
            return True

    # -- the engine thread --------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.engine = self._load()
        except Exception as e:  # reported by /health and the CLI
            self.load_error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.error("loading the model failed: %s", self.load_error)
            return
        finally:
            self.loaded.set()
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self.current = self._queue.popleft()
                self.metrics.queue_depth.set(len(self._queue))
            try:
                if not job.cancelled:
                    self.metrics.running.set(1)
                    self._run(job)
            except Exception:
                log.exception("the engine failed on a request")
                job.post("error", ApiError(500, "the engine failed on this request (see the server log)"))
            finally:
                with self._cv:
                    self.current = None
                self.metrics.running.set(0)

    def _run(self, job: Job) -> None:
        m, eng, params = self.metrics, self.engine, job.params
        start = time.perf_counter()
        m.queue_wait.observe(start - job.arrival)
        job.post("start")
        decoder, stopper = IncrementalDecoder(eng.tokenizer), StopChecker(params.stop)
        tokens = eng.generate_tokens(job.ids, params, reuse_prefix=True)
        n, finish, t_first, t_last = 0, None, None, start
        try:
            for token in tokens:
                if job.cancelled:
                    finish = "cancelled"
                    break
                n += 1
                t_last = time.perf_counter()
                if n == 1:
                    t_first = t_last
                    m.ttft.observe(t_first - job.arrival)
                text, stopped = stopper.feed(decoder.feed(token))
                if text or not stopped:
                    job.post("text", text)
                if stopped:
                    finish = "stop"
                    break
        finally:
            tokens.close()  # ends the backend's run: the engine is free
        st = eng.stats
        m.prompt_tokens.inc(st.prompt_tokens)
        m.reused_tokens.inc(st.reused_tokens)
        m.prefilled_tokens.inc(st.prefilled_tokens)
        m.generated_tokens.inc(n)
        if n > 1:
            m.tpot.observe((t_last - t_first) / (n - 1))
        if finish == "cancelled":
            m.cancelled.inc()
            m.cancel_latency.observe(time.perf_counter() - job.cancel_time)
            return
        if finish is None:
            text, _ = stopper.feed(decoder.flush())
            text += stopper.flush()
            if text:
                job.post("text", text)
            finish = "stop" if st.stop_reason == "eos" else "length"
        job.post(
            "done",
            Result(
                st.prompt_tokens, st.reused_tokens, n, finish, (t_first or t_last) - job.arrival, t_last - (t_first or t_last)
            ),
        )
