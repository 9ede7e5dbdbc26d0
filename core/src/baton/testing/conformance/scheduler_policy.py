"""Conformance suite for scheduler policies: subclass ``SchedulerPolicyConformance``.

    from baton.testing.conformance.scheduler_policy import SchedulerPolicyConformance

    class TestMyPolicy(SchedulerPolicyConformance):
        name = "mine"                    # looked up in the plugin registry
        settings = {"aging": 2.0}        # the [scheduler.mine] sub-table (optional)

or override ``make_policy(self, config)`` to build the policy yourself. Every
test drives the real ``Scheduler`` and ``KVCacheManager`` with the
``FakeExecutor`` (``baton.testing.sched_harness``): each request must finish
with exactly its tokens (none lost, none repeated, identical after
preemption), the policy must hold exactly the requests the mechanism queued
after every step, ``select_victim`` must return one of its candidates, aborts
of waiting requests go through ``remove``, two runs of one workload must be
identical, no request may wait beyond a bound while a flood of shorter
requests keeps arriving, and every request, however it ends (stop, length,
abort, error), is reported once to the policy's optional ``finished`` (a policy
without one passes the same checks).

Class attributes tune the suite: ``admission_control`` (the policy's ``peek``
may return None while requests wait; the checks then advance time and finish
the requests admitted so far), the starvation workload's length
(``starvation_flood_steps``) and the bound (``starvation_max_wait_steps``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from baton.config import BatonConfig
from baton.interfaces import SchedulerPolicy
from baton.plugins.registry import get_registry
from baton.request import Request, RequestStatus
from baton.testing.sched_harness import PolicyHarness, make_request, random_requests


class _Gate:
    """Admission control on top of a policy: ``peek`` answers None on some calls."""

    def __init__(self, inner: Any, harness: PolicyHarness, every: int = 3) -> None:
        self.inner, self.harness, self.every, self.calls = inner, harness, every, 0

    def peek(self, now: float) -> Request | None:
        self.calls += 1
        if self.harness.steps % self.every == 1 or now < 0.1:
            return None
        return self.inner.peek(now)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Any:
        return iter(self.inner)


class SchedulerPolicyConformance:
    """Behaviour every scheduler policy must show. Set ``name`` or override ``make_policy``."""

    pytestmark = [pytest.mark.timeout(120)]

    #: The registered policy name (used by the default ``make_policy``).
    name: ClassVar[str | None] = None
    #: The policy's ``[scheduler.<name>]`` settings for every test.
    settings: ClassVar[dict[str, Any]] = {}
    #: True if ``peek`` may return None while requests wait (the drain checks then finish the
    #: admitted requests and advance time).
    admission_control: ClassVar[bool] = False
    #: Seeds of the randomised workloads.
    seeds: ClassVar[tuple[int, ...]] = (0, 1)
    #: Steps of the overload flood in the starvation test, and the longest wait allowed in it
    #: (None: 60% of the flood, while a policy that starves waits longer than the whole flood).
    starvation_flood_steps: ClassVar[int] = 400
    starvation_max_wait_steps: ClassVar[float | None] = None

    # ------------------------------------------------------------------ building

    def config(self, **overrides: Any) -> BatonConfig:
        base: dict[str, Any] = dict(
            block_size=16,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            enable_chunked_prefill=True,
            enable_prefix_caching=True,
            max_model_len=None,
        )
        base.update(overrides)
        name = self.name or "fcfs"
        section = {"policy": name, **({name: dict(self.settings)} if self.settings else {})}
        return BatonConfig.load(scheduler=section, **base)

    def make_policy(self, config: BatonConfig) -> SchedulerPolicy:
        """Build the policy under test (default: ``name`` from the plugin registry)."""
        if self.name is None:
            raise NotImplementedError("set `name` or override make_policy(self, config)")
        entry = get_registry().get("scheduler_policy", self.name)
        return entry.create(config, entry.settings(config))

    def harness(self, num_blocks: int = 1024, **config: Any) -> PolicyHarness:
        cfg = self.config(**config)
        return PolicyHarness(self.make_policy(cfg), cfg, num_blocks=num_blocks)

    def _drain(self, policy: Any) -> list[str]:
        """Admit everything: pop what peek gives; when it gives None (admission control), the
        admitted requests finish (the policy's ``finished``, if it has one) and time advances."""
        out, now = [], 0.0
        admitted: list[Request] = []
        for _ in range(100_000):
            if not len(policy):
                return out
            req = policy.peek(now)
            if req is None:
                assert self.admission_control, (
                    "peek returned None while requests wait (set admission_control)"
                )
                finished = getattr(policy, "finished", None)
                for r in admitted:
                    r.status = RequestStatus.FINISHED_STOPPED
                    if finished is not None:
                        finished(r)
                admitted.clear()
                now += 1.0
                continue
            policy.pop(req)
            req.status = RequestStatus.RUNNING
            admitted.append(req)
            out.append(req.request_id)
        raise AssertionError("the policy never admitted its waiting requests")

    def _assert_complete(
        self, h: PolicyHarness, requests: list[Request], aborted: set[str] = frozenset()
    ) -> None:
        for r in requests:
            rid = r.request_id
            if rid in aborted:
                continue
            assert rid in h.finished, f"{rid!r} never finished"
            got = h.tokens.get(rid, [])
            assert len(got) == r.max_tokens, f"{rid!r}: {len(got)} tokens, expected {r.max_tokens}"
            assert got == h.expected(r), f"{rid!r}: wrong tokens (lost, repeated or reordered)"

    # ------------------------------------------------------------------ the protocol

    def test_implements_the_protocol(self) -> None:
        policy = self.make_policy(self.config())
        assert isinstance(policy, SchedulerPolicy)
        assert len(policy) == 0 and list(policy) == [] and policy.peek(0.0) is None
        assert policy.remove({"nobody"}) == []

    def test_queue_bookkeeping(self) -> None:
        policy = self.make_policy(self.config())
        reqs = random_requests(7, n=30)
        for r in reqs:
            policy.add(r)
        assert len(policy) == 30 and sorted(r.request_id for r in policy) == sorted(
            r.request_id for r in reqs
        )
        first = policy.peek(1.0)
        if first is not None:
            assert policy.peek(1.0) is first, "peek must not change the queue"
            assert any(first is r for r in policy)
            policy.pop(first)
            assert len(policy) == 29 and all(r is not first for r in policy)
        gone = {r.request_id for r in reqs[3:9]} - ({first.request_id} if first else set())
        removed = policy.remove(gone | {"nobody"})
        assert sorted(r.request_id for r in removed) == sorted(gone)
        assert policy.remove(gone) == [], "a second remove of the same ids must find nothing"
        left = {r.request_id for r in policy}
        assert not left & gone and len(policy) == len(left) == 29 - len(gone) + (first is None)
        drained = self._drain(policy)
        assert sorted(drained) == sorted(left), (
            "draining must admit every waiting request exactly once"
        )
        assert len(policy) == 0 and policy.peek(2.0) is None

    def test_preempted_request_comes_back(self) -> None:
        policy = self.make_policy(self.config())
        reqs = [
            make_request(f"p{i}", 10 + i, 8, arrival_time=0.01 * i, user="alice") for i in range(4)
        ]
        for r in reqs:
            policy.add(r)
        head = policy.peek(1.0)
        assert head is not None or self.admission_control
        if head is None:
            return
        policy.pop(head)
        head.status = RequestStatus.RUNNING
        assert policy.select_victim([head]) is head
        head.status = RequestStatus.PREEMPTED
        policy.add(head)
        assert len(policy) == 4 and any(r is head for r in policy)
        assert sorted(self._drain(policy)) == sorted(r.request_id for r in reqs)

    def test_select_victim_returns_a_candidate(self) -> None:
        policy = self.make_policy(self.config())
        running = random_requests(3, n=12)
        for r in running:
            r.status = RequestStatus.RUNNING
        for k in range(1, len(running) + 1):
            victim = policy.select_victim(running[:k])
            assert any(victim is r for r in running[:k]), f"victim {victim!r} is not a candidate"

    def test_readding_after_remove(self) -> None:
        policy = self.make_policy(self.config())
        r = make_request("again", 12, 4)
        policy.add(r)
        assert policy.remove({"again"}) == [r] and len(policy) == 0
        policy.add(r)
        assert len(policy) == 1 and self._drain(policy) == ["again"]

    # ------------------------------------------------------------------ with the mechanism

    @pytest.mark.parametrize("seed_index", [0, 1])
    def test_every_request_finishes_with_its_tokens(self, seed_index: int) -> None:
        seed = self.seeds[seed_index % len(self.seeds)]
        h = self.harness()
        reqs = random_requests(seed, n=40)
        h.submit(*reqs)
        h.run()
        self._assert_complete(h, reqs)

    def test_preempted_requests_resume_with_identical_tokens(self) -> None:
        h = self.harness(num_blocks=24, max_num_seqs=8, max_num_batched_tokens=64)
        reqs = [
            make_request(
                f"t{i}",
                20 + 7 * (i % 5),
                40 + 5 * (i % 3),
                arrival_time=0.01 * i,
                user=("alice", "bob")[i % 2],
                priority=i % 3 - 1,
            )
            for i in range(16)
        ]
        h.submit(*reqs)
        h.run()
        assert h.num_preemptions > 0 and h.policy.num_victims > 0, (
            "the workload should have preempted"
        )
        assert any(r.num_preemptions for r in reqs)
        self._assert_complete(h, reqs)

    def test_aborts_of_waiting_and_preempted_requests(self) -> None:
        h = self.harness(num_blocks=24, max_num_seqs=4, max_num_batched_tokens=64)
        reqs = [
            make_request(f"a{i}", 16 + 5 * (i % 4), 30, user=("alice", "bob", None)[i % 3])
            for i in range(20)
        ]
        h.submit(*reqs)
        for _ in range(6):
            h.step()
        queued = [r.request_id for r in h.policy.inner]
        assert len(queued) >= 4, "the workload should leave requests waiting"
        victims = queued[::2]
        h.abort([*victims, "nobody"])
        assert not {r.request_id for r in h.policy.inner} & set(victims)
        for _ in range(10_000):  # abort a preempted one too, when there is one
            if (
                any(r.status == RequestStatus.PREEMPTED for r in h.policy.inner)
                or not h.scheduler.requests
            ):
                break
            h.step()
        preempted = [r.request_id for r in h.policy.inner if r.status == RequestStatus.PREEMPTED]
        running = [r.request_id for r in h.scheduler.running if r.status == RequestStatus.RUNNING]
        h.abort(preempted[:1] + running[:1])
        h.run()
        self._assert_complete(h, reqs, aborted=h.aborted)
        assert len(h.policy) == 0

    def test_finished_is_told_once_however_a_request_ends(self) -> None:
        h = self.harness(num_blocks=24, max_num_seqs=4, max_num_batched_tokens=64)
        reqs = []
        for i in range(16):
            r = make_request(
                f"f{i}", 16 + 5 * (i % 4), 30, arrival_time=0.01 * i, user=("a", "b", None)[i % 3]
            )
            if i % 4 == 0:  # stops on the third token the fake executor gives it
                stop = [h.expected(r)[2]]
                r = make_request(
                    r.request_id,
                    r.num_prompt_tokens,
                    30,
                    arrival_time=0.01 * i,
                    stop_token_ids=stop,
                )
            reqs.append(r)
        h.submit(*reqs)
        h.fail(["f1", "f6"])
        for _ in range(6):
            h.step()
        waiting = [r.request_id for r in h.policy.inner]
        running = [r.request_id for r in h.scheduler.running if r.status == RequestStatus.RUNNING]
        assert waiting and running, "the workload should leave requests waiting and running"
        h.abort([*waiting[:2], *running[:1]])
        h.run()
        told = h.policy.told
        assert sorted(told) == sorted(r.request_id for r in reqs), "every request is told once"
        assert set(told.values()) == {
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        }
        assert len(h.policy) == 0 and h.policy.peek(h.now) is None

    def test_admission_returning_none(self) -> None:
        cfg = self.config()
        h = PolicyHarness(self.make_policy(cfg), cfg)
        gate = _Gate(h.policy.inner, h)
        h.policy.inner = gate
        reqs = random_requests(11, n=30)
        h.submit(*reqs)
        h.run()
        assert gate.calls > 0
        self._assert_complete(h, reqs)

    def test_deterministic(self) -> None:
        traces = []
        for _ in range(2):
            h = self.harness(num_blocks=20, max_num_batched_tokens=64)
            h.submit(*random_requests(self.seeds[0], n=40))
            h.run()
            assert h.num_preemptions > 0, "the workload should have preempted"
            traces.append(h.trace)
        assert traces[0] == traces[1], "two runs of one workload scheduled differently"

    def test_no_starvation_under_a_flood(self) -> None:
        """Shorts flood at 1.25x capacity for ``starvation_flood_steps``; longs arrive among them."""
        flood = self.starvation_flood_steps
        h = self.harness(max_num_seqs=4, max_num_batched_tokens=256)
        step = h.step_s
        reqs = []
        for k in range(flood // 8):  # 5 shorts every 8 steps; a short holds a seat for 8 steps
            for j in range(5):
                reqs.append(
                    make_request(
                        f"short-{k}-{j}",
                        8,
                        8,
                        arrival_time=round((8 * k + j) * step, 6),
                        user="alice",
                    )
                )
        longs = [
            make_request(
                f"long-{i}", 64, 64, arrival_time=round((5 + i * flood // 4) * step, 6), user="bob"
            )
            for i in range(3)
        ]
        h.submit(*reqs, *longs)
        h.run(max_steps=20 * flood)
        self._assert_complete(h, reqs + longs)
        bound = self.starvation_max_wait_steps
        if bound is None:
            bound = 0.6 * flood
        worst = max(reqs + longs, key=lambda r: h.wait_steps(r.request_id))
        assert h.wait_steps(worst.request_id) <= bound, (
            f"{worst.request_id} waited {h.wait_steps(worst.request_id):.0f} steps (bound {bound:.0f})"
        )
