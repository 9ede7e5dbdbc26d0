"""Scheduler policy ``fair``: weighted fair share of tokens between tenants.

A tenant is ``request.scheduling.tenant``, else ``request.user``
(``default_tenant`` when neither is set). Each tenant has a FIFO queue and a
*virtual service* ``charged[t]``, in tokens divided by the tenant's weight.
Admitting a request charges its tenant the request's estimated work (tokens
to compute + output tokens it may still produce); when a request finishes
early (EOS, abort, error: the kernel's ``finished`` event) or is preempted, the
unused part is refunded, so over time a tenant is charged exactly the tokens
computed for it. The next request comes from the backlogged tenant with the least virtual
service (weighted fair queueing; ties by first appearance).

A tenant that goes idle and comes back starts at the least virtual service of
the tenants active at that moment, not at its old (low) figure: idle time
earns no credit, so a returning tenant cannot starve the others either.

The preemption victim comes from the tenant most over its share (largest
virtual service) among the candidates: its most recently admitted request.

    [scheduler]
    policy = "fair"

    [scheduler.fair]
    weights = { alice = 2.0 }   # alice gets twice the tokens of anyone else when both wait
    default_weight = 1.0
    default_tenant = "default"
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel, Field, PositiveFloat

from baton import hookimpl
from baton.request import Request, RequestStatus

__version__ = "0.1.0"
BATON_PLUGIN_API = 1

_PREEMPTED = RequestStatus.PREEMPTED
#: ``max_tokens=None`` means "up to max_model_len"; the engine caps it, this bounds estimates elsewhere.
MAX_OUTPUT_ESTIMATE = 1 << 20


class FairSettings(BaseModel):
    """``[scheduler.fair]``."""

    weights: dict[str, PositiveFloat] = Field(default_factory=dict)
    """Tenant -> weight; a tenant's share of tokens is proportional to its weight."""
    default_weight: PositiveFloat = 1.0
    default_tenant: str = "default"
    """The tenant of requests with neither ``scheduling.tenant`` nor ``user``."""


def estimated_work(request: Any) -> int:
    """Tokens still to compute + output tokens the request may still produce."""
    to_compute = len(request.all_token_ids) - request.num_computed_tokens
    to_produce = min(request.max_tokens, MAX_OUTPUT_ESTIMATE) - request.num_output_tokens
    return to_compute + max(to_produce, 0)


class FairPolicy:
    """Implements ``baton.interfaces.SchedulerPolicy``; see the module docstring."""

    def __init__(self, config: Any = None, settings: FairSettings | None = None) -> None:
        s = settings or FairSettings()
        self.weights = dict(s.weights)
        self.default_weight = s.default_weight
        self.default_tenant = s.default_tenant
        #: tenant -> virtual service (tokens / weight); insertion order breaks ties
        self.charged: dict[str, float] = {}
        self._queues: dict[str, deque[Any]] = {}
        self._tenant_of: dict[str, str] = {}  # waiting request id -> tenant
        #: admitted request id -> (tenant, tokens computed when admitted, tokens charged)
        self._admitted: dict[str, tuple[str, int, int]] = {}
        self._running_per_tenant: dict[str, int] = {}

    def tenant(self, request: Request) -> str:
        tenant = request.scheduling.tenant
        if tenant is None:
            tenant = request.user
        return tenant if tenant is not None else self.default_tenant

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    # ---------------------------------------------------------------- accounting

    def _active(self, tenant: str) -> bool:
        return bool(self._queues.get(tenant)) or self._running_per_tenant.get(tenant, 0) > 0

    def _charge(self, tenant: str, tokens: float) -> None:
        self.charged[tenant] += tokens / self.weight(tenant)

    def _settle(self, rid: str, computed_now: int) -> None:
        """An admitted request left (finished, preempted): refund what it did not use."""
        tenant, computed0, charged = self._admitted.pop(rid)
        used = max(0, computed_now - computed0)
        if used < charged:
            self._charge(tenant, used - charged)
        self._running_per_tenant[tenant] -= 1

    # ---------------------------------------------------------------- SchedulerPolicy

    def add(self, request: Any) -> None:
        tenant = self.tenant(request)
        rid = request.request_id
        if rid in self._admitted:  # preempted: select_victim settled it already unless bypassed
            self._settle(rid, 0)
        if tenant not in self.charged:
            self.charged[tenant] = 0.0
        if not self._active(tenant):  # idle time earns no credit
            active = [c for t, c in self.charged.items() if t != tenant and self._active(t)]
            if active:
                self.charged[tenant] = max(self.charged[tenant], min(active))
        queue = self._queues.setdefault(tenant, deque())
        if request.status == _PREEMPTED:
            queue.appendleft(request)
        else:
            queue.append(request)
        self._tenant_of[rid] = tenant

    def _next_tenant(self, charged: dict[str, float], queues: dict[str, Any]) -> str | None:
        best, best_charge = None, 0.0
        for tenant, c in charged.items():  # insertion order: ties go to the earliest tenant
            if queues.get(tenant) and (best is None or c < best_charge):
                best, best_charge = tenant, c
        return best

    def peek(self, now: float) -> Any:
        tenant = self._next_tenant(self.charged, self._queues)
        return None if tenant is None else self._queues[tenant][0]

    def pop(self, request: Any) -> None:
        rid = request.request_id
        tenant = self._tenant_of.get(rid)
        queue = self._queues.get(tenant) if tenant is not None else None
        if not queue or queue[0] is not request:
            raise ValueError(f"pop({rid!r}): not the head of its tenant's queue")
        queue.popleft()
        del self._tenant_of[rid]
        work = estimated_work(request)
        self._charge(tenant, work)
        self._admitted[rid] = (tenant, request.num_computed_tokens, work)
        self._running_per_tenant[tenant] = self._running_per_tenant.get(tenant, 0) + 1

    def remove(self, request_ids: set[str]) -> list[Any]:
        removed = []
        touched = set()
        for rid in request_ids:
            tenant = self._tenant_of.pop(rid, None)
            if tenant is not None:
                touched.add(tenant)
        for tenant in touched:
            queue = self._queues[tenant]
            removed += [r for r in queue if r.request_id in request_ids]
            self._queues[tenant] = deque(r for r in queue if r.request_id not in request_ids)
        return removed

    def select_victim(self, running: Sequence[Any]) -> Any:
        # the tenant most over its share; its most recently admitted request (ties: the latest admitted)
        victim, worst = running[-1], None
        for r in reversed(running):
            c = self.charged.get(self.tenant(r), 0.0)
            if worst is None or c > worst:
                victim, worst = r, c
        if victim.request_id in self._admitted:
            self._settle(victim.request_id, victim.num_computed_tokens)
        return victim

    def finished(self, request: Request) -> None:
        """A request finished (stop, length, abort, error): refund what it did not use."""
        if request.request_id in self._admitted:  # not if it finished waiting (or preempted)
            self._settle(request.request_id, request.num_computed_tokens)

    def __len__(self) -> int:
        return len(self._tenant_of)

    def __iter__(self) -> Iterator[Any]:
        """The admission order if nothing else changed: pops simulated with their charges."""
        charged = dict(self.charged)
        queues = {t: deque(q) for t, q in self._queues.items() if q}
        out = []
        while (tenant := self._next_tenant(charged, queues)) is not None:
            req = queues[tenant].popleft()
            charged[tenant] += estimated_work(req) / self.weight(tenant)
            out.append(req)
        return iter(out)


@hookimpl
def register_scheduler_policies(register: Any) -> None:
    register("fair", FairPolicy, FairSettings)
