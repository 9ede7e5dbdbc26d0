"""PolicyHarness feeds arrivals in time order, and requests with equal arrival times in the order
they were submitted (they were added in reverse order before)."""

from __future__ import annotations

from baton.config import BatonConfig
from baton.sched.policies import FCFSPolicy
from baton.testing.sched_harness import PolicyHarness, make_request


class Recording(FCFSPolicy):
    """FCFS that remembers the order requests were added in."""

    def __init__(self) -> None:
        super().__init__()
        self.added: list[str] = []

    def add(self, request) -> None:
        self.added.append(request.request_id)
        super().add(request)


def harness() -> tuple[PolicyHarness, Recording]:
    config = BatonConfig.load(block_size=16, max_num_seqs=1, max_model_len=None)
    policy = Recording()
    return PolicyHarness(policy, config), policy


def test_equal_arrival_times_are_added_in_submission_order():
    h, policy = harness()
    late = [make_request(f"late{i}", 8, 2, arrival_time=0.5) for i in range(3)]
    now = [make_request(f"now{i}", 8, 2) for i in range(4)]
    h.submit(*late)
    h.submit(*now[:2])
    h.submit(now[2], now[3])
    h.run()
    first_adds = list(dict.fromkeys(policy.added))  # preempted requests are added again
    assert first_adds == ["now0", "now1", "now2", "now3", "late0", "late1", "late2"]
    # one seat: FCFS admits them in that order too
    assert sorted(h.admitted_at, key=h.admitted_at.get) == first_adds
    assert all(h.tokens[r.request_id] == h.expected(r) for r in now + late)


def test_the_clock_jumps_to_the_next_arrival_when_idle():
    h, policy = harness()
    h.submit(make_request("a", 4, 1, arrival_time=3.0), make_request("b", 4, 1, arrival_time=3.0))
    h.step()
    assert h.now >= 3.0 and policy.added == ["a", "b"] and not h.pending


def test_the_pages_harness_example_runs():
    """docs/writing-a-plugin.md section 13's example, with section 3's TurnsPolicy."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "writing-a-plugin.md").read_text()
    [policy] = re.findall(r"^```python file=baton_turns.py\n(.*?)^```", page, re.S | re.M)
    [example] = re.findall(r"^```python example=harness\n(.*?)^```", page, re.S | re.M)
    namespace: dict = {"__name__": "baton_turns_page"}
    exec(compile(policy, "baton_turns.py", "exec"), namespace)
    exec(compile(example, "harness example", "exec"), namespace)
