"""`/metrics`: every `MMEngine.stats()` entry as `mmengine_<name>`, the async engine's queue, and
request latency histograms, in Prometheus' text format.

Monotone counts are Prometheus counters (so their sample is `mmengine_<name>_total`, as the
format requires); levels (free blocks, cache sizes, running requests) are gauges. Each server
has its own registry, so several can live in one process.

Under `mmengine serve --api-server-count N` (PROMETHEUS_MULTIPROC_DIR set, as prometheus-client's
multiprocess mode wants), the latency histograms, the request counters and the in-flight / queued gauges
(summed over live front ends) live in that directory, and any front end's /metrics reads every front
end's; the engine's stats() come from the one engine core.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmengine.engine.async_engine import AsyncMMEngine, DeltaOutput

# stats() entries that only grow; every other entry is a level (a gauge).
COUNTER_STATS = frozenset({
    "steps", "decode_steps", "tokens_computed", "prefill_tokens_computed", "prompt_tokens", "generation_tokens", "requests_finished",
    "steps_launched_ahead",
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

    def __init__(self, async_engine: AsyncMMEngine, with_load: bool) -> None:
        self._async_engine = async_engine
        self._with_load = with_load  # False: the load gauges are multiprocess ones, summed over the front ends

    def collect(self) -> list[Metric]:
        metrics: list[Metric] = []
        for name, value in self._async_engine.engine.stats().items():
            family = CounterMetricFamily if name in COUNTER_STATS or name.startswith("spec_") else GaugeMetricFamily
            metrics.append(family(f"mmengine_{name}", f"MMEngine.stats()['{name}']", value=value))
        engine = self._async_engine
        if self._with_load:
            metrics.append(GaugeMetricFamily("mmengine_requests_in_flight", IN_FLIGHT_HELP, value=engine.num_in_flight))
            metrics.append(GaugeMetricFamily("mmengine_requests_queued", QUEUED_HELP, value=engine.num_queued))
        metrics.append(GaugeMetricFamily("mmengine_engine_healthy", "1 while the engine loop runs",
                                         value=int(engine.is_healthy)))
        return metrics


IN_FLIGHT_HELP = "requests the server is answering"
QUEUED_HELP = "requests waiting for their first token"


class ServerMetrics:
    def __init__(self, async_engine: AsyncMMEngine) -> None:
        self.registry = CollectorRegistry()
        multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        if multiprocess:  # this process's metrics are written to the directory and read back from it with the others'
            MultiProcessCollector(self.registry)
        own = None if multiprocess else self.registry
        self.registry.register(_EngineCollector(async_engine, with_load=not multiprocess))
        if multiprocess:
            in_flight = Gauge("mmengine_requests_in_flight", IN_FLIGHT_HELP, multiprocess_mode="livesum", registry=None)
            queued = Gauge("mmengine_requests_queued", QUEUED_HELP, multiprocess_mode="livesum", registry=None)

            def load_changed() -> None:
                in_flight.set(async_engine.num_in_flight)
                queued.set(async_engine.num_queued)

            async_engine.load_listener = load_changed
            load_changed()
        self.time_to_first_token = Histogram(
            "mmengine_time_to_first_token_seconds", "from the request's arrival to its first token",
            buckets=TTFT_BUCKETS, registry=own,
        )
        self.inter_token_latency = Histogram(
            "mmengine_inter_token_latency_seconds", "time between a request's consecutive tokens",
            buckets=ITL_BUCKETS, registry=own,
        )
        self.e2e_latency = Histogram(
            "mmengine_e2e_request_latency_seconds", "from the request's arrival to its last token",
            buckets=E2E_BUCKETS, registry=own,
        )
        self.requests = Counter(
            "mmengine_api_requests", "generation requests answered, by endpoint and finish reason",
            ["endpoint", "finish_reason"], registry=own,
        )
        self.errors = Counter("mmengine_api_errors", "error answers, by HTTP status", ["status"], registry=own)
        self.client_disconnects = Counter(
            "mmengine_client_disconnects", "requests aborted because their client went away", registry=own
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
                else:  # (a whole answer's last delta carries all its tokens but the first)
                    gap = (now - last_token_time) / len(delta.token_ids)
                    for _ in delta.token_ids:
                        self.inter_token_latency.observe(gap)
                last_token_time = now
            if delta.finished:
                self.e2e_latency.observe(now - arrival)
                self.requests.labels(endpoint, delta.finish_reason).inc()
            yield delta
