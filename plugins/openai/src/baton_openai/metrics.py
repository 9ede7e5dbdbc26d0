"""The ``prometheus`` stat logger: baton's engine figures in Prometheus exposition format.

Each logger owns its own CollectorRegistry (never the process-global one), so
several servers in one process do not collide; the server serves
``generate_latest(logger.registry)`` at /metrics. Names follow Prometheus
conventions (``baton_`` prefix, base units, counters end in ``_total``).
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from baton.config import BatonConfig
from baton.metrics.stats import IterationStats
from baton.protocol import SchedulerStats

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort", "error")


class PrometheusStatLogger:
    """Observes SchedulerStats and IterationStats; ``log()`` is a no-op (Prometheus pulls)."""

    def __init__(self, config: BatonConfig, settings: Any = None, engine_index: int = 0) -> None:
        # no *_created series next to every counter (process-wide in prometheus-client, as vLLM does)
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        self.model_name = config.server.served_model_name or config.model.name
        labels = ["model_name", "engine"]
        r = self.registry
        self._running = Gauge(
            "baton_num_requests_running", "Requests in the running batch.", labels, registry=r
        )
        self._waiting = Gauge(
            "baton_num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r
        )
        self._kv_usage = Gauge(
            "baton_kv_cache_usage_perc",
            "Fraction of KV-cache blocks held by requests (0..1).",
            labels,
            registry=r,
        )
        self._prefix_queries = Counter(
            "baton_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels,
            registry=r,
        )
        self._prefix_hits = Counter(
            "baton_prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            labels,
            registry=r,
        )
        self._preemptions = Counter(
            "baton_num_preemptions", "Requests preempted (recomputed).", labels, registry=r
        )
        self._prompt_tokens = Counter(
            "baton_prompt_tokens", "Prompt tokens of requests that started.", labels, registry=r
        )
        self._generation_tokens = Counter(
            "baton_generation_tokens", "Generated tokens.", labels, registry=r
        )
        self._success = Counter(
            "baton_request_success",
            "Finished requests by finish reason (abort: cancelled or disconnected).",
            [*labels, "finished_reason"],
            registry=r,
        )
        self._ttft = Histogram(
            "baton_time_to_first_token_seconds",
            "Time to first token (arrival to first token).",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._itl = Histogram(
            "baton_inter_token_latency_seconds",
            "Time between two outputs of one request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self._e2e = Histogram(
            "baton_e2e_request_latency_seconds",
            "Arrival to finish, per finished request.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self._queue = Histogram(
            "baton_request_queue_time_seconds",
            "Time waiting before first scheduled, per finished request.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self._per_engine: dict[int, _EngineMetrics] = {}
        self._engine(engine_index)  # expose zeros before the first request

    def _engine(self, index: int) -> _EngineMetrics:
        m = self._per_engine.get(index)
        if m is None:
            m = self._per_engine[index] = _EngineMetrics(self, (self.model_name, str(index)))
        return m

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        m = self._engine(engine_index)
        if scheduler_stats is not None:
            s = scheduler_stats
            m.running.set(s.num_running_reqs)
            m.waiting.set(s.num_waiting_reqs)
            m.kv_usage.set(s.kv_cache_usage)
            if s.prefix_cache_queries:
                m.prefix_queries.inc(s.prefix_cache_queries)
            if s.prefix_cache_hits:
                m.prefix_hits.inc(s.prefix_cache_hits)
            if s.num_preemptions:
                m.preemptions.inc(s.num_preemptions)
        if iteration_stats is not None:
            it = iteration_stats
            if it.num_prompt_tokens:
                m.prompt_tokens.inc(it.num_prompt_tokens)
            if it.num_generation_tokens:
                m.generation_tokens.inc(it.num_generation_tokens)
            for v in it.time_to_first_tokens:
                m.ttft.observe(v)
            for v in it.inter_token_latencies:
                m.itl.observe(v)
            for f in it.finished_requests:
                m.success[f.finish_reason].inc()
                m.e2e.observe(f.e2e_latency)
                m.queue.observe(f.queue_time)

    def log(self) -> None:
        """Nothing to do: Prometheus scrapes /metrics."""


class _EngineMetrics:
    """The labelled children of one engine (looked up once, not per step)."""

    def __init__(self, p: PrometheusStatLogger, labels: tuple[str, str]) -> None:
        self.running = p._running.labels(*labels)
        self.waiting = p._waiting.labels(*labels)
        self.kv_usage = p._kv_usage.labels(*labels)
        self.prefix_queries = p._prefix_queries.labels(*labels)
        self.prefix_hits = p._prefix_hits.labels(*labels)
        self.preemptions = p._preemptions.labels(*labels)
        self.prompt_tokens = p._prompt_tokens.labels(*labels)
        self.generation_tokens = p._generation_tokens.labels(*labels)
        self.ttft = p._ttft.labels(*labels)
        self.itl = p._itl.labels(*labels)
        self.e2e = p._e2e.labels(*labels)
        self.queue = p._queue.labels(*labels)
        self.success = _LazyLabels(p._success, labels)
        for reason in FINISH_REASONS:
            self.success[reason]


class _LazyLabels(dict[str, Any]):
    def __init__(self, metric: Counter, labels: tuple[str, str]) -> None:
        super().__init__()
        self.metric = metric
        self.labels = labels

    def __missing__(self, reason: str) -> Any:
        child = self[reason] = self.metric.labels(*self.labels, reason)
        return child
