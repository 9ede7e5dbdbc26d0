"""The scheduler mechanism: continuous batching over a paged KV cache.

There are no prefill or decode phases. Each ``schedule()`` decides how many
tokens each request computes this step (``{req_id: num_tokens}``) under
``max_num_batched_tokens`` and ``max_num_seqs``: running requests first (decodes
and the next chunk of unfinished prompts, in admission order), then waiting
requests in the order the policy gives. A request's ``num_computed_tokens``
advances when it is scheduled; until its output is applied by
``update_from_output`` it is *in flight* and is neither scheduled again nor
preempted (so several SchedulerOutputs can be in flight: the pipeline-parallel
batch queue). Optional caps bound a prompt's chunk per step
(``long_prefill_token_threshold``) and the prompts in progress at once
(``max_num_partial_prefills``). With ``target_step_ms`` on ("auto", the
default: 1.75x a measured decode-only step's time; or a number) the prompt chunks of a
step, all together, are sized by ``PrefillBudget`` (``sched/step_budget.py``)
so that the step takes about that long: the running decodes are counted first
and always scheduled, and the engine feeds each step's measured time back
through ``observe_step_time``.

With a speculator (``speculative.method``, ``baton.speculative.drafting``) a running request about to decode
may be scheduled with draft tokens (``sched/step_update.py`` says how).

Admission takes the blocks of a request's whole sequence at once
(``reserve_full_prompt``, the default), so its later prompt chunks need none.
When a running request needs a block and none is free, the policy picks a
victim (``select_victim``, or ``choose_victim`` with each candidate's cost:
``sched/victims.py``); its blocks are freed and it is recomputed later from its
tokens (prompt + what it generated), producing the same output. A request's
first token is stamped on the clock (``Request.first_token_time``), and a
request with an SLO that finishes (not aborted) counts in the goodput figures
of ``make_stats`` (``sched/slo.py``). The model runner
learns of finished and preempted requests through the next SchedulerOutput
that schedules something, or, once no request is left (an abort on an idle
engine), through the next output even if empty: that one must reach the
executor (``has_runner_news`` says an idle engine still has news to send).

What a policy decides (order, admission, victim) is behind
``baton.interfaces.SchedulerPolicy``; everything here is mechanism. A policy
with a ``finished(request)`` method is told once of every request it was given
(``add``) when that request finishes, whatever the reason, after the request
has left it; the call is made once the scheduler's books are settled (at the
end of ``finish_requests`` / ``update_from_output``), so a policy that raises
there fails the engine rather than the request.

With a KV connector (``[kv_transfer]``, ``use_kv_connector``; its scheduler half is
``kv_connector``) admission asks it for tokens beyond the pool's prefix hits, a request whose
load is asynchronous waits in WAITING_FOR_KV holding its blocks, each output carries the
connector's orders and each update its workers' report (``sched/kv_transfer.py``).

Jobs of their own: admission (``sched/admission.py``), the update from a step's
output (``sched/step_update.py``), the step's plan (``sched/step_plan.py``), stats
(``sched/counters.py``), preemption (``sched/preemption.py``), the KV connector's books
(``sched/kv_transfer.py``), stop checks, forks, victims, the prompt-token budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from baton.errors import InvalidRequestError
from baton.kv.hashing import update_block_hashes
from baton.kv.manager import KVCacheManager
from baton.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from baton.request import Request, RequestStatus
from baton.sched.admission import admit_waiting, check_request
from baton.sched.counters import SchedulerCounters
from baton.sched.decode_steps import plan_decode_steps
from baton.sched.forks import KVForks
from baton.sched.kv_transfer import KVTransfer, finish_output
from baton.sched.preemption import allocate_or_preempt, preempt
from baton.sched.slo import has_slo, met_slo
from baton.sched.step_budget import PrefillBudget
from baton.sched.step_budget import prefill_cap as step_prefill_cap
from baton.sched.step_plan import StepPlan
from baton.sched.step_time_model import StepShape
from baton.sched.step_update import RunnerStep, apply_step
from baton.sched.victims import VictimCandidate

if TYPE_CHECKING:
    from baton.config.sections import CacheSection, SchedulerSection
    from baton.interfaces import SchedulerPolicy
    from baton.kv.events import KVCacheEvent
    from baton.kv_transfer.connector import KVConnectorScheduler
    from baton.speculative.drafting import Drafts

log = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED
_ERROR = RequestStatus.FINISHED_ERROR
_ABORTED = RequestStatus.FINISHED_ABORTED


class Scheduler:
    """Decides each step's work and applies its results. See the module docstring."""

    def __init__(
        self,
        scheduler: SchedulerSection,
        cache: CacheSection,
        policy: SchedulerPolicy,
        num_blocks: int,
        clock: Callable[[], float] = time.monotonic,
        max_model_len: int | None = None,
        max_num_seqs_per_batch: int | None = None,
        drafts: Drafts | None = None,
        max_loras: int | None = None,
        enable_kv_cache_events: bool = False,
    ) -> None:
        """``scheduler`` / ``cache``: the config's sections; ``max_model_len``: the engine's;
        ``enable_kv_cache_events``: record the pool's KV events (``take_kv_events``)."""
        self.policy = policy
        #: Speculative decoding's bookkeeping (``speculative.method``); None: off.
        self.drafts = drafts
        #: The policy's optional finished(request) event; the kernel's default does nothing.
        self._policy_finished: Callable[[Request], object] | None = getattr(
            policy, "finished", None
        )
        #: The policy's optional choose_victim(candidates, now) (``baton.sched.victims``);
        #: without it, select_victim(running).
        self._policy_choose_victim: Callable[[list[VictimCandidate], float], Request] | None = (
            getattr(policy, "choose_victim", None)
        )
        self.clock = clock
        self._set_limits(scheduler, cache, max_num_seqs_per_batch)
        #: Most distinct LoRA adapters among running requests (lora.max_loras; None: LoRA off):
        #: a waiting request with another adapter waits until one of them has no request left.
        self.max_loras = max_loras
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_blocks, self.block_size, self.enable_caching, enable_kv_cache_events
        )
        #: Finished requests that keep their KV for forks (beam search), and the copies owed.
        self.forks = KVForks(self.kv)

        #: Every unfinished request by id (finished ones are dropped when they finish).
        self.requests: dict[str, Request] = {}
        #: Admitted requests in admission order; may hold finished/preempted ones until
        #: the next filter (``_running_dirty``), so removal is never an O(n) list.remove.
        self.running: list[Request] = []
        self._running_dirty = False
        self._waiting_for_fsm: dict[str, Request] = {}
        #: req id -> step id of the SchedulerOutput it is in flight in.
        self._in_flight: dict[str, int] = {}
        self._steps_in_flight: set[int] = set()
        #: req id -> how many of its tokens the runner has; present iff the runner knows it.
        self.num_sent: dict[str, int] = {}
        #: Runner news not yet sent: finished and preempted request ids.
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        #: Finished requests the policy has not been told of yet (its finished event).
        self._finished_for_policy: list[Request] = []
        self._step = 0
        self._last_num_scheduled = 0
        #: Preemptions, goodput and prefix-cache figures for ``make_stats``.
        self.counters = SchedulerCounters()
        #: The KV connector's scheduler half (``[kv_transfer]``, ``use_kv_connector``), and the
        #: kernel's books around it (``sched/kv_transfer.py``); None: no connector.
        self.kv_connector: KVConnectorScheduler | None = None
        self.kv_transfer: KVTransfer | None = None

    def use_kv_connector(self, connector: KVConnectorScheduler, name: str, role: str) -> None:
        """Serve through a KV connector's scheduler half (before any request is added)."""
        self.kv_connector = connector
        self.kv_transfer = KVTransfer(self, connector, name, role)
        self.hash_blocks = True  # its blocks are keyed by their hashes, prefix cache on or off

    def _set_limits(
        self, section: SchedulerSection, cache: CacheSection, max_num_seqs_per_batch: int | None
    ) -> None:
        """The scheduler's limits and switches, from its sections and the engine's override."""
        self.max_num_seqs = section.max_num_seqs
        #: Most requests in one SchedulerOutput (None: max_num_seqs). The batch queue sets it to
        #: ceil(max_num_seqs / batches) so that running requests spread over the batches in flight.
        self.max_num_seqs_per_batch = max_num_seqs_per_batch or self.max_num_seqs
        self.max_num_batched_tokens = section.max_num_batched_tokens
        self.enable_chunked_prefill = section.enable_chunked_prefill
        self.reserve_full_prompt = section.reserve_full_prompt
        # both caps need chunked prefill: without it a prompt is computed whole
        chunked = self.enable_chunked_prefill
        self.long_prefill_token_threshold = (
            section.long_prefill_token_threshold if chunked else None
        )
        self.max_num_partial_prefills = section.max_num_partial_prefills if chunked else None
        self.block_size = cache.block_size
        target_ms = section.target_step_ms if chunked else "off"
        #: The latency-aware prompt-token budget (``scheduler.target_step_ms``); None: off.
        self.prefill_budget = (
            PrefillBudget(
                None if target_ms == "auto" else float(target_ms) / 1000.0,
                min_tokens=self.block_size,
                max_tokens=self.max_num_batched_tokens,
            )
            if target_ms != "off"
            else None
        )
        #: Most decode steps one step runs (``sched/decode_steps.py``); 1: one.
        self.decode_steps = section.decode_steps
        self.enable_caching = cache.enable_prefix_caching
        #: Whether requests' block hashes are kept (the prefix cache's and a KV connector's keys).
        self.hash_blocks = self.enable_caching

    @property
    def total_preemptions(self) -> int:
        return self.counters.total_preemptions

    @property
    def total_slo_finished(self) -> int:
        return self.counters.total_slo_finished

    @property
    def total_slo_met(self) -> int:
        return self.counters.total_slo_met

    # ------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a request (WAITING, or WAITING_FOR_FSM until ``request.grammar`` is set)."""
        rid = request.request_id
        if rid in self.requests or rid in self.forks.retained:
            raise InvalidRequestError(
                f"request id {rid!r} is already in use by an unfinished request"
            )
        check_request(
            request,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            kv=self.kv,
        )
        if self.hash_blocks:
            update_block_hashes(request, self.block_size)
        if request.fork_from is not None:
            self.forks.fork(request)
        self.requests[rid] = request
        request.record_event(EngineCoreEventType.QUEUED, self.clock())
        if request.status == RequestStatus.WAITING_FOR_FSM:
            self._waiting_for_fsm[rid] = request
        else:
            request.status = _WAITING
            self.policy.add(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus
    ) -> list[Request]:
        """Finish requests in any state (aborts). Unknown or finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        done: list[Request] = []
        waiting: set[str] = set()
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                self.forks.release(rid)  # a finished request that kept its KV lets it go
                continue
            seen_by_policy = True
            if req.status == _WAITING or req.status == _PREEMPTED:
                waiting.add(rid)
            elif req.status == RequestStatus.WAITING_FOR_FSM:
                del self._waiting_for_fsm[rid]
                seen_by_policy = False  # its grammar never compiled: the policy never had it
            req.status = status
            self._in_flight.pop(rid, None)  # its in-flight output, if any, is dropped
            self._release(req, seen_by_policy)
            done.append(req)
        if waiting:
            self.policy.remove(waiting)
        self._tell_policy_finished()
        return done

    def _release(self, req: Request, seen_by_policy: bool = True) -> str | None:
        """Drop a finished request: blocks back to the pool (or held for the KV connector), the
        runner told next step, the policy told by the next ``_tell_policy_finished``. Returns
        the KV connector's error about it, if its ``request_finished`` raised."""
        rid = req.request_id
        retained = self.forks.retain(req)  # its blocks outlive it: the connector may not hold them
        kvt = self.kv_transfer
        held, error = kvt.release(req, may_hold=not retained) if kvt else (False, None)
        if not retained and not held:
            self.kv.free(req)
        del self.requests[rid]
        self._running_dirty = True
        if req.status != _ABORTED and has_slo(req):
            self.counters.slo_done(met_slo(req, self.clock()))
        if self.num_sent.pop(rid, None) is not None:
            self._finished_ids.append(rid)
        if self.drafts is not None:
            self.drafts.finished(req)
        if seen_by_policy and self._policy_finished is not None:
            self._finished_for_policy.append(req)
        return error

    def _tell_policy_finished(self) -> None:
        """The policy's finished event for each request released since the last call, in order."""
        if not self._finished_for_policy:
            return
        done, self._finished_for_policy = self._finished_for_policy, []
        finished = self._policy_finished
        assert finished is not None
        for req in done:
            finished(req)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_runner_news(self) -> bool:
        """Whether finished or preempted requests wait to be reported to the runner.

        With no unfinished request left, the next ``schedule()`` reports them in an
        output that schedules nothing: an idle engine steps once more to pass them on.
        """
        return bool(self._finished_ids or self._preempted_ids)

    def has_kv_transfers(self) -> bool:
        """Whether KV-connector loads or held blocks wait for a worker's report: the engine
        keeps stepping (without a forward when nothing runs) until they arrive."""
        return self.kv_transfer is not None and self.kv_transfer.busy()

    def has_requests_to_schedule(self) -> bool:
        """Whether a request exists that is not in flight and not waiting for its grammar."""
        if len(self.requests) - len(self._waiting_for_fsm) > len(self._in_flight):
            return True
        return any(r.grammar is not None for r in self._waiting_for_fsm.values())

    def reset_prefix_cache(self, reset_running: bool = False) -> bool:
        """Forget every prefix-cache entry; whether it was done.

        Refused (False, nothing changed) while requests hold blocks, unless
        ``reset_running``: then every running request is preempted first (as by
        the policy: it is recomputed later and produces the same tokens), so all
        blocks are free. Still refused while a request is in flight (a batch of
        the pipeline's queue): its blocks are being written.
        """
        if reset_running and self.running:
            if self._in_flight:
                return False
            now = self.clock()
            preempted: list[str] = []
            # latest admitted first: a policy that puts preempted requests first keeps their order
            for req in reversed(self.running):
                if req.status == _RUNNING:
                    preempt(self, req, now, preempted)
            self._preempted_ids.extend(preempted)
            self.counters.preempted(len(preempted))
        return self.kv.reset_prefix_cache()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The KV cache events since the last call, oldest first: the pool's BlockStored,
        BlockRemoved and AllBlocksCleared (medium "GPU"), then the KV connector's (its tiers'
        media); [] when KV events are off."""
        events = self.kv.take_events()
        if self.kv_transfer is not None and self.kv.pool.kv_events is not None:
            events += self.kv_transfer.take_events()
        return events

    # ------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work; see the module docstring."""
        now = self.clock()
        if self._waiting_for_fsm:
            self._release_ready_grammars()
        self._step += 1
        budget = self.max_num_batched_tokens
        plan = StepPlan(budget, step_prefill_cap(self) if self.prefill_budget is not None else None)
        prefill_cap = plan.prefill
        self._schedule_running(plan, now)
        if self._running_dirty:
            self.running = [r for r in self.running if r.status == _RUNNING]
            self._running_dirty = False
        if not plan.preempted:  # blocks ran short: admitting more would only preempt again
            admit_waiting(self, plan, now)
        plan.decode_steps = plan_decode_steps(self, plan)
        if self.prefill_budget is not None:
            prefill = prefill_cap - plan.prefill
            decode = budget - plan.budget - prefill
            self.prefill_budget.scheduled(
                self._step, StepShape(prefill, decode, plan.attention_pairs(self.requests))
            )
        return self._make_output(plan)

    def observe_step_time(self, step_id: int, seconds: float) -> None:
        """The measured wall time of step ``step_id`` (schedule to update), for the latency-aware
        budget; ignored when ``target_step_ms`` is off or the step scheduled nothing."""
        if self.prefill_budget is not None:
            self.prefill_budget.observe(step_id, seconds)

    def _schedule_running(self, plan: StepPlan, now: float) -> None:
        """Schedule running requests in admission order: decodes and next prompt chunks."""
        in_flight = self._in_flight
        num_sent = self.num_sent
        num_scheduled = plan.num_scheduled
        per_batch = self.max_num_seqs_per_batch
        long_prefill = self.long_prefill_token_threshold
        drafts = self.drafts
        if drafts is not None and not drafts.step_allows(len(self.running)):
            drafts = None
        max_model_len = self.max_model_len or 2**31
        for req in self.running:
            budget = plan.budget
            if budget <= 0 or len(num_scheduled) >= per_batch:
                break
            rid = req.request_id
            if req.status != _RUNNING or rid in in_flight:
                continue
            tokens = req.all_token_ids
            computed = req.num_computed_tokens
            ntok = len(tokens)
            n = ntok - computed
            if long_prefill and n > long_prefill:
                n = long_prefill
            if n > budget:
                n = budget
            chunk = ntok - computed > 1  # a prompt chunk, not a decode
            if chunk and n > plan.prefill:  # binds only under target_step_ms
                n = plan.prefill
            if n <= 0:
                continue
            new_ids = None
            if drafts is not None and not chunk:
                room = min(
                    budget - 1,
                    req.max_tokens - (ntok - req.num_prompt_tokens) - 1,
                    max_model_len - ntok - 1,
                )
                proposal = drafts.propose(req, room) if room > 0 else []
                if proposal:  # slots for drafts only if free: never worth a preemption
                    new_ids = self.kv.allocate_slots(req, 1 + len(proposal))
                    if new_ids is not None:
                        n = 1 + len(proposal)
                        plan.spec[rid] = proposal
            if new_ids is None:
                new_ids = allocate_or_preempt(self, req, n, plan, now)
            if new_ids is None:
                break  # the request preempted itself: nothing more fits
            num_scheduled[rid] = n
            plan.budget -= n
            if chunk:
                plan.prefill -= n
            plan.cached[rid] = (tokens[num_sent[rid] : ntok], new_ids, computed)
            num_sent[rid] = ntok
            computed += n
            req.num_computed_tokens = computed
            if req.grammar is not None and computed >= ntok:  # it samples (> : with drafts)
                plan.so_ids.append(rid)

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        """Mark the scheduled requests in flight, attach the runner's news, build the output."""
        step_id = self._step
        num_scheduled = plan.num_scheduled
        preempted = plan.preempted
        self.counters.preempted(len(preempted))
        if num_scheduled:
            self._in_flight.update(dict.fromkeys(num_scheduled, step_id))
            self._steps_in_flight.add(step_id)
        if num_scheduled or not self.requests:
            # idle (e.g. after an abort): nothing else would carry the news, so it goes now
            finished_ids, self._finished_ids = self._finished_ids, []
            copies = self.forks.take_copies()
            if self._preempted_ids:
                preempted[:0] = self._preempted_ids
                self._preempted_ids = []
        else:
            # an empty output with work pending may never reach the runner (the batch
            # queue skips it): keep its news for the next output that does
            finished_ids = []
            copies = []
            self._preempted_ids.extend(preempted)
            preempted = []
        total = self.max_num_batched_tokens - plan.budget
        self._last_num_scheduled = total
        out = plan.to_output(step_id, total, finished_ids, preempted, copies)
        if self.kv_transfer is not None:
            out.kv_connector_metadata = self.kv_transfer.build(step_id, num_scheduled, plan.spec)
        return out

    def _release_ready_grammars(self) -> None:
        ready = [r for r in self._waiting_for_fsm.values() if r.grammar is not None]
        for req in ready:
            del self._waiting_for_fsm[req.request_id]
            req.status = _WAITING
            self.policy.add(req)

    # ------------------------------------------------------ update_from_output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput | None
    ) -> list[EngineCoreOutput]:
        """Apply one step's sampled tokens: stop checks, prefix-cache registration, outputs.

        Returns one EngineCoreOutput per request that got tokens or finished.
        Requests finished (aborted) while the step was in flight are skipped. A
        request the runner reports failed, or whose update here raises, finishes
        with FinishReason.ERROR (also in a mid-prompt chunk); the others go on.
        """
        step_id = scheduler_output.step_id
        self._steps_in_flight.discard(step_id)
        runner = RunnerStep.of(model_runner_output)
        failed = runner.failed
        in_flight = self._in_flight
        spec = scheduler_output.scheduled_spec_decode_tokens
        now = self.clock()
        outputs: list[EngineCoreOutput] = []
        if self.kv_transfer is not None:  # the connector's report first: it may fail requests
            kv_failed, outputs = self.kv_transfer.update(
                step_id,
                model_runner_output.kv_connector if model_runner_output else None,
                scheduler_output.num_scheduled_tokens,
            )
            failed = {**(failed or {}), **kv_failed}
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            if in_flight.get(rid) != step_id:
                continue
            del in_flight[rid]
            req = self.requests[rid]
            # the runner left it out: its KV for this step is unwritten
            if failed and rid in failed:
                outputs.append(self._finish_with_error(req, failed[rid]))
                continue
            try:
                out = apply_step(
                    self,
                    req,
                    n,
                    step_id,
                    runner,
                    spec.get(rid) if spec else None,
                    now,
                    scheduler_output.decode_steps,
                )
                if out is None:
                    continue
                if req.status.finished:
                    error = self._release(req)
                    if self.kv_transfer is not None:
                        finish_output(out, req, error)
            except Exception as e:  # a stop check, grammar or hashing fault fails this request only
                message = f"{type(e).__name__}: {e}"
                log.warning("request %s failed in the scheduler's update: %s", rid, message)
                log.debug("request %s: traceback", rid, exc_info=e)
                out = self._finish_with_error(req, message)
            outputs.append(out)
        self._tell_policy_finished()
        return outputs

    def _finish_with_error(self, req: Request, message: str) -> EngineCoreOutput:
        """Finish a request that failed this step (FINISHED_ERROR, blocks released); its output."""
        req.error = message
        self.finish_requests(req.request_id, _ERROR)  # a no-op if it was released already
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            events=req.take_events(),
            error=message,
        )

    # ------------------------------------------------------------------ stats

    def make_stats(self, delta: bool = True) -> SchedulerStats:
        """The figures after the latest step.

        ``delta=True`` (each step's stats): counters are deltas since the previous such call.
        ``delta=False`` (a snapshot, e.g. the get_stats utility): counters are totals; nothing is reset.
        """
        num_running = (
            sum(1 for r in self.running if r.status == _RUNNING)
            if self._running_dirty
            else len(self.running)
        )
        stats = self.counters.make_stats(
            delta,
            kv=self.kv,
            drafts=self.drafts,
            step=self._step,
            num_running=num_running,
            num_waiting=len(self.policy)
            + len(self._waiting_for_fsm)
            + (len(self.kv_transfer.loading) if self.kv_transfer else 0),
            num_scheduled=self._last_num_scheduled,
            num_batches_in_flight=len(self._steps_in_flight),
        )
        if delta and self.kv_transfer is not None:
            stats.kv_transfer = self.kv_transfer.take_stats()
        return stats
