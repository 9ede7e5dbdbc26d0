"""Preemption: when a running request needs a KV block and none is free, the policy's victim
(``sched/victims.py`` says what it is told) gives back its blocks and waits to be recomputed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.protocol import EngineCoreEventType
from baton.request import Request, RequestStatus
from baton.sched.victims import candidates as victim_candidates

if TYPE_CHECKING:
    from baton.sched.scheduler import Scheduler
    from baton.sched.step_plan import StepPlan


def allocate_or_preempt(
    sched: Scheduler, req: Request, n: int, plan: StepPlan, now: float
) -> list[int] | None:
    """Blocks for ``n`` more tokens of a running request, preempting victims until they fit.

    None when the policy chose ``req`` itself as the victim.
    """
    allocate = sched.kv.allocate_slots
    new_ids = allocate(req, n)
    while new_ids is None:
        victim = preempt_for(sched, req, now, plan.preempted)
        if victim is req:
            return None
        if victim.request_id in plan.num_scheduled:  # scheduled earlier this step
            plan.take_back(victim)
        new_ids = allocate(req, n)
    return new_ids


def preempt_for(sched: Scheduler, req: Request, now: float, preempted: list[str]) -> Request:
    """Preempt the policy's victim among running requests not in flight (``req`` included)."""
    in_flight = sched._in_flight
    candidates = [
        r
        for r in sched.running
        if r.status == RequestStatus.RUNNING and r.request_id not in in_flight
    ]
    choose = sched._policy_choose_victim
    if choose is not None:
        victim = choose(victim_candidates(candidates, req, sched.kv.get_block_ids), now)
    else:
        victim = sched.policy.select_victim(candidates)
    if victim.status != RequestStatus.RUNNING or victim.request_id in in_flight:
        raise RuntimeError(
            f"scheduler policy chose {victim!r}, which is not a preemption candidate"
        )
    preempt(sched, victim, now, preempted)
    return victim


def preempt(sched: Scheduler, victim: Request, now: float, preempted: list[str]) -> None:
    """Free a running request's blocks and queue it again to be recomputed."""
    sched.kv.free(victim)
    victim.status = RequestStatus.PREEMPTED
    victim.num_computed_tokens = 0
    victim.num_preemptions += 1
    victim.record_event(EngineCoreEventType.PREEMPTED, now)
    if sched.num_sent.pop(victim.request_id, None) is not None:
        preempted.append(victim.request_id)
    if sched.kv_transfer is not None:
        sched.kv_transfer.preempted(victim.request_id)
    sched._running_dirty = True
    sched.policy.add(victim)
