"""Build the configured stat loggers and feed them (shared by LLM and AsyncLLM)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from baton.config import ObservabilitySection
from baton.interfaces import StatLogger
from baton.metrics.stats import IterationStats
from baton.protocol import SchedulerStats


class StatLoggers:
    """The configured stat loggers (``observability.stat_loggers``), built when
    ``observability.log_stats`` is on. ``factories``: each one's factory with the config and
    its settings bound (``ResolvedPlugins.factories("stat_logger", config)``), called with
    ``engine_index``."""

    def __init__(
        self,
        settings: ObservabilitySection,
        factories: Sequence[Callable[[int], StatLogger]],
        engine_index: int = 0,
    ) -> None:
        self.interval = settings.log_stats_interval
        self.enabled = settings.log_stats
        self.loggers: list[StatLogger] = []
        if self.enabled:
            self.loggers = [factory(engine_index) for factory in factories]
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
