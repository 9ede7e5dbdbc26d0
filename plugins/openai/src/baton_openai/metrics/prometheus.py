"""The ``prometheus`` stat logger: baton's engine figures in Prometheus exposition format.

Each logger owns its own CollectorRegistry (never the process-global one), so
several servers in one process do not collide; the server serves
``generate_latest(logger.registry)`` at /metrics. Names follow Prometheus
conventions (``baton_`` prefix, base units, counters end in ``_total``).

``[observability.prometheus] metric_names`` chooses the names: ``baton``
(default), ``vllm`` (vLLM's: ``vllm:`` prefix, the same histograms and buckets,
plus ``vllm:time_per_output_token_seconds``, so dashboards made for vLLM work)
or ``both``. ``baton_requests_rejected_total`` (the server's 429s) has no vLLM
counterpart and is there whatever the choice.

With ``speculative.method`` set, four more counters per engine (vLLM's names in
vllm mode): ``spec_decode_num_drafts`` (verifications of drafts),
``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
``spec_decode_num_accepted_tokens_per_pos`` (a ``position`` label, 0 = the
first draft, one series per position up to ``speculative.num_tokens``): the
acceptance rate is accepted / draft tokens, the mean accepted length
1 + accepted / drafts, position i's acceptance per_pos{position=i} / drafts.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from baton.config import BatonConfig
from baton.metrics.stats import IterationStats
from baton.protocol import KVTransferStats, SchedulerStats
from baton_openai.metrics.settings import PrometheusSettings

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
#: The metric-name prefix of each naming scheme.
PREFIXES = {"baton": "baton_", "vllm": "vllm:"}


class _Maker:
    """Makes the families of one naming scheme: ``prefix`` before each name, ``labels`` on each."""

    def __init__(self, r: CollectorRegistry, prefix: str, labels: list[str]) -> None:
        self.r, self.prefix, self.labels = r, prefix, labels

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"{self.prefix}{name}", doc, self.labels, registry=self.r)

    def counter(self, name: str, doc: str, extra_label: str | None = None) -> Counter:
        labels = [*self.labels, extra_label] if extra_label else self.labels
        return Counter(f"{self.prefix}{name}", doc, labels, registry=self.r)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"{self.prefix}{name}", doc, self.labels, buckets=buckets, registry=self.r)


class _Families:
    """The metric families of one naming scheme (``prefix``: ``baton_`` or ``vllm:``)."""

    def __init__(
        self,
        r: CollectorRegistry,
        prefix: str,
        labels: list[str],
        speculative: bool = False,
        kv_transfer: bool = False,
    ) -> None:
        self.spec = _SpecFamilies(r, prefix, labels) if speculative else None
        self.kv = _KVTransferFamilies(r, prefix, labels) if kv_transfer else None
        make = _Maker(r, prefix, labels)
        self.running = make.gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = make.gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = make.gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0..1)."
        )
        self.prefix_queries = make.counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = make.counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.preemptions = make.counter("num_preemptions", "Requests preempted (recomputed).")
        self.slo_requests = make.counter(
            "slo_requests",
            "Finished requests with an SLO (scheduling.slo_ttft_ms / slo_tpot_ms; not aborted).",
        )
        self.slo_met = make.counter(
            "slo_met_requests", "Finished requests that met their SLO (goodput: its rate)."
        )
        self.prompt_tokens = make.counter(
            "prompt_tokens", "Prompt tokens of requests that started."
        )
        self.generation_tokens = make.counter("generation_tokens", "Generated tokens.")
        self.success = make.counter(
            "request_success",
            "Finished requests by finish reason (abort: cancelled or disconnected).",
            "finished_reason",
        )
        self.ttft = make.histogram(
            "time_to_first_token_seconds",
            "Time to first token (arrival to first token).",
            TTFT_BUCKETS,
        )
        self.itl = [
            make.histogram(
                "inter_token_latency_seconds",
                "Time between two outputs of one request.",
                ITL_BUCKETS,
            )
        ]
        if prefix == PREFIXES["vllm"]:  # vLLM's older name for the same figure
            self.itl.append(
                make.histogram(
                    "time_per_output_token_seconds",
                    "Time between two outputs of one request (vLLM's older name).",
                    ITL_BUCKETS,
                )
            )
        self.e2e = make.histogram(
            "e2e_request_latency_seconds",
            "Arrival to finish, per finished request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = make.histogram(
            "request_queue_time_seconds",
            "Time waiting before first scheduled, per finished request.",
            REQUEST_LATENCY_BUCKETS,
        )


class _SpecFamilies:
    """Speculative decoding's counters of one naming scheme."""

    def __init__(self, r: CollectorRegistry, prefix: str, labels: list[str]) -> None:
        make = _Maker(r, prefix, labels)
        self.drafts = make.counter(
            "spec_decode_num_drafts",
            "Verifications of draft tokens (one per request per step with drafts).",
        )
        self.draft_tokens = make.counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = make.counter(
            "spec_decode_num_accepted_tokens", "Draft tokens the model accepted."
        )
        self.accepted_per_pos = make.counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first draft).",
            "position",
        )


class _KVTransferFamilies:
    """A KV connector's figures (``SchedulerStats.kv_transfer``) of one naming scheme: vLLM's
    ``external_prefix_cache_hits`` (tokens the connector served), the rest ``kv_transfer_*``."""

    def __init__(self, r: CollectorRegistry, prefix: str, labels: list[str]) -> None:
        make = _Maker(r, prefix, labels)
        self.external_hits = make.counter(
            "external_prefix_cache_hits", "Prompt tokens the KV connector served (every tier)."
        )
        self.hit_tokens = make.counter(
            "kv_transfer_hit_tokens", "Prompt tokens the KV connector served, by tier.", "tier"
        )
        self.load_bytes = make.counter("kv_transfer_load_bytes", "Bytes of KV loaded.")
        self.load_seconds = make.counter("kv_transfer_load_seconds", "Seconds spent loading KV.")
        self.save_bytes = make.counter("kv_transfer_save_bytes", "Bytes of KV saved.")
        self.save_seconds = make.counter("kv_transfer_save_seconds", "Seconds spent saving KV.")
        self.failed_loads = make.counter(
            "kv_transfer_failed_loads", "Blocks found missing or bad when loading (recomputed)."
        )
        self.tier_bytes = Gauge(
            f"{prefix}kv_transfer_tier_bytes",
            "Bytes of KV each tier holds.",
            [*labels, "tier"],
            registry=r,
        )
        self.tier_capacity = Gauge(
            f"{prefix}kv_transfer_tier_capacity_bytes",
            "Bytes of KV each tier may hold.",
            [*labels, "tier"],
            registry=r,
        )


class _EngineKVTransferMetrics:
    """One engine's KV-connector series."""

    def __init__(self, f: _KVTransferFamilies, labels: tuple[str, str]) -> None:
        self.f, self.labels = f, labels
        self.external_hits = f.external_hits.labels(*labels)
        self.load_bytes = f.load_bytes.labels(*labels)
        self.load_seconds = f.load_seconds.labels(*labels)
        self.save_bytes = f.save_bytes.labels(*labels)
        self.save_seconds = f.save_seconds.labels(*labels)
        self.failed_loads = f.failed_loads.labels(*labels)

    def record(self, kv: KVTransferStats) -> None:
        labels = self.labels
        for tier, n in kv.hit_tokens.items():
            if n:
                self.external_hits.inc(n)
                self.f.hit_tokens.labels(*labels, tier).inc(n)
        for counter, value in (
            (self.load_bytes, kv.load_bytes),
            (self.load_seconds, kv.load_seconds),
            (self.save_bytes, kv.save_bytes),
            (self.save_seconds, kv.save_seconds),
            (self.failed_loads, kv.failed_loads),
        ):
            if value:
                counter.inc(value)
        for tier, n in kv.tier_bytes.items():
            self.f.tier_bytes.labels(*labels, tier).set(n)
        for tier, n in kv.tier_capacity_bytes.items():
            self.f.tier_capacity.labels(*labels, tier).set(n)


class PrometheusStatLogger:
    """Observes SchedulerStats and IterationStats; ``log()`` is a no-op (Prometheus pulls)."""

    def __init__(self, config: BatonConfig, settings: Any = None, engine_index: int = 0) -> None:
        # no *_created series next to every counter (process-wide in prometheus-client, as vLLM does)
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        self.model_name = config.server.served_model_name or config.model.name
        names = settings.metric_names if isinstance(settings, PrometheusSettings) else "baton"
        schemes = ["baton", "vllm"] if names == "both" else [names]
        #: The metric-name prefix of the first scheme (what the dashboard reads).
        self.prefix = PREFIXES[schemes[0]]
        labels = ["model_name", "engine"]
        spec = config.speculative.method != "none"
        self._num_spec_positions = config.speculative.num_tokens if spec else 0
        kv = config.kv_transfer.connector != "none"
        self._families = [
            _Families(self.registry, PREFIXES[s], labels, speculative=spec, kv_transfer=kv)
            for s in schemes
        ]
        self._rejected = Counter(
            "baton_requests_rejected",
            "Requests the server refused before running them (queue_full: a 429).",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self._rejected.labels(self.model_name, "queue_full")
        self._per_engine: dict[int, list[_EngineMetrics]] = {}
        self._engine(engine_index)  # expose zeros before the first request

    def count_rejected(self, reason: str) -> None:
        """One request refused by the server (``reason``: queue_full)."""
        self._rejected.labels(self.model_name, reason).inc()

    def _engine(self, index: int) -> list[_EngineMetrics]:
        m = self._per_engine.get(index)
        if m is None:
            labels = (self.model_name, str(index))
            m = self._per_engine[index] = [
                _EngineMetrics(f, labels, self._num_spec_positions) for f in self._families
            ]
        return m

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        for m in self._engine(engine_index):
            m.record(scheduler_stats, iteration_stats)

    def log(self) -> None:
        """Nothing to do: Prometheus scrapes /metrics."""


class _EngineMetrics:
    """The labelled children of one engine in one naming scheme (looked up once, not per step)."""

    def __init__(self, f: _Families, labels: tuple[str, str], num_spec_positions: int) -> None:
        self.spec = (
            None if f.spec is None else _EngineSpecMetrics(f.spec, labels, num_spec_positions)
        )
        self.kv = None if f.kv is None else _EngineKVTransferMetrics(f.kv, labels)
        self.running = f.running.labels(*labels)
        self.waiting = f.waiting.labels(*labels)
        self.kv_usage = f.kv_usage.labels(*labels)
        self.prefix_queries = f.prefix_queries.labels(*labels)
        self.prefix_hits = f.prefix_hits.labels(*labels)
        self.preemptions = f.preemptions.labels(*labels)
        self.slo_requests = f.slo_requests.labels(*labels)
        self.slo_met = f.slo_met.labels(*labels)
        self.prompt_tokens = f.prompt_tokens.labels(*labels)
        self.generation_tokens = f.generation_tokens.labels(*labels)
        self.ttft = f.ttft.labels(*labels)
        self.itl = [h.labels(*labels) for h in f.itl]
        self.e2e = f.e2e.labels(*labels)
        self.queue = f.queue.labels(*labels)
        self.success = _LazyLabels(f.success, labels)
        for reason in FINISH_REASONS:
            self.success[reason]

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        if scheduler_stats is not None:
            s = scheduler_stats
            self.running.set(s.num_running_reqs)
            self.waiting.set(s.num_waiting_reqs)
            self.kv_usage.set(s.kv_cache_usage)
            if s.prefix_cache_queries:
                self.prefix_queries.inc(s.prefix_cache_queries)
            if s.prefix_cache_hits:
                self.prefix_hits.inc(s.prefix_cache_hits)
            if s.num_preemptions:
                self.preemptions.inc(s.num_preemptions)
            if s.num_slo_finished:
                self.slo_requests.inc(s.num_slo_finished)
                self.slo_met.inc(s.num_slo_met)
            if self.spec is not None and s.spec_num_drafts:
                self.spec.record(s)
            if self.kv is not None and s.kv_transfer is not None:
                self.kv.record(s.kv_transfer)
        if iteration_stats is not None:
            it = iteration_stats
            if it.num_prompt_tokens:
                self.prompt_tokens.inc(it.num_prompt_tokens)
            if it.num_generation_tokens:
                self.generation_tokens.inc(it.num_generation_tokens)
            for v in it.time_to_first_tokens:
                self.ttft.observe(v)
            for v in it.inter_token_latencies:
                for h in self.itl:
                    h.observe(v)
            for f in it.finished_requests:
                self.success[f.finish_reason].inc()
                self.e2e.observe(f.e2e_latency)
                self.queue.observe(f.queue_time)


class _EngineSpecMetrics:
    """One engine's speculative-decoding counters (a series per draft position from zero)."""

    def __init__(self, f: _SpecFamilies, labels: tuple[str, str], num_positions: int) -> None:
        self.families = f
        self.labels = labels
        self.drafts = f.drafts.labels(*labels)
        self.draft_tokens = f.draft_tokens.labels(*labels)
        self.accepted_tokens = f.accepted_tokens.labels(*labels)
        self.per_pos = [f.accepted_per_pos.labels(*labels, str(i)) for i in range(num_positions)]

    def record(self, s: SchedulerStats) -> None:
        self.drafts.inc(s.spec_num_drafts)
        self.draft_tokens.inc(s.spec_num_draft_tokens)
        self.accepted_tokens.inc(s.spec_num_accepted_tokens)
        for i, n in enumerate(s.spec_accepted_per_position or ()):
            while i >= len(self.per_pos):  # more positions than configured: a series for each
                pos = str(len(self.per_pos))
                self.per_pos.append(self.families.accepted_per_pos.labels(*self.labels, pos))
            if n:
                self.per_pos[i].inc(n)


class _LazyLabels(dict[str, Any]):
    def __init__(self, metric: Counter, labels: tuple[str, str]) -> None:
        super().__init__()
        self.metric = metric
        self.labels = labels

    def __missing__(self, reason: str) -> Any:
        child = self[reason] = self.metric.labels(*self.labels, reason)
        return child
