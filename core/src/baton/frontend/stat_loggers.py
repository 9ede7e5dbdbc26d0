"""Build the configured stat loggers and feed them (shared by LLM and AsyncLLM)."""

from __future__ import annotations

import time

from baton.config import BatonConfig
from baton.interfaces import StatLogger
from baton.metrics.stats import IterationStats
from baton.plugins.registry import get_registry
from baton.protocol import SchedulerStats


class StatLoggers:
    def __init__(self, config: BatonConfig, engine_index: int = 0) -> None:
        self.interval = config.observability.log_stats_interval
        self.enabled = config.observability.log_stats
        self.loggers: list[StatLogger] = []
        if self.enabled:
            reg = get_registry()
            for name in config.observability.stat_loggers:
                entry = reg.get("stat_logger", name)
                settings = entry.settings(config)
                self.loggers.append(entry.create(config, settings, engine_index))
        self._next_log = time.monotonic() + self.interval

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        for logger in self.loggers:
            logger.record(scheduler_stats, iteration_stats, engine_index)

    def maybe_log(self) -> None:
        now = time.monotonic()
        if self.loggers and now >= self._next_log:
            self._next_log = now + self.interval
            self.log()

    def log(self) -> None:
        for logger in self.loggers:
            logger.log()
