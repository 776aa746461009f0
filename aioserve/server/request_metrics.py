"""The metrics the HTTP side observes as requests run: latency histograms,
finish reasons, errors by type, and the event loop's lag.

Names and units follow vLLM's `vllm:*` family (seconds, `_bucket/_sum/_count`
histograms, `finished_reason` labels) so that existing dashboards need only
the prefix changed. One registry per app: two servers in one process (tests)
do not share counts. The scheduler's own counters and gauges are read at
scrape time by endpoints/metrics.py, into the same registry.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.requests import Request
from starlette.types import Scope

logger = logging.getLogger(__name__)

# Bucket edges in seconds: from a fast CPU/GPU token up to the slowest
# prompt a 2-core machine queues behind a full batch.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10, 20)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

LOOP_LAG_INTERVAL_S = 0.05  # how often the lag timer wakes: its cost is a few µs per wake


class RequestMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=self.registry, buckets=buckets).labels(model_name)

        self.time_to_first_token = histogram(
            "aioserve:time_to_first_token_seconds", "From the request's arrival to its first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "aioserve:inter_token_latency_seconds", "Between two tokens of one choice.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "aioserve:e2e_request_latency_seconds", "From the request's arrival to its last token.", E2E_BUCKETS
        )
        self.request_queue_time = histogram(
            "aioserve:request_queue_time_seconds", "From submission to first admission (waiting for KV).",
            E2E_BUCKETS,
        )
        self.event_loop_lag = histogram(
            "aioserve:event_loop_lag_seconds",
            f"How late the event loop woke a {LOOP_LAG_INTERVAL_S * 1000:.0f} ms timer: what every stream, "
            "health check and new request waited.", LAG_BUCKETS,
        )
        self._success = Counter(
            "aioserve:request_success", "Choices finished, by reason (stop, length, abort, error).",
            [*labels, "finished_reason"], registry=self.registry,
        )
        self._errors = Counter(
            "aioserve:request_errors", "Error responses and stream error events, by error.type and status.",
            [*labels, "error_type", "status"], registry=self.registry,
        )
        self._pooling_requests = Counter(
            "aioserve:pooling_requests", "Pooling requests (embeddings, rerank, score) answered, by endpoint.",
            [*labels, "endpoint"], registry=self.registry,
        )
        self._pooling_inputs = Counter(
            "aioserve:pooling_inputs", "Texts (or pairs) those requests pooled, by endpoint.",
            [*labels, "endpoint"], registry=self.registry,
        )
        self._pooling_tokens = Counter(
            "aioserve:pooling_prompt_tokens", "Prompt tokens those requests computed, by endpoint.",
            [*labels, "endpoint"], registry=self.registry,
        )
        self._model_name = model_name

    def finished(self, reason: str) -> None:
        self._success.labels(self._model_name, reason).inc()

    def pooled(self, endpoint: str, inputs: int, tokens: int) -> None:
        self._pooling_requests.labels(self._model_name, endpoint).inc()
        self._pooling_inputs.labels(self._model_name, endpoint).inc(inputs)
        self._pooling_tokens.labels(self._model_name, endpoint).inc(tokens)

    def error(self, error_type: str, status: int) -> None:
        self._errors.labels(self._model_name, error_type, str(status)).inc()

    async def watch_loop_lag(self, interval: float = LOOP_LAG_INTERVAL_S) -> None:
        """Sleep `interval` forever and record how late each wake-up came:
        anything that holds the loop shows here at once."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(interval)
            lag = max(0.0, loop.time() - start - interval)
            self.event_loop_lag.observe(lag)
            if lag > 1.0:
                logger.warning("the event loop was held %.2f s", lag)


def stamp_arrival(scope: Scope) -> None:
    """Called first thing for every HTTP request (endpoints/app.py's ServingGate)."""
    scope.setdefault("state", {})["arrival"] = time.monotonic()


def arrival_time(request: Request) -> float:
    """When the request came in (time.monotonic, the scheduler's clock too),
    so that time to first token counts reading and tokenizing it."""
    return request.scope.get("state", {}).get("arrival", time.monotonic())
