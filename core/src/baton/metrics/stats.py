"""Frontend-side statistics: per-iteration figures and per-request timing.

The engine core sends SchedulerStats (protocol.py) with its outputs; the
frontend's output processor turns engine outputs into IterationStats, which
stat loggers (plugins) observe.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """Timing of one request, in seconds (monotonic clock of the frontend)."""

    arrival_time: float
    first_scheduled_time: float | None = None  # engine clock, for the queue time only
    queued_time: float | None = None  # engine clock
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None or self.queued_time is None:
            return None
        return self.first_scheduled_time - self.queued_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queue_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    ttft: float | None
    num_preemptions: int = 0


@dataclass(slots=True)
class IterationStats:
    """What one batch of engine outputs changed, as seen by the frontend."""

    timestamp: float
    num_prompt_tokens: int = 0  # prompts whose first token arrived in this batch
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
