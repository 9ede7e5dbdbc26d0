"""baton-contrib-sjf: conformance, shortest-first order, and the aging bound (no starvation)."""

from __future__ import annotations

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.plugins.registry import get_registry
from baton.testing.conformance.scheduler_policy import SchedulerPolicyConformance
from baton.testing.sched_harness import PolicyHarness, make_request
from baton_contrib_sjf import SJFPolicy, SJFSettings, job_size


class TestSJFConformance(SchedulerPolicyConformance):
    name = "sjf"


class TestPureSJFConformance(SchedulerPolicyConformance):
    """aging_rate = 0 still keeps the contract; only the starvation bound is lost."""

    name = "sjf"
    settings = {"aging_rate": 0.0}

    def test_no_starvation_under_a_flood(self) -> None:
        with pytest.raises(AssertionError, match="long-0 waited"):
            super().test_no_starvation_under_a_flood()


def test_registered_with_settings_from_toml(tmp_path):
    entry = get_registry().get("scheduler_policy", "sjf")
    assert entry.distribution == "baton-contrib-sjf" and entry.settings_model is SJFSettings
    toml = tmp_path / "baton.toml"
    toml.write_text('[scheduler]\npolicy = "sjf"\n[scheduler.sjf]\naging_rate = 5.5\n')
    config = BatonConfig.load(toml)
    policy = entry.create(config, config.plugin_settings("scheduler", "sjf", entry.settings_model))
    assert isinstance(policy, SJFPolicy) and policy.aging_rate == 5.5
    toml.write_text('[scheduler]\npolicy = "sjf"\n[scheduler.sjf]\naging_rate = -1\n')
    with pytest.raises(ConfigError, match=r"scheduler\.sjf\.aging_rate"):
        BatonConfig.load(toml).plugin_settings("scheduler", "sjf", SJFSettings)


def test_shortest_first_then_aging_lets_old_long_requests_in():
    p = SJFPolicy(settings=SJFSettings(aging_rate=10.0))
    long_old = make_request("long-old", 100, 100, arrival_time=0.0)  # key 200
    short_new = make_request("short-new", 10, 10, arrival_time=5.0)  # key 20 + 50 = 70
    short_late = make_request("short-late", 10, 10, arrival_time=19.0)  # key 20 + 190 = 210
    for r in (short_late, long_old, short_new):
        p.add(r)
    assert [r.request_id for r in p] == ["short-new", "long-old", "short-late"]
    assert job_size(long_old) == 200
    running = [short_new, long_old]
    assert p.select_victim(running) is long_old


def test_no_request_is_overtaken_beyond_the_aging_bound():
    """R is never admitted after a request that arrived more than size(R) / aging_rate seconds after R."""
    rate = 20.0
    config = BatonConfig.load(
        block_size=16, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=None
    )
    h = PolicyHarness(SJFPolicy(config, SJFSettings(aging_rate=rate)), config, step_s=0.02)
    reqs = []
    for k in range(60):  # 5 shorts every 8 steps: 1.25x what 4 seats serve
        reqs += [
            make_request(f"s{k}-{j}", 8, 8, arrival_time=round((8 * k + j) * 0.02, 6))
            for j in range(5)
        ]
    reqs += [
        make_request(f"long{i}", 40 + 30 * i, 40, arrival_time=0.1 + 1.5 * i) for i in range(4)
    ]
    sizes = {r.request_id: job_size(r) for r in reqs}
    h.submit(*reqs)
    h.run()
    overtakes = 0
    for r in reqs:
        for q in reqs:
            a_r, a_q = r.arrival_time, q.arrival_time
            if a_q > a_r and h.admitted_at[q.request_id] < h.admitted_at[r.request_id]:
                overtakes += 1
                assert a_q - a_r <= sizes[r.request_id] / rate + 1e-9, (
                    f"{q.request_id} (arrived {a_q - a_r:.2f}s later) overtook {r.request_id}"
                )
    assert overtakes > 0  # shorts do overtake longs: this is SJF, not FCFS
    for i in range(4):  # and each long request's wait stays bounded
        assert h.wait_steps(f"long{i}") * 0.02 <= sizes[f"long{i}"] / rate + 2.0
