"""`/metrics`: every `MMEngine.stats()` entry as `mmengine_<name>`, the async engine's queue, and
request latency histograms, in Prometheus' text format.

Monotone counts are Prometheus counters (so their sample is `mmengine_<name>_total`, as the
format requires); levels (free blocks, cache sizes, running requests) are gauges. Each server
has its own registry, so several can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmengine.engine.async_engine import AsyncMMEngine, DeltaOutput

# stats() entries that only grow; every other entry is a level (a gauge).
COUNTER_STATS = frozenset({
    "steps", "tokens_computed", "prefill_tokens_computed", "prompt_tokens", "generation_tokens", "requests_finished",
    "num_preemptions", "encoder_runs", "encoder_cache_hits", "encoder_cache_misses", "encoder_cache_evictions",
    "reencodes_after_prefix_hit", "images_decoded", "images_preprocessed", "mm_processor_cache_hits",
    "prefix_cache_queries", "prefix_cache_hits", "kv_blocks_evicted", "kv_window_blocks_freed", "kv_window_blocks_evicted",
    "encoder_host_hits", "encoder_host_stored", "encoder_host_evictions", "encoder_host_bytes_copied_in",
    "encoder_host_bytes_copied_out", "kv_host_hits", "kv_host_stored", "kv_host_evictions",
})

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """Reads the engine's stats at scrape time (under the engine's lock: at most one step's wait)."""

    def __init__(self, async_engine: AsyncMMEngine) -> None:
        self._async_engine = async_engine

    def collect(self) -> list[Metric]:
        metrics: list[Metric] = []
        for name, value in self._async_engine.engine.stats().items():
            family = CounterMetricFamily if name in COUNTER_STATS else GaugeMetricFamily
            metrics.append(family(f"mmengine_{name}", f"MMEngine.stats()['{name}']", value=value))
        engine = self._async_engine
        metrics.append(GaugeMetricFamily("mmengine_requests_in_flight", "requests the server is answering",
                                         value=engine.num_in_flight))
        metrics.append(GaugeMetricFamily("mmengine_requests_queued", "requests waiting for their first token",
                                         value=engine.num_queued))
        metrics.append(GaugeMetricFamily("mmengine_engine_healthy", "1 while the engine loop runs",
                                         value=int(engine.is_healthy)))
        return metrics


class ServerMetrics:
    def __init__(self, async_engine: AsyncMMEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(async_engine))
        self.time_to_first_token = Histogram(
            "mmengine_time_to_first_token_seconds", "from the request's arrival to its first token",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "mmengine_inter_token_latency_seconds", "time between a request's consecutive tokens",
            buckets=ITL_BUCKETS, registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "mmengine_e2e_request_latency_seconds", "from the request's arrival to its last token",
            buckets=E2E_BUCKETS, registry=self.registry,
        )
        self.requests = Counter(
            "mmengine_api_requests", "generation requests answered, by endpoint and finish reason",
            ["endpoint", "finish_reason"], registry=self.registry,
        )
        self.errors = Counter("mmengine_api_errors", "error answers, by HTTP status", ["status"], registry=self.registry)
        self.client_disconnects = Counter(
            "mmengine_client_disconnects", "requests aborted because their client went away", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def timed(self, deltas: AsyncIterator[DeltaOutput], arrival: float, endpoint: str) -> AsyncIterator[DeltaOutput]:
        """Passes a request's deltas through, observing its TTFT, inter-token latencies and total time."""
        last_token_time: float | None = None
        async for delta in deltas:
            now = time.monotonic()
            if delta.token_ids:
                if last_token_time is None:
                    self.time_to_first_token.observe(now - arrival)
                else:
                    gap = (now - last_token_time) / len(delta.token_ids)
                    for _ in delta.token_ids:
                        self.inter_token_latency.observe(gap)
                last_token_time = now
            if delta.finished:
                self.e2e_latency.observe(now - arrival)
                self.requests.labels(endpoint, delta.finish_reason).inc()
            yield delta
