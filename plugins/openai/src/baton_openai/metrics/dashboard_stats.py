"""The dashboard's figures, read from the prometheus stat logger's registry (what /metrics shows).

Each read takes a snapshot of the registry and keeps the recent ones (at most
one per ``MIN_INTERVAL_S``), so rates and percentiles cover a window as Grafana's
``rate(...[1m])`` and ``histogram_quantile`` would: output tok/s over the last
``RATE_WINDOW_S``, the prefix-cache hit rate and TTFT / ITL percentiles over the
last ``WINDOW_S`` (interpolated inside the histogram's buckets, as Prometheus
does). The answer gives the spans the figures cover: shorter than the windows
right after the server starts, longer after a time when nobody looked. Figures
are per engine (the ``engine`` label: one per data-parallel engine).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
from prometheus_client import CollectorRegistry

#: Rates (tokens per second, preemptions) cover about this many seconds.
RATE_WINDOW_S = 5.0
#: Percentiles and the prefix-cache hit rate cover about this many seconds.
WINDOW_S = 60.0
#: Snapshots kept are at least this far apart (several dashboards open).
MIN_INTERVAL_S = 0.5
#: Snapshots kept at most (a window's worth at MIN_INTERVAL_S, and some).
MAX_SNAPSHOTS = 256
QUANTILES = (0.5, 0.9, 0.99)
#: The server's 429s (one name whatever the naming scheme; no engine label).
REJECTED = "baton_requests_rejected_total"


class Percentiles(msgspec.Struct, kw_only=True):
    """Seconds at the 50th, 90th and 99th percentile; None without observations in the window."""

    p50: float | None
    p90: float | None
    p99: float | None
    count: int
    """Observations in the window."""


class EngineFigures(msgspec.Struct, kw_only=True):
    """One engine's figures (``engine``: its data-parallel index)."""

    engine: str
    running: int
    waiting: int
    kv_cache_usage: float
    """Fraction of KV-cache blocks held by requests (0..1)."""
    preemptions: int
    """Since start."""
    prompt_tokens: int
    generation_tokens: int
    """Since start."""
    generation_tokens_per_s: float | None
    prompt_tokens_per_s: float | None
    """Over the rate window (None on the first read)."""
    prefix_cache_hit_rate: float | None
    """Hits / queried prompt tokens over the window (None: nothing queried)."""
    finished: dict[str, int]
    """Finished requests by finish reason (stop, length, abort, error) since start."""
    ttft_s: Percentiles
    itl_s: Percentiles


class DashboardStats(msgspec.Struct, kw_only=True):
    """What ``GET /ui/stats`` answers."""

    time: float
    """Unix time of the snapshot."""
    uptime_s: float
    stats_enabled: bool
    """False when the engine keeps no stats (observability.log_stats off): no figures."""
    rate_window_s: float
    window_s: float
    """The spans the rates and the percentiles cover (0 on the first read)."""
    rejected: int
    """Requests the server refused with a 429 (server.max_queued_requests) since start."""
    engines: list[EngineFigures]


@dataclass
class _EngineSample:
    values: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    #: histogram name -> [(upper bound, cumulative count)], ascending, +Inf last
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


@dataclass
class _Snapshot:
    at: float  # monotonic
    rejected: float
    engines: dict[str, _EngineSample]


class DashboardStatsSource:
    """Snapshots of one PrometheusStatLogger's registry and the figures between them."""

    def __init__(self, registry: CollectorRegistry | None, prefix: str) -> None:
        self.registry = registry
        self.prefix = prefix
        self.started = time.monotonic()
        self._snapshots: deque[_Snapshot] = deque(maxlen=MAX_SNAPSHOTS)
        self._snapshots.append(self._snapshot())

    def read(self) -> DashboardStats:
        """The figures now, against the snapshots kept (this one is kept too when the last kept
        is at least MIN_INTERVAL_S old)."""
        last = self._snapshot()
        kept = self._snapshots
        if last.at - kept[-1].at >= MIN_INTERVAL_S:
            kept.append(last)
        # the oldest kept snapshot is the newest one at least a window old (or the oldest)
        while len(kept) > 2 and kept[1].at <= last.at - WINDOW_S:
            kept.popleft()
        window = kept[0]
        rate = next((s for s in reversed(kept) if s.at <= last.at - RATE_WINDOW_S), window)
        engines = [
            _figures(
                name, sample, rate.engines.get(name), last.at - rate.at, window.engines.get(name)
            )
            for name, sample in sorted(last.engines.items(), key=lambda kv: int(kv[0]))
        ]
        return DashboardStats(
            time=time.time(),
            uptime_s=last.at - self.started,
            stats_enabled=self.registry is not None,
            rate_window_s=last.at - rate.at,
            window_s=last.at - window.at,
            rejected=int(last.rejected),
            engines=engines,
        )

    def _snapshot(self) -> _Snapshot:
        engines: dict[str, _EngineSample] = {}
        rejected = 0.0
        for family in self.registry.collect() if self.registry is not None else ():
            for s in family.samples:
                if s.name == REJECTED:
                    rejected += s.value
                    continue
                engine = s.labels.get("engine")
                if engine is None or not s.name.startswith(self.prefix):
                    continue
                name = s.name.removeprefix(self.prefix)
                e = engines.setdefault(engine, _EngineSample())
                if name.endswith("_bucket"):
                    bound = float(s.labels["le"])
                    e.buckets.setdefault(name.removesuffix("_bucket"), []).append((bound, s.value))
                elif name == "request_success_total":
                    e.finished[s.labels["finished_reason"]] = s.value
                else:
                    e.values[name] = s.value
        for e in engines.values():
            for b in e.buckets.values():
                b.sort()
        return _Snapshot(at=time.monotonic(), rejected=rejected, engines=engines)


def _figures(
    engine: str,
    now: _EngineSample,
    rate_base: _EngineSample | None,
    rate_span: float,
    window_base: _EngineSample | None,
) -> EngineFigures:
    rate_base = rate_base or _EngineSample()
    window_base = window_base or _EngineSample()

    def per_s(name: str) -> float | None:
        if rate_span <= 0:
            return None
        return (now.values.get(name, 0.0) - rate_base.values.get(name, 0.0)) / rate_span

    queries = now.values.get("prefix_cache_queries_total", 0.0) - window_base.values.get(
        "prefix_cache_queries_total", 0.0
    )
    hits = now.values.get("prefix_cache_hits_total", 0.0) - window_base.values.get(
        "prefix_cache_hits_total", 0.0
    )
    return EngineFigures(
        engine=engine,
        running=int(now.values.get("num_requests_running", 0)),
        waiting=int(now.values.get("num_requests_waiting", 0)),
        kv_cache_usage=now.values.get("kv_cache_usage_perc", 0.0),
        preemptions=int(now.values.get("num_preemptions_total", 0)),
        prompt_tokens=int(now.values.get("prompt_tokens_total", 0)),
        generation_tokens=int(now.values.get("generation_tokens_total", 0)),
        generation_tokens_per_s=per_s("generation_tokens_total"),
        prompt_tokens_per_s=per_s("prompt_tokens_total"),
        prefix_cache_hit_rate=hits / queries if queries > 0 else None,
        finished={reason: int(n) for reason, n in sorted(now.finished.items())},
        ttft_s=_percentiles(now, window_base, "time_to_first_token_seconds"),
        itl_s=_percentiles(now, window_base, "inter_token_latency_seconds"),
    )


def _percentiles(now: _EngineSample, base: _EngineSample, name: str) -> Percentiles:
    current = now.buckets.get(name, [])
    before = dict(base.buckets.get(name, []))
    delta = [(bound, count - before.get(bound, 0.0)) for bound, count in current]
    total = delta[-1][1] if delta else 0.0
    p = [quantile(q, delta) for q in QUANTILES]
    return Percentiles(p50=p[0], p90=p[1], p99=p[2], count=int(total))


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: ``buckets`` are (upper bound, cumulative count),
    ascending with +Inf last; linear inside the bucket the rank falls in, the highest finite
    bound when it falls in +Inf; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
