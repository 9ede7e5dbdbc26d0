"""The built-in scheduler policies, fcfs and priority, against the SchedulerPolicy protocol."""

from __future__ import annotations

import pytest

from baton.interfaces import SchedulerPolicy
from baton.plugins.registry import Plugins
from baton.request import RequestStatus
from baton.sched.policies import FCFSPolicy, PriorityPolicy

from .sched_helpers import make_config, make_request


def _ids(policy) -> list[str]:
    return [r.request_id for r in policy]


def _drain(policy) -> list[str]:
    out = []
    while (r := policy.peek(0.0)) is not None:
        policy.pop(r)
        out.append(r.request_id)
    return out


@pytest.mark.parametrize("cls", [FCFSPolicy, PriorityPolicy])
def test_implements_the_protocol(cls):
    p = cls()
    assert isinstance(p, SchedulerPolicy)
    assert len(p) == 0 and p.peek(0.0) is None and list(p) == []


def test_fcfs_order_preempted_to_front_and_victim():
    p = FCFSPolicy()
    reqs = [make_request(f"r{i}", 4, priority=-i) for i in range(4)]  # priority is ignored
    for r in reqs:
        p.add(r)
    assert _ids(p) == ["r0", "r1", "r2", "r3"] and len(p) == 4
    assert p.select_victim(reqs[:3]) is reqs[2]  # the latest admitted
    with pytest.raises(ValueError):
        p.pop(reqs[1])  # only the head can be popped
    p.pop(p.peek(0.0))
    back = reqs[0]
    back.status = RequestStatus.PREEMPTED
    p.add(back)
    assert _ids(p) == ["r0", "r1", "r2", "r3"]
    assert [r.request_id for r in p.remove({"r2", "zzz"})] == ["r2"]
    assert _drain(p) == ["r0", "r1", "r3"] and len(p) == 0


def test_priority_order_ties_by_arrival_then_add_order():
    p = PriorityPolicy()
    p.add(make_request("c", 4, priority=1, arrival=5.0))
    p.add(make_request("a", 4, priority=0, arrival=9.0))
    p.add(make_request("b", 4, priority=1, arrival=1.0))
    p.add(make_request("d", 4, priority=1, arrival=5.0))  # same key as c: after it
    assert _ids(p) == ["a", "b", "c", "d"]
    assert _drain(p) == ["a", "b", "c", "d"]


def test_priority_lazy_removal_keeps_len_and_iter_right():
    p = PriorityPolicy()
    reqs = [make_request(f"r{i}", 4, priority=i % 3, arrival=float(i)) for i in range(10)]
    for r in reqs:
        p.add(r)
    removed = p.remove({"r0", "r3", "r5", "nope"})
    assert sorted(r.request_id for r in removed) == ["r0", "r3", "r5"]
    assert len(p) == 7 and "r0" not in _ids(p)
    assert p.peek(0.0).request_id == "r6"  # r0, r3 (priority 0) gone
    p.add(reqs[0])  # re-added after removal
    assert p.peek(0.0) is reqs[0] and len(p) == 8
    assert p.remove({"r0"}) == [reqs[0]] and p.remove({"r0"}) == []
    assert _drain(p) == ["r6", "r9", "r1", "r4", "r7", "r2", "r8"]


def test_priority_many_removals_compact_the_heap():
    p = PriorityPolicy()
    for i in range(500):
        p.add(make_request(f"r{i}", 4, arrival=float(i)))
    p.remove({f"r{i}" for i in range(490)})
    assert len(p) == 10 and len(p._heap) < 100
    assert _drain(p) == [f"r{i}" for i in range(490, 500)]


def test_priority_victim_is_the_largest_priority_then_latest_arrival():
    p = PriorityPolicy()
    a = make_request("a", 4, priority=2, arrival=1.0)
    b = make_request("b", 4, priority=2, arrival=3.0)
    c = make_request("c", 4, priority=0, arrival=9.0)
    assert p.select_victim([a, b, c]) is b
    d = make_request("d", 4, priority=2, arrival=3.0)
    assert p.select_victim([a, b, c, d]) is d  # equal keys: the most recently admitted


def test_preempted_request_resumes_in_its_place_under_priority():
    p = PriorityPolicy()
    p.add(make_request("late", 4, priority=0, arrival=5.0))
    early = make_request("early", 4, priority=0, arrival=1.0)
    early.status = RequestStatus.PREEMPTED
    p.add(early)
    assert _ids(p) == ["early", "late"]


def test_builtin_policies_come_through_the_entry_point():
    plugins = Plugins()
    plugins.load_entry_points(environ={"BATON_DISABLE_PLUGIN_AUTOLOAD": "1"})
    reg = plugins.registry
    for name, cls in (("fcfs", FCFSPolicy), ("priority", PriorityPolicy)):
        entry = reg.get("scheduler_policy", name)
        assert entry.distribution == "baton-core"
        assert isinstance(entry.create(make_config(), None), cls)
