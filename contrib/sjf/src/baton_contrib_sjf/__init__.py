"""Scheduler policy ``sjf``: shortest job first, with aging so that long requests never starve.

A request's *size* is its remaining work in tokens: the prompt (and, after a
preemption, the generated tokens) still to compute plus the output tokens it
may still produce (``max_tokens`` minus those produced). Pure SJF minimises
mean latency but can starve a long request forever under a stream of short
ones, so the policy orders by ``size - aging_rate * seconds_waited``. Because
every waiting request ages at the same rate, that order equals the order of
the static key ``size + aging_rate * arrival_time``: one heap, O(log n) per
operation, and a bound anyone can check:

    a request R is never overtaken by a request that arrived more than
    size(R) / aging_rate seconds after R.

So R waits at most for the requests that arrived before
``arrival(R) + size(R) / aging_rate``, a finite set. ``aging_rate = 0`` is pure
SJF (no bound). The preemption victim is the running request the policy would
run last: the largest key.

    [scheduler]
    policy = "sjf"

    [scheduler.sjf]
    aging_rate = 50.0    # tokens of size forgiven per second of waiting
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel, Field

from baton import hookimpl

__version__ = "0.1.0"
BATON_PLUGIN_API = 1

#: ``max_tokens=None`` means "up to max_model_len"; the engine caps it, this bounds it elsewhere.
MAX_OUTPUT_ESTIMATE = 1 << 20


class SJFSettings(BaseModel):
    """``[scheduler.sjf]``."""

    aging_rate: float = Field(50.0, ge=0.0)
    """Tokens of job size forgiven per second a request waits; 0 is pure SJF (long requests may starve)."""


def job_size(request: Any) -> int:
    """Remaining work in tokens: tokens still to compute + output tokens still to produce."""
    to_compute = len(request.all_token_ids) - request.num_computed_tokens
    to_produce = min(request.max_tokens, MAX_OUTPUT_ESTIMATE) - request.num_output_tokens
    return to_compute + max(to_produce, 0)


class SJFPolicy:
    """Implements ``baton.interfaces.SchedulerPolicy``; see the module docstring."""

    def __init__(self, config: Any = None, settings: SJFSettings | None = None) -> None:
        self.aging_rate = (settings or SJFSettings()).aging_rate
        self._heap: list[list[Any]] = []  # [key, seq, request or None (removed)]
        self._entries: dict[str, list[Any]] = {}
        self._seq = itertools.count()

    def key(self, request: Any) -> float:
        """The static order key: size + aging_rate * arrival_time (smaller runs first)."""
        return job_size(request) + self.aging_rate * request.arrival_time

    def add(self, request: Any) -> None:
        old = self._entries.get(request.request_id)
        if old is not None:
            old[2] = None
        entry = [self.key(request), next(self._seq), request]
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def _top(self) -> list[Any] | None:
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def peek(self, now: float) -> Any:
        top = self._top()
        return None if top is None else top[2]

    def pop(self, request: Any) -> None:
        top = self._top()
        if top is None or top[2] is not request:
            raise ValueError(f"pop({request.request_id!r}): not the head of the queue")
        heapq.heappop(self._heap)
        del self._entries[request.request_id]

    def remove(self, request_ids: set[str]) -> list[Any]:
        removed = []
        for rid in request_ids:
            entry = self._entries.pop(rid, None)
            if entry is not None:
                removed.append(entry[2])
                entry[2] = None
        if len(self._heap) > 2 * len(self._entries) + 64:  # drop tombstones after mass aborts
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)
        return removed

    def select_victim(self, running: Sequence[Any]) -> Any:
        # the one this policy would run last; among equals the most recently admitted
        return max(reversed(running), key=self.key)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Any]:
        return iter([e[2] for e in sorted(self._entries.values(), key=lambda e: (e[0], e[1]))])


@hookimpl
def register_scheduler_policies(register: Any) -> None:
    register("sjf", SJFPolicy, SJFSettings)
