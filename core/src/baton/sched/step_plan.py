"""One step's plan while ``Scheduler.schedule()`` makes it, and the SchedulerOutput it becomes."""

from __future__ import annotations

from baton.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from baton.request import Request


class StepPlan:
    """One step's decisions while ``schedule()`` makes them."""

    __slots__ = (
        "budget",
        "cached",
        "decode_steps",
        "new_reqs",
        "num_scheduled",
        "preempted",
        "prefill",
        "so_ids",
        "spec",
    )

    def __init__(self, budget: int, prefill: int | None = None) -> None:
        #: Tokens the step can still take.
        self.budget = budget
        #: Prompt tokens (chunks of requests with more than one token to compute) the step can
        #: still take; without a latency target it starts at ``budget`` and never binds.
        self.prefill = budget if prefill is None else prefill
        self.num_scheduled: dict[str, int] = {}
        #: Running requests scheduled: req id -> (new token ids, new block ids, computed before).
        self.cached: dict[str, tuple[list[int], list[int], int]] = {}
        self.new_reqs: list[NewRequestData] = []
        #: Scheduled requests that sample under a grammar this step.
        self.so_ids: list[str] = []
        #: Requests preempted this step that the runner holds.
        self.preempted: list[str] = []
        #: Draft tokens scheduled for verification: req id -> drafts.
        self.spec: dict[str, list[int]] = {}
        #: Decode steps the runner may run (``sched/decode_steps.py``).
        self.decode_steps = 1

    def take_back(self, req: Request) -> None:
        """Unschedule a running request scheduled earlier in this step (it was preempted)."""
        req_id = req.request_id
        n = self.num_scheduled.pop(req_id)
        self.budget += n
        if req.num_tokens - self.cached.pop(req_id)[2] > 1:  # it was a prompt chunk
            self.prefill += n
        if req_id in self.so_ids:
            self.so_ids.remove(req_id)
        self.spec.pop(req_id, None)

    def attention_pairs(self, requests: dict[str, Request]) -> int:
        """Query-key pairs the step's attention computes (each new token times its context)."""
        pairs = 0
        for rid, n in self.num_scheduled.items():
            start = requests[rid].num_computed_tokens - n
            pairs += n * start + n * (n + 1) // 2
        return pairs

    def to_output(
        self,
        step_id: int,
        total: int,
        finished_ids: list[str],
        preempted: list[str],
        copies: list[tuple[int, int]],
    ) -> SchedulerOutput:
        """The SchedulerOutput of this plan, with the runner's news (finished, preempted, copies)."""
        cached = self.cached
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=list(cached),
                new_token_ids=[c[0] for c in cached.values()],
                new_block_ids=[c[1] for c in cached.values()],
                num_computed_tokens=[c[2] for c in cached.values()],
            ),
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished_ids,
            preempted_req_ids=preempted,
            structured_output_req_ids=self.so_ids,
            scheduled_spec_decode_tokens=self.spec,
            kv_block_copies=copies,
            decode_steps=self.decode_steps,
        )
