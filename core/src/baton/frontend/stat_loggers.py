"""Build the configured stat loggers and feed them (shared by LLM and AsyncLLM)."""

from __future__ import annotations

import time

from baton.config import BatonConfig
from baton.interfaces import StatLogger
from baton.metrics.stats import IterationStats
from baton.plugins.resolve import ResolvedPlugins
from baton.protocol import SchedulerStats


class StatLoggers:
    """The stat loggers ``plugins`` resolved (``observability.stat_loggers``), when
    ``observability.log_stats`` is on; ``config`` is what their factories take."""

    def __init__(
        self, config: BatonConfig, plugins: ResolvedPlugins, engine_index: int = 0
    ) -> None:
        self.interval = config.observability.log_stats_interval
        self.enabled = config.observability.log_stats
        self.loggers: list[StatLogger] = []
        if self.enabled:
            for chosen in plugins.all("stat_logger"):
                self.loggers.append(chosen.create(config, engine_index))
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
