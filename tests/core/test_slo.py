"""Per-request SLOs: the fields, goodput as the scheduler counts it, the ``slo`` policy, and the
victim data (``choose_victim``); on the real Scheduler with a FakeExecutor and a fake clock."""

from __future__ import annotations

import msgspec
import pytest

from baton.config import BatonConfig
from baton.errors import InvalidRequestError
from baton.protocol import EngineCoreRequest
from baton.request import Request, RequestStatus
from baton.sampling_params import SamplingParams
from baton.sched.policies import FCFSPolicy, FCFSSettings
from baton.sched.slo import is_hopeless, met_slo
from baton.sched.slo_policy import SLOPolicy, SLOSettings
from baton.sched.victims import VictimCandidate
from baton.scheduling_info import SchedulingInfo, as_scheduling_info
from baton.testing.sched_harness import PolicyHarness, SchedulerDriver, make_request
from baton.validation import check_scheduling

from .sched_helpers import make_scheduler


def slo_request(rid: str, arrival: float = 0.0, ttft=None, tpot=None, prompt=20, max_tokens=5):
    return make_request(
        rid,
        prompt,
        max_tokens,
        arrival_time=arrival,
        scheduling=SchedulingInfo(slo_ttft_ms=ttft, slo_tpot_ms=tpot),
    )


# ------------------------------------------------------------------ the fields


def test_slo_fields_travel_in_scheduling_and_are_checked_naming_the_field():
    info = as_scheduling_info({"slo_ttft_ms": 500, "slo_tpot_ms": 40.5, "tenant": "t"})
    check_scheduling(info)
    assert (info.slo_ttft_ms, info.slo_tpot_ms) == (500, 40.5)
    req = EngineCoreRequest(
        request_id="a", prompt_token_ids=[1, 2], sampling_params=SamplingParams(), scheduling=info
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back.scheduling == info
    for bad, match in [(0, "in \\(0"), (-3, "in \\(0"), (float("inf"), "in \\(0"), ("1", "number")]:
        with pytest.raises(InvalidRequestError, match=match) as e:
            check_scheduling(SchedulingInfo(slo_tpot_ms=bad))
        assert e.value.param == "scheduling.slo_tpot_ms"


def test_met_and_hopeless_follow_the_targets():
    r = slo_request("a", arrival=10.0, ttft=1000, tpot=100, max_tokens=5)
    assert not is_hopeless(r, 10.9) and is_hopeless(r, 11.1)  # TTFT deadline 11.0
    r.first_token_time = 10.5
    # TPOT: the 4 tokens after the first may take 0.4 s in all, even if the rest came at once
    assert not is_hopeless(r, 10.85) and is_hopeless(r, 10.95)
    r.all_token_ids.extend([5] * 5)
    assert met_slo(r, 10.85) and not met_slo(r, 10.95)
    late = slo_request("b", arrival=0.0, ttft=100)
    late.first_token_time = 0.2
    assert not met_slo(late, 0.2)
    assert not met_slo(slo_request("c", ttft=100), 1.0)  # never produced a token


# ------------------------------------------------------------------ goodput


def test_the_scheduler_counts_goodput_of_finished_requests_with_an_slo():
    clock = {"now": 0.0}
    s = make_scheduler(clock=lambda: clock["now"])
    d = SchedulerDriver(s)
    d.add(
        slo_request("met", ttft=10_000, tpot=10_000),
        slo_request("missed", ttft=0.001),
        slo_request("none"),
        slo_request("aborted", ttft=10_000),
    )
    s.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)  # the client's choice: not counted
    clock["now"] = 0.01
    d.step()
    step = s.make_stats()
    assert (step.num_slo_finished, step.num_slo_met) == (0, 0)
    d.run()
    counted = s.make_stats()  # the steps since: deltas
    assert (counted.num_slo_finished, counted.num_slo_met) == (2, 1)
    total = s.make_stats(delta=False)
    assert (total.num_slo_finished, total.num_slo_met) == (2, 1)
    assert s.make_stats().num_slo_finished == 0


# ------------------------------------------------------------------ the policy


def test_slo_policy_admits_by_deadline_and_demotes_hopeless_requests():
    p = SLOPolicy()
    a = slo_request("a", arrival=0.0, ttft=5000)  # due at 5.0
    b = slo_request("b", arrival=1.0, ttft=1000)  # due at 2.0
    c = slo_request("c", arrival=0.5)  # no target: due at its arrival
    for r in (a, b, c):
        p.add(r)
    assert [r.request_id for r in p] == ["c", "b", "a"]
    assert p.peek(1.5) is c
    p.pop(c)
    assert p.peek(3.0) is a  # b's deadline passed: hopeless, behind a
    assert [r.request_id for r in p] == ["a", "b"]
    keep = SLOPolicy(settings=SLOSettings(on_miss="keep"))
    for r in (a, b):
        keep.add(r)
    assert keep.peek(3.0) is b


def test_slo_policy_looks_ahead_by_the_measured_admission_to_first_token_time():
    # requests admitted at 0.0 took 2 s to their first token (their prompts' steps): a waiting
    # request due in 1 s can no longer make it and is demoted before its deadline passes
    def run(settings):
        p = SLOPolicy(settings=settings)
        early = [slo_request(f"e{i}", ttft=60_000) for i in range(3)]
        for r in early:
            p.add(r)
        for r in early:
            assert p.peek(0.0) is r
            p.pop(r)
        for r in early:
            r.first_token_time = 2.0
        near = slo_request("near", arrival=9.0, ttft=2000)  # due at 11.0
        far = slo_request("far", arrival=9.5, ttft=5000)  # due at 14.5
        p.add(near)
        p.add(far)
        return p, p.peek(10.0)

    p, head = run(None)
    assert p.lag == pytest.approx(2.0)
    assert head.request_id == "far"  # 10.0 + 2.0 > 11.0: near is lost, far can still make it
    assert [r.request_id for r in p] == ["far", "near"]  # near is still admitted, after far
    _, head = run(SLOSettings(lookahead=False))
    assert head.request_id == "near"  # only a deadline already passed demotes


def test_slo_policy_victim_is_hopeless_then_most_slack_then_least_recompute():
    p = SLOPolicy()
    reqs = [slo_request(f"r{i}", ttft=ttft) for i, ttft in enumerate([1000, 9000, 9000, 50])]
    for r, computed in zip(reqs, [10, 40, 20, 30], strict=True):
        r.num_computed_tokens = computed

    def cands(rs):
        return [
            VictimCandidate(
                request=r,
                num_computed_tokens=r.num_computed_tokens,
                num_blocks=2,
                num_output_tokens=0,
                max_tokens=5,
                is_requester=r is rs[0],
            )
            for r in rs
        ]

    assert p.choose_victim(cands(reqs), 0.5) is reqs[3]  # 50 ms TTFT: hopeless at 0.5 s
    assert p.choose_victim(cands(reqs[:3]), 0.5) is reqs[2]  # latest due; fewer computed


# ------------------------------------------------------------------ victims


def test_least_recompute_victim_redoes_fewer_tokens_than_newest_with_the_same_outputs():
    outputs, computed, preemptions = {}, {}, {}
    cfg = BatonConfig.load(max_num_seqs=16, max_num_batched_tokens=256, enable_prefix_caching=False)
    for victim in ("newest", "least_recompute"):
        h = PolicyHarness(FCFSPolicy(cfg, FCFSSettings(victim=victim)), cfg, num_blocks=40)
        # short and long prompts alternate, all decoding long: the cache runs short and the
        # newest admitted is often a long prompt while short ones hold little
        for i in range(12):
            h.submit(make_request(f"r{i}", 20 if i % 2 else 120, 60, arrival_time=0.01 * i))
        h.run()
        outputs[victim] = h.tokens
        # every token the steps computed: the same work plus what preemptions made them redo
        computed[victim] = sum(n for scheduled, _ in h.trace for _, n in scheduled)
        preemptions[victim] = h.num_preemptions
    assert outputs["newest"] == outputs["least_recompute"]
    assert preemptions["newest"] > 0
    assert computed["least_recompute"] < computed["newest"], (computed, preemptions)


def test_request_first_token_time_is_stamped_on_the_schedulers_clock():
    clock = {"now": 3.0}
    s = make_scheduler(clock=lambda: clock["now"])
    d = SchedulerDriver(s)
    r = Request("x", list(range(1, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    d.add(r)
    clock["now"] = 4.0
    d.step()
    assert r.first_token_time == 4.0
    clock["now"] = 5.0
    d.run()
    assert r.first_token_time == 4.0
