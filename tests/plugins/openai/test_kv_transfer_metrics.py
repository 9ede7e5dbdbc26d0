"""A KV connector's figures (SchedulerStats.kv_transfer) as Prometheus series: vLLM's
external_prefix_cache_hits and the kv_transfer_* counters and tier gauges, in both naming
schemes; none of them without a connector."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton.config import BatonConfig
from baton.protocol import KVTransferStats, SchedulerStats
from baton_openai.metrics.prometheus import PrometheusStatLogger
from baton_openai.metrics.settings import PrometheusSettings


def _samples(logger: PrometheusStatLogger) -> dict[tuple[str, str], float]:
    text = generate_latest(logger.registry).decode()
    return {
        (s.name, s.labels.get("tier", "")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _step(hits: int, load: int, tier: int) -> SchedulerStats:
    kv = KVTransferStats(
        hit_tokens={"CPU": hits},
        load_bytes=load,
        save_bytes=7,
        tier_bytes={"CPU": tier},
        tier_capacity_bytes={"CPU": 1000},
    )
    return SchedulerStats(kv_transfer=kv)


def test_connector_figures_become_counters_and_gauges() -> None:
    config = BatonConfig.load(kv_transfer={"connector": "memory"})
    logger = PrometheusStatLogger(config, PrometheusSettings(metric_names="both"))
    logger.record(_step(hits=32, load=100, tier=300), None)
    logger.record(_step(hits=64, load=50, tier=200), None)
    got = _samples(logger)
    for prefix in ("baton_", "vllm:"):
        assert got[(f"{prefix}external_prefix_cache_hits_total", "")] == 96
        assert got[(f"{prefix}kv_transfer_hit_tokens_total", "CPU")] == 96
        assert got[(f"{prefix}kv_transfer_load_bytes_total", "")] == 150
        assert got[(f"{prefix}kv_transfer_save_bytes_total", "")] == 14
        assert got[(f"{prefix}kv_transfer_tier_bytes", "CPU")] == 200  # a level: the latest
        assert got[(f"{prefix}kv_transfer_tier_capacity_bytes", "CPU")] == 1000


def test_no_connector_series_without_a_connector() -> None:
    logger = PrometheusStatLogger(BatonConfig.load(), PrometheusSettings())
    logger.record(SchedulerStats(), None)
    assert not [name for name, _ in _samples(logger) if "kv_transfer" in name or "external" in name]
