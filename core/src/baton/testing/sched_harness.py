"""Drive the real Scheduler + KVCacheManager + FakeExecutor step by step: baton's one
scheduler driver, for tests, policy authors, ``baton bench scheduler`` and the simulator.

``SchedulerDriver`` runs schedule -> execute -> update, feeds submitted requests in as a
simulated clock (``SimClock``) reaches their ``arrival_time`` (jumping ahead when nothing
runs), and records tokens, finish reasons, outputs and preemptions. ``schedule()`` and
``finish_step()`` are the two halves of a step, for a caller that executes the step itself
(the simulator times it with a cost model).

``PolicyHarness`` runs a policy on it with a fixed ``step_s`` per step and records what a
policy test needs: first-admission times and a trace of every step (for determinism
checks). The policy is wrapped in ``CheckedPolicy``, which asserts the ``SchedulerPolicy``
contract on every call (and receives the kernel's ``finished`` event, passing it on to a
policy that has one), and after every step the harness checks that the policy holds exactly
the requests the mechanism thinks are waiting, and that every request that finished was
reported to it once.

Tokens come from the FakeExecutor: a pure function of a request's tokens, so
``expected_tokens`` gives the right output of any request, whatever the
batching, chunking or preemption.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from baton.config import BatonConfig
from baton.protocol import EngineCoreOutput, FinishReason, ModelRunnerOutput, SchedulerOutput
from baton.request import Request, RequestStatus
from baton.sampling_params import SamplingParams
from baton.sched.scheduler import Scheduler
from baton.sched.victims import VictimCandidate
from baton.scheduling_info import SchedulingInfo
from baton.testing.fake_executor import FakeExecutor

_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class CheckedPolicy:
    """Forwards to a policy and asserts the SchedulerPolicy contract on every call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.queued: dict[str, Request] = {}  # what the policy must hold
        self._peeked: Request | None = None
        self.num_victims = 0
        #: request id -> its status when the kernel's finished event came (once per request)
        self.told: dict[str, RequestStatus] = {}

    def add(self, request: Request) -> None:
        rid = request.request_id
        assert rid not in self.queued, f"{rid!r} added twice without pop/remove"
        assert request.status in _QUEUED, f"add({rid!r}) with status {request.status.name}"
        self.inner.add(request)
        self.queued[rid] = request
        self._peeked = None

    def peek(self, now: float) -> Request | None:
        req = self.inner.peek(now)
        if req is not None:
            got = self.queued.get(req.request_id)
            assert got is req, f"peek returned {req!r}, which is not waiting in the policy"
        self._peeked = req
        return req

    def pop(self, request: Request) -> None:
        assert request is self._peeked, (
            f"pop({request!r}) is not what peek just returned ({self._peeked!r})"
        )
        self.inner.pop(request)
        del self.queued[request.request_id]
        self._peeked = None

    def remove(self, request_ids: set[str]) -> list[Request]:
        removed = self.inner.remove(set(request_ids))
        want = {rid for rid in request_ids if rid in self.queued}
        got = [r.request_id for r in removed]
        assert len(got) == len(set(got)), f"remove returned duplicates: {got}"
        assert set(got) == want, (
            f"remove({sorted(request_ids)}) returned {sorted(got)}, expected {sorted(want)}"
        )
        for rid in want:
            assert removed[got.index(rid)] is self.queued.pop(rid)
        self._peeked = None
        return removed

    def select_victim(self, running: Sequence[Request]) -> Request:
        assert running, "select_victim called with no candidates"
        victim = self.inner.select_victim(running)
        assert any(victim is r for r in running), (
            f"select_victim returned {victim!r}, not one of the candidates"
        )
        self.num_victims += 1
        return victim

    def choose_victim(self, candidates: Sequence[VictimCandidate], now: float) -> Request:
        """The data-rich victim call (``baton.sched.victims``): checks the candidates' data and
        passes them on to a policy with ``choose_victim``, else their requests to
        ``select_victim``."""
        assert candidates, "choose_victim called with no candidates"
        assert sum(c.is_requester for c in candidates) == 1, "not exactly one requester"
        for c in candidates:
            r = c.request
            assert c.num_computed_tokens == r.num_computed_tokens, (r, c)
            assert c.num_output_tokens == r.num_output_tokens and c.max_tokens == r.max_tokens
            assert c.num_blocks > 0, f"{r!r} runs without a KV block"
        inner = getattr(self.inner, "choose_victim", None)
        if inner is None:
            return self.select_victim([c.request for c in candidates])
        victim = inner(candidates, now)
        assert any(victim is c.request for c in candidates), (
            f"choose_victim returned {victim!r}, not one of the candidates"
        )
        self.num_victims += 1
        return victim

    def finished(self, request: Request) -> None:
        """The kernel's finished event: once per request, after it left the policy."""
        rid = request.request_id
        assert request.status.finished, f"finished({rid!r}) with status {request.status.name}"
        assert rid not in self.told, f"finished({rid!r}) told twice"
        assert rid not in self.queued, f"finished({rid!r}) while the policy still holds it"
        self.told[rid] = request.status
        inner = getattr(self.inner, "finished", None)  # optional: the kernel's default ignores it
        if inner is not None:
            inner(request)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.inner)

    def check(self) -> None:
        """The policy holds exactly the queued requests, each once."""
        ids = [r.request_id for r in self.inner]
        assert len(ids) == len(set(ids)), f"__iter__ yields duplicates: {ids}"
        assert set(ids) == set(self.queued), (
            f"policy holds {sorted(ids)}, the scheduler queued {sorted(self.queued)}"
        )
        assert len(self.inner) == len(ids), (
            f"len() is {len(self.inner)}, __iter__ yields {len(ids)}"
        )


class SimClock:
    """A scheduler clock that moves only when told: ``Scheduler(..., clock=SimClock())``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class SchedulerDriver:
    """schedule -> execute -> update on a real Scheduler and a FakeExecutor, recording the
    outputs; requests enter at once (``add``) or when ``clock`` reaches their arrival
    (``submit``).

    ``clock`` is the ``SimClock`` the scheduler was built with (None: the scheduler's own
    clock, and no ``submit``). With ``record=False`` only the counts are kept (long replays).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: FakeExecutor | None = None,
        *,
        clock: SimClock | None = None,
        record: bool = True,
        **executor_kw: Any,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor or FakeExecutor(
            block_size=scheduler.block_size,
            num_blocks=scheduler.kv.pool.num_blocks,
            deep_check=True,
            **executor_kw,
        )
        self.clock = clock
        self.keep = record
        #: Submitted, not yet arrived: by arrival time, equal times in the order submitted.
        self.pending: list[Request] = []
        self.tokens: dict[str, list[int]] = {}
        #: request id -> its finish reason, in the order requests finished
        self.finished: dict[str, FinishReason] = {}
        #: request id -> the output it finished with
        self.final_outputs: dict[str, EngineCoreOutput] = {}
        self.outputs: list[EngineCoreOutput] = []
        self.scheduler_outputs: list[SchedulerOutput] = []
        self.num_preemptions = 0
        self.steps = 0
        #: Wall seconds of the last ``schedule()`` / ``update_from_output()``, and of every
        #: ``add_request`` that ``submit`` made (what ``baton bench scheduler`` times).
        self.schedule_s = 0.0
        self.update_s = 0.0
        self.add_s = 0.0

    def add(self, *requests: Request) -> None:
        """Requests enter the scheduler now, whatever their ``arrival_time``."""
        for r in requests:
            self.scheduler.add_request(r)

    def submit(self, *requests: Request) -> None:
        """Requests enter the scheduler when the clock reaches their ``arrival_time``; those
        with equal arrival times in the order they were submitted."""
        if self.clock is None:
            raise ValueError("submit() needs a SimClock: SchedulerDriver(..., clock=SimClock())")
        self.pending.extend(requests)
        self.pending.sort(key=lambda r: r.arrival_time)  # stable: ties keep submission order
        self.arrive()

    def arrive(self) -> None:
        """Add the submitted requests whose arrival time has come."""
        if not self.pending:
            return
        now = self.clock()  # type: ignore[misc]  # pending only with a clock (submit)
        due = 0
        perf = time.perf_counter
        while due < len(self.pending) and self.pending[due].arrival_time <= now:
            t0 = perf()
            self.scheduler.add_request(self.pending[due])
            self.add_s += perf() - t0
            due += 1
        del self.pending[:due]

    def has_work(self) -> bool:
        return bool(self.pending) or self.scheduler.has_unfinished_requests()

    def schedule(self) -> SchedulerOutput:
        """The first half of a step: idle until the next arrival when nothing runs, add what
        arrived, ``schedule()``."""
        if self.pending and not self.scheduler.has_unfinished_requests():
            self.clock.now = max(self.clock.now, self.pending[0].arrival_time)  # type: ignore[union-attr]
        self.arrive()
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        self.schedule_s = time.perf_counter() - t0
        if self.keep:
            self.scheduler_outputs.append(so)
        return so

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.executor.execute_model(so)

    def finish_step(
        self, so: SchedulerOutput, mro: ModelRunnerOutput | None
    ) -> list[EngineCoreOutput]:
        """The second half of a step: ``update_from_output``, then record its outputs."""
        t0 = time.perf_counter()
        outs = self.scheduler.update_from_output(so, mro)
        self.update_s = time.perf_counter() - t0
        self.num_preemptions += len(so.preempted_req_ids)
        self.steps += 1
        self.record(outs)
        return outs

    def step(self) -> list[EngineCoreOutput]:
        so = self.schedule()
        return self.finish_step(so, self.execute(so))

    def record(self, outs: list[EngineCoreOutput]) -> None:
        for o in outs:
            rid = o.request_id
            assert rid not in self.finished, f"{rid!r} got output after it finished"
            if self.keep:
                self.outputs.append(o)
                self.tokens.setdefault(rid, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finished[rid] = o.finish_reason
                self.final_outputs[rid] = o

    def run(self, max_steps: int = 20_000) -> SchedulerDriver:
        for _ in range(max_steps):
            if not self.has_work():
                return self
            self.step()
        stuck = list(self.scheduler.requests.values())
        raise AssertionError(f"not finished after {max_steps} steps; unfinished: {stuck[:10]}")


class PolicyHarness(SchedulerDriver):
    """A real Scheduler with ``policy`` and a FakeExecutor on a simulated clock."""

    def __init__(
        self,
        policy: Any,
        config: BatonConfig,
        num_blocks: int = 1024,
        step_s: float = 0.02,
        deep_check: bool = True,
    ) -> None:
        self.policy = CheckedPolicy(policy)
        self.config = config
        self.step_s = step_s
        clock = SimClock()
        super().__init__(
            Scheduler(
                config.scheduler,
                config.cache,
                self.policy,
                num_blocks,
                clock=clock,
                max_model_len=config.model.max_model_len,
            ),
            FakeExecutor(
                block_size=config.cache.block_size, num_blocks=num_blocks, deep_check=deep_check
            ),
            clock=clock,
        )
        self.requests: dict[str, Request] = {}
        self.admitted_at: dict[str, float] = {}
        self.aborted: set[str] = set()
        #: Requests the next step that schedules them reports failed, as a runner would.
        self.to_fail: set[str] = set()
        self.trace: list[tuple[Any, ...]] = []

    @property
    def now(self) -> float:
        return self.clock.now  # type: ignore[union-attr]

    @now.setter
    def now(self, value: float) -> None:
        self.clock.now = value  # type: ignore[union-attr]

    def submit(self, *requests: Request) -> None:
        for r in requests:
            self.requests[r.request_id] = r
        super().submit(*requests)

    def abort(self, request_ids: Sequence[str]) -> None:
        done = self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
        self.aborted.update(request_ids)
        for r in done:
            assert self.policy.told.get(r.request_id) == RequestStatus.FINISHED_ABORTED, (
                f"{r.request_id!r} was aborted but the policy was not told"
            )
        self.policy.check()

    def fail(self, request_ids: Sequence[str]) -> None:
        """The next step that schedules these requests reports them failed (finish reason error)."""
        self.to_fail.update(request_ids)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        for new in so.scheduled_new_reqs:
            self.admitted_at.setdefault(new.req_id, self.now)
        mro = self.executor.execute_model(so)
        failing = self.to_fail.intersection(so.num_scheduled_tokens)
        if failing and mro is not None:
            self.to_fail -= failing
            failed = {rid: "RuntimeError: injected by PolicyHarness.fail" for rid in failing}
            mro = msgspec.structs.replace(mro, failed={**(mro.failed or {}), **failed})
        self.trace.append((tuple(so.num_scheduled_tokens.items()), tuple(so.preempted_req_ids)))
        return mro

    def record(self, outs: list[EngineCoreOutput]) -> None:
        for o in outs:
            assert o.request_id not in self.aborted, (
                f"{o.request_id!r} got output after it was aborted"
            )
        super().record(outs)
        for o in outs:
            if o.finish_reason is not None:
                told = self.policy.told.get(o.request_id)
                assert told is not None and told.finish_reason == o.finish_reason, (
                    f"{o.request_id!r} finished ({o.finish_reason}) but the policy was told {told}"
                )

    def step(self) -> list[EngineCoreOutput]:
        outs = super().step()
        self.policy.check()
        self.now += self.step_s
        return outs

    def expected(self, request: Request) -> list[int]:
        return expected_tokens(self.executor, request)

    def wait_steps(self, request_id: str) -> float:
        """Steps from arrival to first admission."""
        return (self.admitted_at[request_id] - self.requests[request_id].arrival_time) / self.step_s


def expected_tokens(executor: FakeExecutor, request: Request) -> list[int]:
    """What ``executor`` generates for ``request`` (all ``max_tokens`` of them; no EOS)."""
    tokens = list(request.prompt_token_ids)
    n = request.num_prompt_tokens
    for _ in range(request.max_tokens):
        tokens.append(executor.next_token(tokens, n))
    return tokens[n:]


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    *,
    arrival_time: float = 0.0,
    priority: int = 0,
    user: str | None = None,
    salt: int = 0,
    scheduling: SchedulingInfo | None = None,
    stop_token_ids: list[int] | None = None,
) -> Request:
    """A request with a deterministic prompt derived from its id (distinct ids, distinct prompts).

    ``scheduling``'s priority, when not 0, is the request's priority.
    """
    seed = sum(map(ord, rid)) + salt
    prompt = [(7 * i + 13 * seed) % 997 + 1 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop_token_ids)
    return Request(
        rid,
        prompt,
        params,
        eos_token_id=0,
        arrival_time=arrival_time,
        priority=priority,
        user=user,
        scheduling=scheduling,
    )


USERS = ("alice", "bob", "carol", None)


def random_requests(
    seed: int,
    n: int = 40,
    *,
    max_prompt: int = 80,
    max_tokens: int = 24,
    spread_s: float = 0.5,
    priorities: Sequence[int] = (-1, 0, 1),
    users: Sequence[str | None] = USERS,
) -> list[Request]:
    """A mixed workload: random lengths, priorities, users and arrival times in [0, spread_s);
    every other request has an SLO (some TTFT and TPOT targets easy, some impossible, so that
    a policy reading them sees requests become hopeless)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt_len = rng.randint(1, max_prompt)
        max_new = rng.randint(1, max_tokens)
        arrival = round(rng.uniform(0, spread_s), 3) if i else 0.0
        priority = rng.choice(list(priorities))
        user = rng.choice(list(users))
        slo = SLO_CHOICES[i % len(SLO_CHOICES)]  # no rng draw: the workloads stay as they were
        out.append(
            make_request(
                f"s{seed}-r{i}",
                prompt_len,
                max_new,
                arrival_time=arrival,
                priority=priority,
                user=user,
                salt=seed,
                scheduling=SchedulingInfo(
                    priority=priority, slo_ttft_ms=slo[0], slo_tpot_ms=slo[1]
                ),
            )
        )
    return out


#: (slo_ttft_ms, slo_tpot_ms) of ``random_requests``, by request index: none, easy, impossible.
SLO_CHOICES: tuple[tuple[float | None, float | None], ...] = (
    (None, None),
    (5000.0, 500.0),
    (None, None),
    (1.0, None),
    (None, None),
    (100.0, 1.0),
)
