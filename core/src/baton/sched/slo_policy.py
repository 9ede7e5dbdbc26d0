"""Scheduler policy ``slo``: the earliest feasible deadline first, for goodput.

A request's SLO is ``scheduling.slo_ttft_ms`` / ``slo_tpot_ms`` (``baton.sched.slo``).
Waiting requests are admitted by when their next token is due:

- not started (no first token yet): its TTFT deadline, ``arrival + slo_ttft_ms``;
- preempted after its first token: when its TPOT pace wants the next one,
  ``first token + slo_tpot_ms * outputs``;
- without a target of that kind: its arrival (due at once: a request without an
  SLO is never pushed back behind ones with slack).

A request that can no longer meet its SLO (``baton.sched.slo.is_hopeless``: its
TTFT deadline passed before its first token, or its tokens so far took longer
than its TPOT allows over all of ``max_tokens``) is, with ``on_miss = "demote"``
(the default), admitted only after every request that still can, in arrival
order, and preempted first; with ``"keep"`` it keeps its place. With
``lookahead`` (the default) a waiting request counts as lost already once
admitting it now would give its first token after its deadline: by the median
admission-to-first-token time of the latest admitted requests (their prompts
take steps to compute; a request admitted just before its deadline misses it
anyway, and takes the engine from one that could still make it). Demoting stops
spending the engine on requests already lost, so that under overload the others
still meet theirs; it still runs when the engine has room (nothing is dropped).

The victim (``choose_victim``, given what each candidate would cost): a
hopeless request first (``demote``), else the one whose next token is due
latest (the most slack); among equals the one with the fewest computed tokens
(the least recompute).

    [scheduler]
    policy = "slo"

    [scheduler.slo]
    on_miss = "demote"   # or "keep"
    lookahead = true     # or false: demote only once the deadline has passed
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel

from baton.request import Request
from baton.sched.slo import is_hopeless, ttft_deadline
from baton.sched.victims import VictimCandidate

INF = float("inf")
#: ``lookahead``: admitted requests followed until their first token (the oldest dropped).
ADMITTED_KEPT = 256
#: ``lookahead``: the admission-to-first-token times whose median judges a waiting request.
LAG_SAMPLES = 16


class SLOSettings(BaseModel):
    """``[scheduler.slo]``."""

    on_miss: Literal["demote", "keep"] = "demote"
    """A request that can no longer meet its SLO: "demote" admits it after every request that
    still can and preempts it first; "keep" leaves it in deadline order."""
    lookahead: bool = True
    """With "demote": a waiting request counts as lost once even admitting it now would give
    its first token after its TTFT deadline, by the admission-to-first-token time measured on
    recent requests (their prompts take steps to compute); false: only once its deadline has
    passed."""


def next_due(request: Request) -> float:
    """When the request's next token is due under its SLO, on the scheduler's clock."""
    first = request.first_token_time
    if first is None:
        deadline = ttft_deadline(request)
        return request.arrival_time if deadline is None else deadline
    tpot = request.scheduling.slo_tpot_ms
    if tpot is None:
        return request.arrival_time
    return first + tpot / 1000.0 * request.num_output_tokens


class SLOPolicy:
    """Implements ``baton.interfaces.SchedulerPolicy`` and ``VictimAwarePolicy``; see the
    module docstring."""

    def __init__(self, config: Any = None, settings: SLOSettings | None = None) -> None:
        self.demote = (settings or SLOSettings()).on_miss == "demote"
        #: [due, seq, request or None (removed)]: requests that may still meet their SLO.
        self._heap: list[list[Any]] = []
        self._entries: dict[str, list[Any]] = {}
        #: Hopeless requests (``demote``), in the order they were found so.
        self._demoted: deque[Request] = deque()
        self._seq = itertools.count()
        #: The latest clock reading seen (``peek``'s or ``choose_victim``'s).
        self.now = -INF
        #: ``lookahead``: admitted requests waiting for their first token, with when they were
        #: admitted, and the latest admission-to-first-token times measured (seconds).
        self._lookahead = settings is None or settings.lookahead
        self._admitted: deque[tuple[Request, float]] = deque(maxlen=ADMITTED_KEPT)
        self._lags: deque[float] = deque(maxlen=LAG_SAMPLES)
        #: The admission-to-first-token time a waiting request is judged with (0: none yet).
        self.lag = 0.0

    def add(self, request: Request) -> None:
        rid = request.request_id
        old = self._entries.get(rid)
        if old is not None:
            old[2] = None
        if self.demote and self._lost(request, self.now):
            self._entries.pop(rid, None)
            self._demoted.append(request)
            return
        entry = [next_due(request), next(self._seq), request]
        self._entries[rid] = entry
        heapq.heappush(self._heap, entry)

    def _lost(self, request: Request, now: float) -> bool:
        """Whether ``request`` (waiting) can no longer meet its SLO if admitted at ``now``."""
        if request.first_token_time is None and self.lag > 0.0:
            return is_hopeless(request, now + self.lag)
        return is_hopeless(request, now)

    def _measure_lags(self) -> None:
        """Admission-to-first-token times of the admitted requests whose first token is out."""
        admitted = self._admitted
        while admitted:
            req, at = admitted[0]
            if req.first_token_time is None and not req.is_finished:
                break
            admitted.popleft()
            if req.first_token_time is not None:
                self._lags.append(max(0.0, req.first_token_time - at))
        if self._lags:
            self.lag = statistics.median(self._lags)

    def _top(self, now: float) -> list[Any] | None:
        heap = self._heap
        while heap:
            top = heap[0]
            req = top[2]
            if req is None:
                heapq.heappop(heap)
            elif self.demote and self._lost(req, now):
                heapq.heappop(heap)
                del self._entries[req.request_id]
                self._demoted.append(req)
            else:
                return top
        return None

    def peek(self, now: float) -> Request | None:
        self.now = max(self.now, now)
        if self._lookahead and self.demote:
            self._measure_lags()
        top = self._top(self.now)
        if top is not None:
            return top[2]
        return self._demoted[0] if self._demoted else None

    def pop(self, request: Request) -> None:
        top = self._top(self.now)
        if top is not None and top[2] is request:
            heapq.heappop(self._heap)
            del self._entries[request.request_id]
            if self._lookahead and self.demote and request.first_token_time is None:
                self._admitted.append((request, self.now))
        elif top is None and self._demoted and self._demoted[0] is request:
            self._demoted.popleft()
        else:
            raise ValueError(f"pop({request.request_id!r}): not the head of the queue")

    def remove(self, request_ids: set[str]) -> list[Request]:
        removed = []
        for rid in request_ids:
            entry = self._entries.pop(rid, None)
            if entry is not None:
                removed.append(entry[2])
                entry[2] = None
        if any(r.request_id in request_ids for r in self._demoted):
            removed += [r for r in self._demoted if r.request_id in request_ids]
            self._demoted = deque(r for r in self._demoted if r.request_id not in request_ids)
        if len(self._heap) > 2 * len(self._entries) + 64:  # drop tombstones after mass aborts
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)
        return removed

    def victim_key(self, request: Request, now: float) -> tuple[bool, float]:
        """Larger is preempted first: hopeless (``demote``), then the latest next token due."""
        return (self.demote and is_hopeless(request, now), next_due(request))

    def choose_victim(self, candidates: Sequence[VictimCandidate], now: float) -> Request:
        self.now = max(self.now, now)
        best = max(
            reversed(candidates),
            key=lambda c: (*self.victim_key(c.request, self.now), -c.num_computed_tokens),
        )
        return best.request

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(reversed(running), key=lambda r: self.victim_key(r, self.now))

    def __len__(self) -> int:
        return len(self._entries) + len(self._demoted)

    def __iter__(self) -> Iterator[Request]:
        live = sorted((e for e in self._entries.values()), key=lambda e: (e[0], e[1]))
        return iter([e[2] for e in live] + list(self._demoted))
