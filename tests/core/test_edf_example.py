"""docs/writing-a-plugin.md's worked example of a policy that reads request metadata ("edf"):
the page's module, registered as a plugin, passes the conformance suites (with and without its
per-tenant cap, which only its ``finished`` event releases) and admits by deadline."""

from __future__ import annotations

import re
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from baton.config import BatonConfig
from baton.interfaces import FinishAwarePolicy, SchedulerPolicy
from baton.plugins.registry import Plugins
from baton.request import RequestStatus
from baton.scheduling_info import SchedulingInfo
from baton.testing.conformance import SchedulerPolicyConformance
from baton.testing.sched_harness import PolicyHarness, make_request

PAGE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-plugin.md"
BLOCK = re.compile(r"^```python example=edf\n(.*?)^```[ \t]*$", re.S | re.M)


@cache
def edf() -> types.ModuleType:
    [code] = BLOCK.findall(PAGE.read_text())
    module = types.ModuleType("baton_docs_edf")
    sys.modules[module.__name__] = module  # as an import would: pydantic resolves names there
    exec(compile(code, f"{PAGE}:edf", "exec"), module.__dict__)
    return module


def registered(settings: dict[str, Any] | None = None) -> Any:
    """The policy as baton builds it: from the registry entry the page's hook registers."""
    plugins = Plugins()
    plugins.register(edf(), "docs-edf", "docs-example", "0")
    entry = plugins.registry.get("scheduler_policy", "edf")
    section = {"policy": "edf", **({"edf": settings} if settings else {})}
    config = BatonConfig.load(scheduler=section)
    return entry.create(config, config.plugin_settings("scheduler", "edf", entry.settings_model))


class TestEDFConformance(SchedulerPolicyConformance):
    def make_policy(self, config: BatonConfig) -> Any:
        return registered()


class TestCappedEDFConformance(SchedulerPolicyConformance):
    admission_control = True
    starvation_max_wait_steps = 400  # as the page says: the flooding tenant is capped

    def make_policy(self, config: BatonConfig) -> Any:
        return registered({"max_running_per_tenant": 3})


def test_it_is_a_finish_aware_policy_with_validated_settings():
    policy = registered({"max_running_per_tenant": 3})
    assert isinstance(policy, SchedulerPolicy) and isinstance(policy, FinishAwarePolicy)
    assert policy.cap == 3
    with pytest.raises(Exception, match="max_running_per_tenant"):
        registered({"max_running_per_tenant": 0})


def _config(max_num_seqs: int) -> BatonConfig:
    return BatonConfig.load(
        block_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=None
    )


def test_earliest_deadline_first_whatever_the_arrival_order():
    h = PolicyHarness(registered(), _config(max_num_seqs=1))
    deadlines = {"loose": 60.0, "none": None, "tight": 1.0, "medium": 5.0}
    reqs = [
        make_request(rid, 16, 8, arrival_time=0.01 * (i + 1), scheduling=SchedulingInfo(deadline=d))
        for i, (rid, d) in enumerate(deadlines.items())
    ]
    h.submit(make_request("first", 16, 30), *reqs)  # takes the seat before the others arrive
    h.run()
    order = sorted(deadlines, key=lambda rid: h.admitted_at[rid])
    assert order == ["tight", "medium", "loose", "none"]
    assert reqs[2].deadline_time == pytest.approx(0.03 + 1.0)


def test_a_tenant_at_its_cap_waits_until_finished_frees_a_seat():
    policy = registered({"max_running_per_tenant": 1})
    h = PolicyHarness(policy, _config(max_num_seqs=2))
    acme = [
        make_request(f"acme-{i}", 16, 10, scheduling=SchedulingInfo(tenant="acme", deadline=1 + i))
        for i in range(3)
    ]
    other = make_request("other", 16, 10, user="bob")
    h.submit(*acme, other)
    h.step()
    running = {r.request_id for r in h.scheduler.running if r.status == RequestStatus.RUNNING}
    # two seats, but acme may hold one: bob's request (no deadline) takes the other
    assert running == {"acme-0", "other"}
    h.abort(["acme-0"])  # an abort is a finish too: acme's seat is free again
    h.step()
    assert "acme-1" in {r.request_id for r in h.scheduler.running}
    h.run()
    assert policy.running == {"acme": 0, "bob": 0} and policy.admitted == {}
    assert all(h.finished.get(r.request_id) for r in acme[1:])
