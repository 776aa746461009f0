"""GET /metrics in Prometheus text format.

Two sources in one registry: the scheduler's gauges and counters, read when
Prometheus scrapes (so counting costs nothing on the hot path), and the
latency histograms and labelled counters the HTTP side observes
(server/request_metrics.py). Names follow vLLM's where one exists.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import Response

from aioserve.scheduler.client import LoraInfo
from aioserve.scheduler.speculation import SpeculationStats
from aioserve.server.context import ServingContext


class SchedulerCollector:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def collect(self) -> Iterator[Metric]:
        info = self.ctx.scheduler.info()
        stats = info.stats
        labels = {"model_name": self.ctx.model_name}

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            metric = GaugeMetricFamily(name, doc, labels=list(labels))
            metric.add_metric(list(labels.values()), value)
            return metric

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            metric = CounterMetricFamily(name, doc, labels=list(labels))
            metric.add_metric(list(labels.values()), value)
            return metric

        yield gauge("aioserve:num_requests_running", "Requests holding KV pages.", info.running)
        yield gauge("aioserve:num_requests_waiting", "Requests queued for admission.", info.waiting)
        yield gauge("aioserve:kv_cache_usage_perc", "Share of KV pages in use (0-1).", info.kv_usage)
        yield counter("aioserve:prompt_tokens", "Prompt tokens of admitted requests.", stats["prompt_tokens"])
        yield counter(
            "aioserve:prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache.", stats["cached_tokens"]
        )
        # vLLM's pair: hits / queries is the cache's hit rate, in tokens.
        yield counter(
            "aioserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats["prompt_tokens"]
        )
        yield counter("aioserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats["cached_tokens"])
        yield counter("aioserve:generation_tokens", "Tokens generated.", stats["generated_tokens"])
        yield counter("aioserve:num_preemptions", "Requests preempted to free KV pages.", stats["preemptions"])
        yield counter("aioserve:request_aborted", "Requests aborted.", stats["aborted"])
        yield counter("aioserve:engine_steps", "Forward steps run.", stats["steps"])
        if info.speculation is not None:
            yield from self._speculation(info.speculation, labels)
        if info.lora is not None:
            yield from self._lora(info.lora, labels)

    @staticmethod
    def _lora(lora: LoraInfo, labels: dict[str, str]) -> Iterator[Metric]:
        """vLLM's lora_requests_info (the adapters with running and waiting
        requests as comma-separated labels, the scrape time as its value),
        then per adapter counts and the slots'."""
        info = GaugeMetricFamily(
            "aioserve:lora_requests_info", "LoRA adapters with running and waiting requests.",
            labels=[*labels, "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric(
            [*labels.values(), ",".join(sorted(lora.running)), ",".join(sorted(lora.waiting)), str(lora.max_loras)],
            time.time(),
        )
        yield info
        for name, doc, counts in (
            ("lora_num_requests_running", "Running requests under each LoRA adapter.", lora.running),
            ("lora_num_requests_waiting", "Waiting requests under each LoRA adapter.", lora.waiting),
        ):
            metric = GaugeMetricFamily(f"aioserve:{name}", doc, labels=[*labels, "lora_name"])
            for adapter in lora.adapters.keys() | counts.keys():
                metric.add_metric([*labels.values(), adapter], counts.get(adapter, 0))
            yield metric
        for name, doc, value, kind in (
            ("lora_adapters_loaded", "LoRA adapters loaded.", len(lora.adapters), GaugeMetricFamily),
            ("lora_slots_in_use", "LoRA slots holding an adapter.", lora.slots_in_use, GaugeMetricFamily),
            ("lora_slot_evictions", "Adapters that left a slot for another.", lora.evictions, CounterMetricFamily),
        ):
            family: GaugeMetricFamily | CounterMetricFamily = kind(f"aioserve:{name}", doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            yield family

    @staticmethod
    def _speculation(spec: SpeculationStats, labels: dict[str, str]) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters, under aioserve's prefix."""
        for name, doc, value in (
            ("spec_decode_num_drafts", "Proposals verified (one per request and step).", spec.drafts),
            ("spec_decode_num_draft_tokens", "Tokens proposed and verified.", spec.draft_tokens),
            ("spec_decode_num_accepted_tokens", "Proposed tokens that stood.", spec.accepted_tokens),
        ):
            metric = CounterMetricFamily(f"aioserve:{name}", doc, labels=list(labels))
            metric.add_metric(list(labels.values()), value)
            yield metric
        per_position = CounterMetricFamily(
            "aioserve:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens that stood, by their position.",
            labels=[*labels, "position"],
        )
        for position, value in enumerate(spec.accepted_per_position):
            per_position.add_metric([*labels.values(), str(position)], value)
        yield per_position

def register_scheduler_metrics(ctx: ServingContext) -> None:
    """The scheduler's gauges and counters join the request metrics' registry."""
    ctx.metrics.registry.register(SchedulerCollector(ctx))


async def metrics(request: Request) -> Response:
    registry = request.app.state.ctx.metrics.registry
    return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")
