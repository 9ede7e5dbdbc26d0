"""Drive a scheduler policy through the real Scheduler + KVCacheManager + FakeExecutor.

``PolicyHarness`` runs requests step by step on a simulated clock (``step_s``
seconds per step), feeding arrivals as their time comes, and records what a
test needs: tokens per request, finish reasons, first-admission times,
preemptions and a trace of every step (for determinism checks). The policy is
wrapped in ``CheckedPolicy``, which asserts the ``SchedulerPolicy`` contract
on every call (and receives the kernel's ``finished`` event, passing it on to a
policy that has one), and after every step the harness checks that the policy
holds exactly the requests the mechanism thinks are waiting, and that every
request that finished was reported to it once.

Tokens come from the FakeExecutor: a pure function of a request's tokens, so
``expected_tokens`` gives the right output of any request, whatever the
batching, chunking or preemption.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from baton.config import BatonConfig
from baton.protocol import FinishReason
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


class PolicyHarness:
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
        self.now = 0.0
        self.scheduler = Scheduler(
            config, self.policy, num_blocks, clock=lambda: self.now, max_model_len=None
        )
        self.executor = FakeExecutor(
            block_size=config.cache.block_size, num_blocks=num_blocks, deep_check=deep_check
        )
        #: Submitted, not yet arrived: by arrival time, equal times in the order submitted.
        self.pending: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, FinishReason] = {}
        self.admitted_at: dict[str, float] = {}
        self.aborted: set[str] = set()
        #: Requests the next step that schedules them reports failed, as a runner would.
        self.to_fail: set[str] = set()
        self.trace: list[tuple[Any, ...]] = []
        self.num_preemptions = 0
        self.steps = 0

    def submit(self, *requests: Request) -> None:
        """Requests enter the scheduler when the clock reaches their ``arrival_time``; those
        with equal arrival times in the order they were submitted."""
        for r in requests:
            self.requests[r.request_id] = r
            self.pending.append(r)
        self.pending.sort(key=lambda r: r.arrival_time)  # stable: ties keep submission order
        self._arrive()

    def _arrive(self) -> None:
        due = 0
        while due < len(self.pending) and self.pending[due].arrival_time <= self.now:
            self.scheduler.add_request(self.pending[due])
            due += 1
        del self.pending[:due]

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

    def step(self) -> None:
        if not self.scheduler.has_unfinished_requests() and self.pending:
            self.now = max(self.now, self.pending[0].arrival_time)
        self._arrive()
        so = self.scheduler.schedule()
        for new in so.scheduled_new_reqs:
            self.admitted_at.setdefault(new.req_id, self.now)
        mro = self.executor.execute_model(so)
        failing = self.to_fail.intersection(so.num_scheduled_tokens)
        if failing and mro is not None:
            self.to_fail -= failing
            failed = {rid: "RuntimeError: injected by PolicyHarness.fail" for rid in failing}
            mro = msgspec.structs.replace(mro, failed={**(mro.failed or {}), **failed})
        outs = self.scheduler.update_from_output(so, mro)
        self.num_preemptions += len(so.preempted_req_ids)
        self.trace.append((tuple(so.num_scheduled_tokens.items()), tuple(so.preempted_req_ids)))
        for o in outs:
            rid = o.request_id
            assert rid not in self.finished, f"{rid!r} got output after it finished"
            assert rid not in self.aborted, f"{rid!r} got output after it was aborted"
            self.tokens.setdefault(rid, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finished[rid] = o.finish_reason
                told = self.policy.told.get(rid)
                assert told is not None and told.finish_reason == o.finish_reason, (
                    f"{rid!r} finished ({o.finish_reason}) but the policy was told {told}"
                )
        self.policy.check()
        self.steps += 1
        self.now += self.step_s

    def run(self, max_steps: int = 20_000) -> PolicyHarness:
        for _ in range(max_steps):
            if not self.pending and not self.scheduler.has_unfinished_requests():
                return self
            self.step()
        stuck = [r for r in self.scheduler.requests.values()]
        raise AssertionError(f"not finished after {max_steps} steps; unfinished: {stuck[:10]}")

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
