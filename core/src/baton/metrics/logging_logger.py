"""The built-in ``logging`` stat logger: one periodic log line with the engine's figures.

When speculative decoding verified drafts in the interval, a second line per engine
gives its acceptance rate, mean accepted length and per-position acceptance over
that interval (``baton.metrics.spec``). With a KV connector (``[kv_transfer]``) whose stats
came in the interval, another gives the tokens each tier served, the bytes loaded and saved,
and each tier's occupancy (``KVTransferTally``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from baton.config import BatonConfig
from baton.metrics.spec import SpecTally
from baton.metrics.stats import IterationStats
from baton.plugins.hookspecs import hookimpl
from baton.protocol import KVTransferStats, SchedulerStats

log = logging.getLogger("baton.stats")


class LoggingStatLogger:
    def __init__(self, config: BatonConfig, settings: Any = None, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self._reset(time.monotonic())
        self.last_scheduler_stats = SchedulerStats()
        self.prefix_queries = 0
        self.prefix_hits = 0

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0
        #: Goodput in this interval: finished requests with an SLO, of which met it.
        self.num_slo_finished = 0
        self.num_slo_met = 0
        #: Speculative decoding's figures in this interval, per engine index.
        self.spec: dict[int, SpecTally] = {}
        #: The KV connector's figures in this interval, per engine index.
        self.kv: dict[int, KVTransferTally] = {}

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
            self.prefix_queries += scheduler_stats.prefix_cache_queries
            self.prefix_hits += scheduler_stats.prefix_cache_hits
            self.num_preemptions += scheduler_stats.num_preemptions
            self.num_slo_finished += scheduler_stats.num_slo_finished
            self.num_slo_met += scheduler_stats.num_slo_met
            if scheduler_stats.spec_num_drafts:
                tally = self.spec.get(engine_index)
                if tally is None:
                    tally = self.spec[engine_index] = SpecTally()
                tally.add(scheduler_stats)
            if scheduler_stats.kv_transfer is not None:
                self.kv.setdefault(engine_index, KVTransferTally()).add(scheduler_stats.kv_transfer)

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self.last_log_time, 1e-9)
        s = self.last_scheduler_stats
        hit_rate = self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        log.info(
            "engine %03d: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, "
            "KV cache %.1f%%, prefix cache hit rate %.1f%%, preemptions %d",
            self.engine_index,
            self.num_prompt_tokens / elapsed,
            self.num_generation_tokens / elapsed,
            s.num_running_reqs,
            s.num_waiting_reqs,
            100 * s.kv_cache_usage,
            100 * hit_rate,
            self.num_preemptions,
        )
        if self.num_slo_finished:
            log.info(
                "engine %03d: SLO met by %d of %d finished requests (goodput %.2f req/s)",
                self.engine_index,
                self.num_slo_met,
                self.num_slo_finished,
                self.num_slo_met / elapsed,
            )
        for index, tally in sorted(self.spec.items()):
            log.info("engine %03d: speculative decoding: %s", index, tally.describe())
        for index, kv in sorted(self.kv.items()):
            log.info("engine %03d: KV connector: %s", index, kv.describe())
        self._reset(now)


class KVTransferTally:
    """A KV connector's figures summed over a logging interval (occupancy: the latest)."""

    def __init__(self) -> None:
        self.total = KVTransferStats()

    def add(self, kv: KVTransferStats) -> None:
        t = self.total
        for tier, n in kv.hit_tokens.items():
            t.hit_tokens[tier] = t.hit_tokens.get(tier, 0) + n
        t.load_bytes += kv.load_bytes
        t.load_seconds += kv.load_seconds
        t.save_bytes += kv.save_bytes
        t.save_seconds += kv.save_seconds
        t.failed_loads += kv.failed_loads
        t.tier_bytes.update(kv.tier_bytes)
        t.tier_capacity_bytes.update(kv.tier_capacity_bytes)

    def describe(self) -> str:
        """``served CPU 96 tokens; loaded 1.2 MiB in 0.004 s; saved ...; tiers CPU 3.0/64.0 MiB``"""
        t, mib = self.total, 2**20
        served = ", ".join(f"{tier} {n}" for tier, n in sorted(t.hit_tokens.items())) or "0"
        parts = [
            f"served {served} tokens",
            f"loaded {t.load_bytes / mib:.1f} MiB in {t.load_seconds:.3f} s",
            f"saved {t.save_bytes / mib:.1f} MiB in {t.save_seconds:.3f} s",
        ]
        if t.failed_loads:
            parts.append(f"{t.failed_loads} blocks failed to load (recomputed)")
        if t.tier_bytes:
            cap = t.tier_capacity_bytes
            parts.append(
                "tiers "
                + ", ".join(
                    f"{tier} {n / mib:.1f}"
                    + (f"/{cap[tier] / mib:.1f}" if tier in cap else "")
                    + " MiB"
                    for tier, n in sorted(t.tier_bytes.items())
                )
            )
        return "; ".join(parts)


@hookimpl
def register_stat_loggers(register: Any) -> None:
    register("logging", LoggingStatLogger)
