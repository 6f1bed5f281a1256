"""The server's Prometheus metrics, in a registry of their own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# seconds: from a fast GPU step (~1 ms) to a long CPU prefill
_TTFT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "atomflow_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("atomflow_prompt_tokens", "prompt tokens of the requests run", registry=r)
        self.reused_tokens = Counter(
            "atomflow_reused_prefix_tokens", "prompt tokens found in the cache (not prefilled again)", registry=r
        )
        self.prefilled_tokens = Counter("atomflow_prefilled_tokens", "prompt tokens run through the model", registry=r)
        self.generated_tokens = Counter("atomflow_generated_tokens", "completion tokens generated", registry=r)
        self.rejected = Counter(
            "atomflow_rejected_requests",
            "requests refused: queue full (503) or timed out in the queue (504)",
            ["reason"],
            registry=r,
        )
        self.cancelled = Counter("atomflow_cancelled_requests", "runs stopped because the client left", registry=r)
        self.ttft = Histogram(
            "atomflow_time_to_first_token_seconds", "arrival to first token (queue wait included)", buckets=_TTFT, registry=r
        )
        self.tpot = Histogram(
            "atomflow_time_per_output_token_seconds",
            "mean time per token after the first, per request",
            buckets=_TPOT,
            registry=r,
        )
        self.queue_wait = Histogram("atomflow_queue_wait_seconds", "arrival to the start of the run", buckets=_TTFT, registry=r)
        self.cancel_latency = Histogram(
            "atomflow_cancel_latency_seconds",
            "the client leaving (as the server saw it) to the engine free",
            buckets=_TPOT + (0.5, 1, 2.5),
            registry=r,
        )
        self.queue_depth = Gauge("atomflow_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("atomflow_running", "requests the engine is running (0 or 1)", registry=r)
