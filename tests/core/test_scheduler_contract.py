"""Scenario checks of the scheduler's contract (derived from vLLM's scheduler tests), on the fake executor."""

from __future__ import annotations

from baton.request import RequestStatus
from baton.testing.sched_harness import SchedulerDriver

from .sched_helpers import make_request, make_scheduler


def _run_two_prompts(reserve_full_prompt: bool) -> tuple[SchedulerDriver, dict[str, int]]:
    """ "a" decodes while "b" (5 blocks) arrives to a cache of 6 blocks that a already holds 2 of."""
    s = make_scheduler(
        num_blocks=7, max_num_batched_tokens=32, reserve_full_prompt=reserve_full_prompt
    )
    d = SchedulerDriver(s)
    d.add(make_request("a", 30, max_tokens=20), make_request("b", 80, max_tokens=4))
    # how many of b's tokens were computed when it was preempted, per preemption
    computed_at_preemption: dict[str, int] = {}
    while s.has_unfinished_requests():
        before = {rid: r.num_computed_tokens for rid, r in s.requests.items()}
        d.step()
        for rid in d.scheduler_outputs[-1].preempted_req_ids:
            computed_at_preemption[rid] = before[rid]
    return d, computed_at_preemption


def test_without_reservation_a_prompt_admitted_by_its_first_chunk_preempts_itself():
    d, preempted = _run_two_prompts(reserve_full_prompt=False)
    assert 0 < preempted["b"] < 80  # b computed part of its prompt, then gave up its blocks
    assert {k: len(v) for k, v in d.tokens.items()} == {"a": 20, "b": 4}


def test_reserve_full_prompt_admits_a_prompt_only_when_all_its_blocks_are_free():
    d, preempted = _run_two_prompts(reserve_full_prompt=True)
    assert preempted == {} and d.num_preemptions == 0
    # b waited for a's blocks instead of starting: its first step is after a finished
    first_b = next(i for i, so in enumerate(d.scheduler_outputs) if "b" in so.num_scheduled_tokens)
    last_a = max(i for i, so in enumerate(d.scheduler_outputs) if "a" in so.num_scheduled_tokens)
    assert first_b > last_a
    (new_b,) = d.scheduler_outputs[first_b].scheduled_new_reqs
    assert len(new_b.block_ids) == 5 and d.scheduler_outputs[first_b].num_scheduled_tokens == {
        "b": 32
    }
    # the later chunks need no block
    assert [
        so.scheduled_cached_reqs.new_block_ids
        for so in d.scheduler_outputs[first_b + 1 : first_b + 3]
    ] == [[[]], [[]]]
    assert {k: len(v) for k, v in d.tokens.items()} == {"a": 20, "b": 4}


def test_reserve_full_prompt_counts_prefix_cache_hits_as_held():
    s = make_scheduler(num_blocks=8, max_num_batched_tokens=32)
    d = SchedulerDriver(s)
    shared = list(range(1, 65))  # 4 blocks
    d.add(make_request("a", [*shared, 900], max_tokens=1))
    d.run()
    # 7 usable blocks, "c" holds 2: b needs 5, 4 of them cached, so the one free block admits it
    d.add(make_request("c", 20, max_tokens=10))
    d.step()
    d.add(make_request("b", [*shared, *range(500, 515)], max_tokens=2))
    d.step()
    so = d.scheduler_outputs[-1]
    (new_b,) = so.scheduled_new_reqs
    assert new_b.num_computed_tokens == 64 and len(new_b.block_ids) == 5
    assert s.requests["b"].status == RequestStatus.RUNNING
    d.run()
    assert len(d.tokens["b"]) == 2 and d.num_preemptions == 0


def test_select_victim_sees_the_requester_and_no_request_in_flight():
    seen: list[list[str]] = []
    s = make_scheduler(num_blocks=5, max_num_batched_tokens=64, max_num_seqs=4)
    select = s.policy.select_victim

    def spy(running):
        seen.append([r.request_id for r in running])
        return select(running)

    s.policy.select_victim = spy  # type: ignore[method-assign]
    d = SchedulerDriver(s)
    # 4 usable blocks: a and b hold 2 each after their prompts, then both need a third
    d.add(make_request("a", 31, max_tokens=10), make_request("b", 31, max_tokens=10))
    d.run()
    assert seen and all(ids for ids in seen)
    # the first time a block ran out, "a" asked for it with both running and neither in flight
    assert seen[0] == ["a", "b"]
    assert {k: len(v) for k, v in d.tokens.items()} == {"a": 10, "b": 10}


# ----------------------------------------------------------------------------- prefill caps


def test_long_prefill_token_threshold_caps_each_prompt_chunk():
    s = make_scheduler(max_num_batched_tokens=256, long_prefill_token_threshold=32)
    d = SchedulerDriver(s)
    d.add(make_request("a", 70, max_tokens=3), make_request("b", 40, max_tokens=3))
    d.step()
    assert d.scheduler_outputs[-1].num_scheduled_tokens == {"a": 32, "b": 32}
    d.step()
    assert d.scheduler_outputs[-1].num_scheduled_tokens == {"a": 32, "b": 8}
    d.step()
    assert d.scheduler_outputs[-1].num_scheduled_tokens == {"a": 6, "b": 1}
    d.run()
    assert {k: len(v) for k, v in d.tokens.items()} == {"a": 3, "b": 3}


def test_max_num_partial_prefills_holds_back_prompts_that_would_not_end_this_step():
    s = make_scheduler(
        max_num_batched_tokens=256, long_prefill_token_threshold=32, max_num_partial_prefills=1
    )
    d = SchedulerDriver(s)
    d.add(
        make_request("a", 100, max_tokens=2),
        make_request("short", 10, max_tokens=2),  # ends in its first step: not partial
        make_request("b", 100, max_tokens=2),
    )
    for _ in range(4):
        d.step()
    # b waits while a is part-way through its prompt, and starts in the step a's prompt ends
    assert [so.num_scheduled_tokens for so in d.scheduler_outputs] == [
        {"a": 32, "short": 10},
        {"a": 32, "short": 1},
        {"a": 32},
        {"a": 4, "b": 32},
    ]
    d.run()
    assert {k: len(v) for k, v in d.tokens.items()} == {"a": 2, "short": 2, "b": 2}


def test_prefill_caps_are_off_by_default_and_without_chunked_prefill():
    s = make_scheduler(max_num_batched_tokens=256)
    assert s.long_prefill_token_threshold is None and s.max_num_partial_prefills is None
    s = make_scheduler(
        max_num_batched_tokens=256,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=32,
        max_num_partial_prefills=1,
    )
    d = SchedulerDriver(s)
    d.add(make_request("a", 100, max_tokens=2), make_request("b", 100, max_tokens=2))
    d.step()
    assert d.scheduler_outputs[-1].num_scheduled_tokens == {"a": 100, "b": 100}
    d.run()


# ----------------------------------------------------------------------------- prefix-cache reset


def _reference_tokens(*specs: tuple[str, int, int]) -> dict[str, list[int]]:
    d = SchedulerDriver(make_scheduler())
    d.add(*(make_request(rid, n, max_tokens=m) for rid, n, m in specs))
    return d.run().tokens


def test_reset_prefix_cache_with_reset_running_preempts_and_frees_every_block():
    specs = (("a", 40, 6), ("b", 50, 6))
    s = make_scheduler()
    d = SchedulerDriver(s)
    d.add(*(make_request(rid, n, max_tokens=m) for rid, n, m in specs))
    d.step()
    d.step()
    assert s.kv.view().block_hashes  # full prompt blocks are cached
    assert s.reset_prefix_cache() is False  # held blocks: refused, nothing changed
    assert s.requests["a"].status == RequestStatus.RUNNING
    assert s.reset_prefix_cache(reset_running=True) is True
    view = s.kv.view()
    assert view.num_free_blocks == view.num_usable_blocks and not view.block_hashes
    assert view.req_block_ids == {} and set(view.ref_cnts[1:]) == {0}
    assert [r.request_id for r in s.policy] == ["a", "b"]  # admission order kept
    assert all(r.status == RequestStatus.PREEMPTED for r in s.requests.values())
    d.step()
    so = d.scheduler_outputs[-1]
    assert so.preempted_req_ids == ["b", "a"]  # the runner drops them, then gets them anew
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a", "b"]
    assert all(n.num_computed_tokens == 0 for n in so.scheduled_new_reqs)  # nothing cached
    d.run()
    assert d.tokens == _reference_tokens(*specs)
    assert s.make_stats(delta=False).num_preemptions == 2


def test_reset_running_is_refused_while_a_batch_is_in_flight():
    s = make_scheduler()
    d = SchedulerDriver(s)
    d.add(make_request("a", 40))
    so = s.schedule()
    assert s.reset_prefix_cache(reset_running=True) is False
    assert s.requests["a"].status == RequestStatus.RUNNING
    d.record(s.update_from_output(so, d.executor.execute_model(so)))
    assert s.reset_prefix_cache(reset_running=True) is True
    d.run()
    assert len(d.tokens["a"]) == 8


# ----------------------------------------------------------------------------- the KV view


def test_kv_view_shows_eviction_order_references_and_hashes():
    s = make_scheduler(num_blocks=8)
    d = SchedulerDriver(s)
    shared = list(range(1, 33))  # 2 blocks
    d.add(make_request("a", [*shared, 100, 101], max_tokens=5))
    d.step()
    view = s.kv.view()
    a_blocks = view.req_block_ids["a"]
    assert len(a_blocks) == 3 and view.num_free_blocks == 4
    assert [view.ref_cnts[b] for b in a_blocks] == [1, 1, 1] and view.ref_cnts[0] == 1
    assert set(view.block_hashes) == set(a_blocks[:2])  # the computed full blocks
    d.add(make_request("b", [*shared, 200], max_tokens=2))
    d.step()
    view = s.kv.view()
    assert [view.ref_cnts[b] for b in a_blocks[:2]] == [2, 2]  # shared by a and b
    d.run()
    view = s.kv.view()
    assert view.num_free_blocks == 7 and view.req_block_ids == {}
    # freed tail first: uncached blocks at the head (reused first), cached prefixes last
    assert view.cached_free_block_ids == view.free_block_ids[-len(view.block_hashes) :]
    assert view.free_block_ids[-2:] == (a_blocks[1], a_blocks[0])  # the head is evicted last
    before = view.free_block_ids
    d.add(make_request("c", 20))
    d.run()
    assert view.free_block_ids == before  # a view is a snapshot
