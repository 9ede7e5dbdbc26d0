"""The scheduler's running figures and the SchedulerStats made of them after each step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.protocol import SchedulerStats

if TYPE_CHECKING:
    from baton.kv.manager import KVCacheManager
    from baton.speculative.drafting import Drafts


class SchedulerCounters:
    """Preemptions, goodput (finished requests with an SLO, and those that met it) and the
    prefix cache's queries and hits: totals, and what changed since the last delta stats."""

    def __init__(self) -> None:
        self.num_preemptions = 0
        self.total_preemptions = 0
        self.queries_seen = 0
        self.hits_seen = 0
        self.slo_finished = self.slo_met = 0
        self.total_slo_finished = self.total_slo_met = 0

    def preempted(self, n: int) -> None:
        """Count ``n`` preemptions."""
        self.num_preemptions += n
        self.total_preemptions += n

    def slo_done(self, met: bool) -> None:
        """Count a request with an SLO that finished (not aborted), and whether it met it."""
        self.slo_finished += 1
        self.total_slo_finished += 1
        self.slo_met += met
        self.total_slo_met += met

    def make_stats(
        self,
        delta: bool,
        *,
        kv: KVCacheManager,
        drafts: Drafts | None,
        step: int,
        num_running: int,
        num_waiting: int,
        num_scheduled: int,
        num_batches_in_flight: int,
    ) -> SchedulerStats:
        """The figures after the latest step (see ``Scheduler.make_stats``)."""
        if delta:
            queries = kv.prefix_cache_queries - self.queries_seen
            hits = kv.prefix_cache_hits - self.hits_seen
            self.queries_seen, self.hits_seen = kv.prefix_cache_queries, kv.prefix_cache_hits
            preemptions, self.num_preemptions = self.num_preemptions, 0
            slo_finished, slo_met = self.slo_finished, self.slo_met
            self.slo_finished = self.slo_met = 0
        else:
            queries, hits, preemptions = (
                kv.prefix_cache_queries,
                kv.prefix_cache_hits,
                self.total_preemptions,
            )
            slo_finished, slo_met = self.total_slo_finished, self.total_slo_met
        spec = None
        if drafts is not None:
            spec = drafts.take_step_counters() if delta else drafts.total
        return SchedulerStats(
            step=step,
            num_running_reqs=num_running,
            num_waiting_reqs=num_waiting,
            num_scheduled_tokens=num_scheduled,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_total_blocks,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
            num_batches_in_flight=num_batches_in_flight,
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_accepted_per_position=list(spec.accepted_per_position) if spec else None,
            num_slo_finished=slo_finished,
            num_slo_met=slo_met,
        )
