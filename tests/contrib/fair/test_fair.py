"""baton-contrib-fair: conformance, no starvation under a flood, weighted shares, refunds, no idle credit."""

from __future__ import annotations

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.plugins.registry import get_registry
from baton.request import RequestStatus
from baton.sched.policies import FCFSPolicy
from baton.testing.conformance.scheduler_policy import SchedulerPolicyConformance
from baton.testing.sched_harness import PolicyHarness, make_request
from baton_contrib_fair import FairPolicy, FairSettings


class TestFairConformance(SchedulerPolicyConformance):
    name = "fair"


class TestWeightedFairConformance(SchedulerPolicyConformance):
    name = "fair"
    settings = {"weights": {"alice": 3.0, "bob": 0.5}, "default_tenant": "anon"}


def _config(**kw) -> BatonConfig:
    return BatonConfig.load(
        block_size=16, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=None, **kw
    )


def _flood(policy) -> PolicyHarness:
    h = PolicyHarness(policy, _config(), step_s=0.02)
    flood = [make_request(f"alice-{i}", 32, 32, user="alice") for i in range(200)]
    bob = [
        make_request(f"bob-{i}", 32, 32, arrival_time=0.5 + 0.5 * i, user="bob") for i in range(10)
    ]
    h.submit(*flood, *bob)
    return h.run()


def test_a_flood_from_one_tenant_cannot_starve_another():
    h = _flood(FairPolicy(settings=FairSettings()))
    waits = [h.wait_steps(f"bob-{i}") for i in range(10)]
    # a seat frees within one request's service time (32 tokens = 32 steps); bob takes it
    assert max(waits) <= 40, waits
    fcfs = _flood(FCFSPolicy())
    assert min(fcfs.wait_steps(f"bob-{i}") for i in range(10)) > 400  # what the test guards against


def _tokens_by_tenant(h: PolicyHarness, steps: range) -> dict[str, int]:
    out: dict[str, int] = {}
    for scheduled, _ in h.trace[steps.start : steps.stop]:
        for rid, n in scheduled:
            user = h.requests[rid].user
            out[user] = out.get(user, 0) + n
    return out


def test_weights_set_the_share_of_tokens():
    policy = FairPolicy(settings=FairSettings(weights={"alice": 2.0}))
    h = PolicyHarness(policy, _config(), step_s=0.02)
    reqs = [make_request(f"{u}-{i}", 24, 24, user=u) for i in range(120) for u in ("bob", "alice")]
    h.submit(*reqs)
    h.run()
    served = _tokens_by_tenant(h, range(100, 1000))  # both backlogged the whole window
    assert 1.7 <= served["alice"] / served["bob"] <= 2.3, served


def test_an_idle_tenant_earns_no_credit():
    h = PolicyHarness(FairPolicy(), _config(), step_s=0.02)
    alice = [make_request(f"alice-{i}", 16, 16, user="alice") for i in range(300)]
    bob = [make_request(f"bob-{i}", 16, 16, arrival_time=10.0, user="bob") for i in range(100)]
    h.submit(*alice, *bob)
    h.run()
    arrival_step = next(
        i for i, (sched, _) in enumerate(h.trace) if any(r.startswith("bob") for r, _ in sched)
    )
    served = _tokens_by_tenant(h, range(arrival_step, arrival_step + 200))
    # bob was idle for 10 s while alice ran; he gets his half from now on, not everything
    # (alice is still backlogged through the window)
    assert 0.4 <= served["alice"] / (served["alice"] + served["bob"]) <= 0.6, served


def test_unused_estimate_is_refunded_when_a_request_ends_early():
    p = FairPolicy()
    r = make_request("r", 10, 100, user="alice")
    p.add(r)
    p.pop(p.peek(0.0))
    assert p.charged["alice"] == 110
    r.num_computed_tokens = 14  # it stopped after 5 tokens
    r.status = RequestStatus.FINISHED_STOPPED
    p.finished(r)
    assert p.charged["alice"] == 14
    p.finished(make_request("never-admitted", 10, 10, user="alice"))  # aborted while waiting
    assert p.charged["alice"] == 14


def test_refunds_come_from_the_finished_event_in_a_real_run():
    """Requests that stop early: only the tokens computed stay charged once they finished."""
    p = FairPolicy()
    h = PolicyHarness(p, _config(), step_s=0.02)
    reqs = [make_request(f"{u}-{i}", 16, 40, user=u) for i in range(6) for u in ("a", "b")]
    h.submit(*reqs)
    for _ in range(5):
        h.step()
    h.abort([r.request_id for r in reqs if r.user == "b"])  # running and waiting ones
    h.run()
    assert p._admitted == {} and p._running_per_tenant == {"a": 0, "b": 0}
    # b was charged only what it computed before the aborts (its requests' prompts and a few tokens)
    computed_b = sum(n for sched, _ in h.trace[:5] for rid, n in sched if rid.startswith("b"))
    assert p.charged["b"] == computed_b


def test_the_tenant_is_scheduling_tenant_then_user():
    from baton.request import Request
    from baton.sampling_params import SamplingParams
    from baton.scheduling_info import SchedulingInfo

    p = FairPolicy()
    both = Request("x", [1], SamplingParams(), user="u", scheduling=SchedulingInfo(tenant="t"))
    assert p.tenant(both) == "t"
    assert p.tenant(make_request("y", 4, 4, user="u")) == "u"
    assert p.tenant(make_request("z", 4, 4)) == "default"


def test_victim_comes_from_the_tenant_most_over_its_share():
    p = FairPolicy()
    reqs = [
        make_request(f"{u}{i}", 10, 10 + 50 * (u == "a"), user=u)
        for i in range(3)
        for u in ("a", "b")
    ]
    for r in reqs:
        p.add(r)
    running = []
    while (r := p.peek(0.0)) is not None:
        p.pop(r)
        r.status = RequestStatus.RUNNING
        running.append(r)
    assert p.charged["a"] > p.charged["b"]
    assert p.select_victim(running).request_id == "a2"


def test_settings_from_toml(tmp_path):
    entry = get_registry().get("scheduler_policy", "fair")
    assert entry.distribution == "baton-contrib-fair" and entry.settings_model is FairSettings
    toml = tmp_path / "baton.toml"
    toml.write_text('[scheduler]\npolicy = "fair"\n[scheduler.fair]\nweights = {alice = 2}\n')
    config = BatonConfig.load(toml)
    policy = entry.create(config, config.plugin_settings("scheduler", "fair", entry.settings_model))
    assert policy.weight("alice") == 2.0 and policy.weight("bob") == 1.0
    toml.write_text('[scheduler]\npolicy = "fair"\n[scheduler.fair]\nweights = {alice = 0}\n')
    with pytest.raises(ConfigError, match=r"scheduler\.fair\.weights\.alice"):
        BatonConfig.load(toml).plugin_settings("scheduler", "fair", FairSettings)
