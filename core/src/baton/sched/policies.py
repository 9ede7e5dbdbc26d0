"""The built-in scheduler policies, ``fcfs``, ``priority`` and ``slo``, registered as a plugin.

Each implements ``baton.interfaces.SchedulerPolicy``: they order the waiting
queue and pick preemption victims; the mechanism (``baton.sched.scheduler``)
does everything else. Each class is its own registry factory,
``cls(config, settings)``, so a plugin can subclass one and register it.
``slo`` (earliest feasible SLO deadline first) lives in ``baton.sched.slo_policy``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel

from baton.plugins.hookspecs import hookimpl
from baton.request import Request, RequestStatus
from baton.sched.slo_policy import SLOPolicy, SLOSettings


class FCFSSettings(BaseModel):
    """``[scheduler.fcfs]``."""

    victim: Literal["newest", "least_recompute"] = "newest"
    """The preemption victim: "newest", the most recently admitted running request (vLLM's
    choice); "least_recompute", the one with the fewest computed tokens (the least work redone
    when it resumes), the newest among equals."""


class FCFSPolicy:
    """First come, first served.

    New requests queue in arrival (``add``) order; a preempted request goes back
    to the front, so it resumes before anything that arrived after it. The
    victim is the most recently admitted running request, or with ``victim =
    "least_recompute"`` the one with the fewest computed tokens.
    """

    def __init__(self, config: Any = None, settings: FCFSSettings | None = None) -> None:
        self._queue: deque[Request] = deque()
        self.least_recompute = (settings or FCFSSettings()).victim == "least_recompute"

    def add(self, request: Request) -> None:
        if request.status == RequestStatus.PREEMPTED:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)

    def peek(self, now: float) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self, request: Request) -> None:
        head = self._queue.popleft()
        if head is not request:
            self._queue.appendleft(head)
            raise ValueError(
                f"pop({request.request_id!r}): not the head of the queue ({head.request_id!r})"
            )

    def remove(self, request_ids: set[str]) -> list[Request]:
        removed = [r for r in self._queue if r.request_id in request_ids]
        if removed:
            self._queue = deque(r for r in self._queue if r.request_id not in request_ids)
        return removed

    def select_victim(self, running: Sequence[Request]) -> Request:
        if self.least_recompute:
            return min(reversed(running), key=lambda r: r.num_computed_tokens)
        return running[-1]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue))


class PriorityPolicy:
    """Lowest ``Request.priority`` first, ties by ``arrival_time``, then by ``add`` order.

    A heap of ``[priority, arrival_time, seq, request]`` entries; ``remove``
    tombstones an entry (request slot set to None), skipped when it reaches the
    top. The victim is the running request with the largest
    (priority, arrival_time), the most recently admitted among equals.
    """

    def __init__(self, config: Any = None, settings: Any = None) -> None:
        self._heap: list[list[Any]] = []
        self._entries: dict[str, list[Any]] = {}
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        entry = [request.priority, request.arrival_time, next(self._seq), request]
        old = self._entries.get(request.request_id)
        if old is not None:
            old[3] = None
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def _top(self) -> list[Any] | None:
        heap = self._heap
        while heap and heap[0][3] is None:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def peek(self, now: float) -> Request | None:
        top = self._top()
        return None if top is None else top[3]

    def pop(self, request: Request) -> None:
        top = self._top()
        if top is None or top[3] is not request:
            raise ValueError(f"pop({request.request_id!r}): not the head of the queue")
        heapq.heappop(self._heap)
        del self._entries[request.request_id]

    def remove(self, request_ids: set[str]) -> list[Request]:
        removed = []
        for rid in request_ids:
            entry = self._entries.pop(rid, None)
            if entry is not None:
                removed.append(entry[3])
                entry[3] = None
        # keep tombstones from piling up under mass aborts
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [e for e in self._heap if e[3] is not None]
            heapq.heapify(self._heap)
        return removed

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return iter([e[3] for e in sorted(self._entries.values(), key=lambda e: e[:3])])


@hookimpl
def register_scheduler_policies(register) -> None:  # type: ignore[no-untyped-def]
    # the classes are their own factories: factory(config, settings)
    register("fcfs", FCFSPolicy, FCFSSettings)
    register("priority", PriorityPolicy)
    register("slo", SLOPolicy, SLOSettings)
