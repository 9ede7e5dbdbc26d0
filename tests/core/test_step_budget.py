"""scheduler.target_step_ms: the latency-aware prefill budget, on fake step times (no wall clock)."""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable

import pytest

from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.errors import ConfigError
from baton.protocol import EngineCoreRequest, ModelInfo, SchedulerOutput
from baton.sampling_params import SamplingParams
from baton.sched.cost_model import DEFAULT
from baton.sched.step_budget import (
    AUTO_MULTIPLE,
    PROBE_EVERY,
    PROBE_STALE,
    PrefillBudget,
)
from baton.sched.step_time_model import StepShape, StepTimeModel
from baton.testing import FakeExecutor
from baton.testing.sched_harness import SchedulerDriver

from .sched_helpers import make_request, make_scheduler

StepTime = Callable[[int, int], float]


def shape_of(so: SchedulerOutput, decoding: set[str]) -> tuple[int, int]:
    """(prompt tokens, decode rows) of a step, told apart by the test's own books."""
    prefill = decode = 0
    for rid, n in so.num_scheduled_tokens.items():
        if rid in decoding:
            decode += n
        else:
            prefill += n
    return prefill, decode


class TimedDriver(SchedulerDriver):
    """SchedulerDriver that feeds the scheduler a fake time for every step, from ``step_time(P, D)``."""

    def __init__(self, scheduler, step_time: StepTime) -> None:
        super().__init__(scheduler)
        self.step_time = step_time
        self.shapes: list[tuple[int, int]] = []
        #: Requests with their whole prompt computed (their next steps are decodes).
        self.decoding: set[str] = set()
        #: Per step: the decodes that were due (running, prompt done, unfinished) and scheduled.
        self.due: list[tuple[set[str], set[str]]] = []
        #: Per step: the requests running or waiting when it was scheduled (the batch the
        #: decodes grow to, before max_num_seqs).
        self.demand: list[int] = []

    def step(self):
        due = {
            r.request_id
            for r in self.scheduler.running
            if r.request_id in self.decoding and r.request_id in self.scheduler.requests
        }
        self.demand.append(len(self.scheduler.running) + len(self.scheduler.policy))
        outs = super().step()
        so = self.scheduler_outputs[-1]
        self.due.append((due, set(so.num_scheduled_tokens)))
        p, d = shape_of(so, self.decoding)
        self.shapes.append((p, d))
        for rid in so.num_scheduled_tokens:
            req = self.scheduler.requests.get(rid)
            if req is None or req.num_computed_tokens >= req.num_prompt_tokens:
                self.decoding.add(rid)
        if so.total_num_scheduled_tokens:
            self.scheduler.observe_step_time(so.step_id, self.step_time(p, d))
        return outs


def linear(overhead: float, per_token: float, per_row: float) -> StepTime:
    return lambda p, d: overhead + per_token * p + per_row * d


def long_prompts(n: int, length: int, max_tokens: int = 200, prefix: str = "p"):
    return [make_request(f"{prefix}{i}", length, max_tokens=max_tokens, eos=None) for i in range(n)]


# ------------------------------------------------------------------ the setting


@pytest.mark.parametrize("bad", [0, -5, "fast", float("nan"), float("inf"), 10**9])
def test_a_bad_target_step_ms_is_refused_naming_it(bad):
    with pytest.raises(ConfigError, match=r"scheduler\.target_step_ms"):
        BatonConfig.load(**{"scheduler.target_step_ms": bad})


def test_target_step_ms_is_auto_by_default_off_when_asked_and_without_chunked_prefill():
    assert BatonConfig.load().scheduler.target_step_ms == "auto"
    auto = make_scheduler().prefill_budget
    assert auto is not None and auto.auto and auto.target(4) is None  # nothing measured yet
    assert make_scheduler(target_step_ms="off").prefill_budget is None
    assert BatonConfig.load(**{"scheduler.target_step_ms": "off"}).scheduler.target_step_ms == "off"
    s = make_scheduler(target_step_ms=100, enable_chunked_prefill=False)
    assert s.prefill_budget is None
    on = make_scheduler(target_step_ms=250)
    assert on.prefill_budget is not None and on.prefill_budget.target_s == 0.25


# ------------------------------------------------------------------ off = today


def _trace_digest(**overrides) -> str:
    s = make_scheduler(
        num_blocks=overrides.pop("num_blocks", 96),
        max_num_batched_tokens=128,
        max_num_seqs=8,
        **overrides,
    )
    d = SchedulerDriver(s)
    rng = random.Random(7)
    reqs = [
        make_request(f"r{i}", rng.randint(5, 300), max_tokens=rng.randint(1, 40), eos=None)
        for i in range(24)
    ]
    h = hashlib.sha256()
    for step in range(10_000):
        if reqs and step % 3 == 0:
            d.add(reqs.pop(0))
        if not reqs and not s.has_unfinished_requests():
            break
        d.step()
        so = d.scheduler_outputs[-1]
        h.update(repr(sorted(so.num_scheduled_tokens.items())).encode())
        h.update(repr(so.preempted_req_ids).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize(
    ("overrides", "digest"),
    [
        ({}, "ad9f40ea33436b4b"),
        ({"num_blocks": 40}, "c889c5c4db05cea2"),  # preemptions
        (
            {"long_prefill_token_threshold": 48, "max_num_partial_prefills": 2},
            "4f413f52051ef153",
        ),
    ],
)
def test_off_schedules_exactly_as_before_the_budget_existed(overrides, digest):
    # the digests were taken with the scheduler of commit c4fdd19, before target_step_ms
    assert _trace_digest(**overrides) == digest


# ------------------------------------------------------------------ the model


def test_step_time_model_starts_from_the_cost_model_and_learns_a_linear_machine():
    m = StepTimeModel(prefill_scale=512, decode_scale=16)
    assert m.coefficients == (
        DEFAULT.step_overhead_s,
        DEFAULT.prefill_s_per_token,
        DEFAULT.decode_s_per_token,
    )
    truth = linear(0.02, 0.0005, 0.004)
    rng = random.Random(1)
    for _ in range(60):
        p, d = rng.randint(0, 512), rng.randint(0, 16)
        m.observe(StepShape(p, d), truth(p, d))
    a, b, c = m.coefficients
    assert a == pytest.approx(0.02, rel=0.05)
    assert b == pytest.approx(0.0005, rel=0.05)
    assert c == pytest.approx(0.004, rel=0.05)
    assert m.num_observed == 60


def test_step_time_model_keeps_coefficients_non_negative_and_refuses_bad_times():
    m = StepTimeModel()
    for _ in range(30):  # more prompt tokens, shorter steps: the fit would go negative
        m.observe(StepShape(100, 4), 0.5)
        m.observe(StepShape(1000, 4), 0.1)
    assert min(m.coefficients) >= 0.0
    with pytest.raises(ValueError, match="nan"):
        m.observe(StepShape(10, 1), float("nan"))


def test_prefill_budget_uses_the_prior_until_steps_are_measured():
    budget = PrefillBudget(0.5, min_tokens=16, max_tokens=2048)
    a, b, c = (DEFAULT.step_overhead_s, DEFAULT.prefill_s_per_token, DEFAULT.decode_s_per_token)
    assert budget.prefill_tokens(10) == int((0.5 - a - 10 * c) / b)
    assert budget.prefill_tokens(10_000) == 16  # decodes alone overrun: one block still
    assert PrefillBudget(100.0, min_tokens=16, max_tokens=2048).prefill_tokens(1) == 2048
    budget = PrefillBudget(0.5, min_tokens=16, max_tokens=2048)
    assert budget.prefill_tokens(0) == 2048  # no decode waits: the whole budget
    assert not budget.observe(7, 0.1)  # a step it never scheduled is ignored


def test_prefill_budget_at_most_doubles_from_one_step_to_the_next():
    model = StepTimeModel()
    budget = PrefillBudget(0.5, min_tokens=16, max_tokens=2048, model=model)
    model.coefficients = (0.0, 0.01, 0.0)  # slow: 50 tokens
    assert budget.prefill_tokens(4) == 50
    model.coefficients = (0.5, 0.0, 0.0)  # a fit that cannot tell a prompt token's cost
    assert [budget.prefill_tokens(4) for _ in range(3)] == [100, 200, 400]
    assert budget.prefill_tokens(0) == 2048  # no decode: not held, and no step up counted
    assert budget.prefill_tokens(4) == 800


def test_prefill_budget_leaves_out_a_bad_step_time_with_a_warning(caplog):
    budget = PrefillBudget(0.5, min_tokens=16, max_tokens=2048)
    budget.scheduled(3, StepShape(100, 2))
    with caplog.at_level(logging.WARNING, logger="baton.sched.step_budget"):
        assert not budget.observe(3, -1.0)
    assert "-1.0" in caplog.text and budget.model.num_observed == 0
    budget.scheduled(4, StepShape(100, 2))
    assert budget.observe(4, 0.2) and budget.model.num_observed == 1


# ------------------------------------------------------------------ scheduling


def test_prompt_chunks_shrink_when_steps_run_long_and_grow_back_when_short():
    times = {"now": linear(0.01, 0.001, 0.002)}  # slow: 1 ms per prompt token
    s = make_scheduler(
        num_blocks=8192, max_num_seqs=64, max_num_batched_tokens=1024, target_step_ms=100
    )
    d = TimedDriver(s, lambda p, dd: times["now"](p, dd))
    d.add(*long_prompts(48, 1000))
    for _ in range(30):
        d.step()
    slow = d.shapes[-10:]
    for p, dd in slow:
        assert 16 <= p <= 110, slow  # ~ (0.1 - 0.01 - 0.002 * decodes) / 0.001
        assert times["now"](p, dd) <= 0.1 * 1.15, slow
    times["now"] = linear(0.01, 0.0001, 0.002)  # the machine got 10x faster at prompts
    for _ in range(12):
        d.step()
    fast = d.shapes[-4:]
    assert all(p >= 500 for p, _ in fast), fast  # grown back (target: ~ 800 tokens)
    assert all(times["now"](p, dd) <= 0.1 * 1.15 for p, dd in fast), fast


def test_decodes_are_never_starved_and_prompts_keep_at_least_a_block():
    # decodes alone take longer than the target: prompt chunks shrink to one block, no less
    s = make_scheduler(
        num_blocks=2048, max_num_seqs=32, max_num_batched_tokens=512, target_step_ms=50
    )
    d = TimedDriver(s, linear(0.01, 0.001, 0.01))
    d.add(*long_prompts(4, 40, max_tokens=60, prefix="early"))
    d.step()  # the early ones' prompts in one step
    d.add(*long_prompts(20, 300, max_tokens=4))
    for _ in range(40):
        d.step()
    for due, scheduled in d.due:
        assert due <= scheduled, due - scheduled  # every decode due got its token
    prompt_steps = [p for p, _ in d.shapes[3:40]]
    assert all(p >= 16 for p in prompt_steps), prompt_steps
    assert min(prompt_steps) == 16  # at the floor, not below
    d.run()
    assert set(d.finished) == {f"early{i}" for i in range(4)} | {f"p{i}" for i in range(20)}


@pytest.mark.parametrize("target", ["off", 10_000])
def test_a_running_prompt_chunk_does_not_take_the_tokens_of_later_decodes(target):
    # a long prompt admitted first, whose chunks nearly fill the step, then short requests that
    # decode: without a target the chunk comes first and some decodes wait; with one they don't
    s = make_scheduler(
        num_blocks=2048,
        max_num_seqs=32,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=32,
        target_step_ms=target,
    )
    d = TimedDriver(s, linear(0.0, 0.0, 0.0))
    d.add(make_request("long", 4000, max_tokens=2, eos=None))
    d.add(*long_prompts(8, 4, max_tokens=50, prefix="short"))
    d.step()  # long's first 32 tokens and the 8 short prompts
    s.long_prefill_token_threshold = 60  # from now on long's chunks leave 4 tokens
    for _ in range(10):
        d.step()
    assert max(len(due) for due, _ in d.due) == 8
    starved = [due - scheduled for due, scheduled in d.due if not due <= scheduled]
    assert bool(starved) == (target == "off"), starved


# ------------------------------------------------------------------ "auto"


def test_auto_sets_no_target_until_a_step_is_measured_then_a_multiple_of_a_decode_step():
    budget = PrefillBudget(None, min_tokens=16, max_tokens=2048)
    assert budget.auto and budget.target(8) is None and budget.prefill_tokens(8) == 2048
    budget.scheduled(1, StepShape(2048, 0, 2048 * 1024))
    assert budget.observe(1, 2.0)
    decode_only = budget.model.predict(0, 8, 8 * 300)
    assert budget.target(8, 8 * 300) == pytest.approx(AUTO_MULTIPLE * decode_only)
    assert budget.prefill_tokens(0) == 2048  # a step with no decode is still not held


def test_step_time_model_learns_the_attention_cost():
    m = StepTimeModel(prefill_scale=512, decode_scale=16)
    truth = lambda p, d, pairs: 0.02 + 0.0005 * p + 0.004 * d + 2e-6 * pairs  # noqa: E731
    rng = random.Random(2)
    for _ in range(80):
        p, d = rng.randint(0, 512), rng.randint(0, 16)
        pairs = p * rng.randint(0, 2000) + d * rng.randint(1, 2000)
        m.observe(StepShape(p, d, pairs), truth(p, d, pairs))
    assert m.per_pair == pytest.approx(2e-6, rel=0.05)
    assert m.predict(100, 4, 50_000) == pytest.approx(truth(100, 4, 50_000), rel=0.02)


def test_auto_keeps_steps_near_a_multiple_of_the_decode_only_step_and_prompts_progress():
    # 48 prompts at once on a machine where a full 1024-token chunk takes ~1 s and a step of
    # decodes alone 30-80 ms: with "auto" every step with decodes stays near AUTO_MULTIPLE x
    # the decode-only time of the batch its decodes grow to (all 48: the waiting prompts
    # join it), prompts still finish, and no decode waits; "off" lets full chunks ride with
    # the decodes
    machine = linear(0.03, 0.001, 0.001)

    def run(target):
        s = make_scheduler(
            num_blocks=8192, max_num_seqs=64, max_num_batched_tokens=1024, target_step_ms=target
        )
        d = TimedDriver(s, machine)
        d.add(*long_prompts(48, 300, max_tokens=40))
        d.run()
        assert len(d.finished) == 48
        assert all(due <= scheduled for due, scheduled in d.due)
        return [
            machine(p, dd) / machine(0, min(64, n))
            for (p, dd), n in zip(d.shapes, d.demand, strict=True)
            if dd and p
        ]

    auto = run("auto")
    assert auto and max(auto[PROBE_EVERY:]) < 3.0, auto  # after the first probes
    assert max(run("off")) > 10
    assert len(auto) > 10  # prompts rode along many decode steps, in smaller chunks


# ------------------------------------------------------------------ the engine


INFO = ModelInfo(
    path="fake", architecture="Fake", vocab_size=32000, max_model_len=512, eos_token_ids=[0]
)


def _req(rid: str, n_prompt: int = 200, max_tokens: int = 8) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=[(7 * i + len(rid)) % 30000 + 1 for i in range(n_prompt)],
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=0,
    )


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_engine_core_feeds_each_step_time_to_the_budget(decode_steps):
    """Every step that ran is observed, but one the scheduler let run several decode steps
    (``scheduler.decode_steps``; four requests fit MAX_ROWS): its time is not one step's."""
    config = BatonConfig.load(
        max_model_len=512,
        **{"scheduler.target_step_ms": 200, "scheduler.decode_steps": decode_steps},
    )
    core = EngineCore(config, executor=FakeExecutor(block_size=16, latency_s=0.0), info=INFO)
    ticks = iter(range(10_000))
    core.step_clock = lambda: next(ticks) * 0.05  # each reading 50 ms after the previous
    for i in range(4):
        core.add_request(_req(f"r{i}"))
    ran = multi = 0
    schedule = core.scheduler.schedule

    def counting() -> SchedulerOutput:
        nonlocal multi
        so = schedule()
        multi += so.decode_steps > 1
        return so

    core.scheduler.schedule = counting  # type: ignore[method-assign]
    while core.has_work():
        ran += core.step()[1]
    budget = core.scheduler.prefill_budget
    assert budget is not None and budget.model.num_observed == ran - multi > 0
    assert (multi > 0) == (decode_steps > 1)


def test_engine_core_ignores_the_target_with_a_batch_queue(caplog):
    config = BatonConfig.load(max_model_len=512, **{"scheduler.target_step_ms": 200})
    fake = FakeExecutor(block_size=16, max_concurrent_batches=2, latency_s=0.0)
    with caplog.at_level(logging.WARNING, logger="baton.engine.step_target"):
        core = EngineCore(config, executor=fake, info=INFO)
    assert core.scheduler.prefill_budget is None
    assert core.config.scheduler.target_step_ms == "off"
    assert "target_step_ms=200.0 is ignored" in caplog.text


def test_engine_core_turns_auto_off_with_a_batch_queue_saying_why(caplog):
    config = BatonConfig.load(max_model_len=512)  # target_step_ms = "auto", the default
    fake = FakeExecutor(block_size=16, max_concurrent_batches=2, latency_s=0.0)
    with caplog.at_level(logging.INFO, logger="baton.engine.step_target"):
        core = EngineCore(config, executor=fake, info=INFO)
    assert core.scheduler.prefill_budget is None
    record = next(r for r in caplog.records if "target_step_ms=auto is ignored" in r.message)
    assert record.levelno == logging.INFO and "batches overlap" in record.message


def test_auto_takes_the_priors_proportions_at_the_first_measured_steps_scale():
    # a machine 5x slower than the prior: the first step's time scales every coefficient,
    # rather than going to the least pinned one (a fixed cost of seconds per step)
    model = StepTimeModel(prefill_scale=2048, rescale_prior=True)
    shape = StepShape(2048, 0, 200_000)
    model.observe(shape, 5 * model.predict(2048, 0, 200_000))
    prior = (DEFAULT.step_overhead_s, DEFAULT.prefill_s_per_token, DEFAULT.decode_s_per_token)
    assert model.coefficients == pytest.approx(tuple(5 * c for c in prior), rel=1e-6)
    budget = PrefillBudget(None, min_tokens=16, max_tokens=2048)
    budget.scheduled(1, shape)
    budget.observe(1, 5 * budget.model.predict(2048, 0, 200_000))
    # the first step with decodes measures them alone (a probe, not observed here); the
    # next, with 10 decodes, takes about AUTO_MULTIPLE decode-only steps, not a full chunk
    assert budget.prefill_tokens(10, 10 * 200) == 0
    budget.scheduled(2, StepShape(0, 10, 10 * 200))  # its time still to come
    n = budget.prefill_tokens(10, 10 * 200)
    step = budget.model.predict(n, 10, 10 * 200 + int(n * budget._pairs_per_prompt_token))
    assert step == pytest.approx(AUTO_MULTIPLE * budget.model.predict(0, 10, 10 * 200), rel=0.05)
    assert n < 200


def test_auto_bounds_what_one_stretched_step_teaches_the_model():
    budget = PrefillBudget(None, min_tokens=16, max_tokens=2048)
    for step in (1, 2):
        budget.scheduled(step, StepShape(512, 8, 60_000))
        budget.observe(step, 1.0)
    before = budget.model.predict(64, 8, 10_000)
    budget.scheduled(3, StepShape(64, 8, 10_000))
    budget.observe(3, 1000 * before)  # a neighbour stalled the machine for one step
    assert budget.model.predict(64, 8, 10_000) < 3 * before


def _auto_budget() -> PrefillBudget:
    """An ``"auto"`` budget whose first step, a 2,048-token chunk with no decode, took 5 s."""
    budget = PrefillBudget(None, min_tokens=16, max_tokens=2048)
    budget.scheduled(1, StepShape(2048, 0, 2048 * 1024))
    budget.observe(1, 5.0)
    return budget


def _steps(budget: PrefillBudget, rows: list[int], first: int) -> list[int]:
    """Schedule and observe one step per entry of ``rows`` (that many decodes, 100 context
    tokens each) on a linear machine; the prompt tokens each step got."""
    sizes = []
    for step, r in enumerate(rows, start=first):
        n = budget.prefill_tokens(r, r * 100)
        budget.scheduled(step, StepShape(n, r, r * 100 + n * 50))
        budget.observe(step, 0.01 + 0.002 * r + 0.001 * n)
        sizes.append(n)
    return sizes


def test_auto_probes_again_until_a_decode_only_step_is_measured():
    # a probe whose step the engine never timed (it ran several decode steps: a warm-up or a
    # quiet spell) measured no decode-only step, nor does a step that computed prompt tokens
    # after all: the next step probes again, not PROBE_EVERY steps later (until then the
    # target is the fit's, which moved 0.07-0.8 s from step to step in a burst after a warm-up)
    budget = _auto_budget()
    assert budget.prefill_tokens(10, 1000) == 0
    budget.scheduled(2, StepShape(32, 10, 3000))  # prompt tokens after all
    assert budget.prefill_tokens(10, 1000) == 0
    budget.scheduled(3, StepShape(0, 10, 1000))  # never timed
    budget.scheduled(4, StepShape(0, 10, 1000))
    assert budget.prefill_tokens(10, 1000) == 0
    # a probe whose time is awaited is not repeated, and once measured the cadence is back
    budget.scheduled(5, StepShape(0, 10, 1000))
    assert budget.prefill_tokens(10, 1000) > 0
    budget.scheduled(6, StepShape(64, 10, 4000))
    budget.observe(5, 0.05)
    assert 0 not in _steps(budget, [10] * PROBE_EVERY, first=7)


def _probe(budget: PrefillBudget, step: int, rows: int, seconds: float) -> None:
    budget.scheduled(step, StepShape(0, rows, rows * 100))
    assert budget.observe(step, seconds)


def test_auto_measures_decodes_alone_in_a_probe_step_and_targets_their_lower_quartile():
    budget = _auto_budget()
    # the first step with decodes computes no prompt token, then one every PROBE_STALE steps
    # while the decodes stay as many, and every PROBE_EVERY while they grow
    sizes = _steps(budget, [8] * (PROBE_STALE + 1), first=2)
    assert [i for i, n in enumerate(sizes) if n == 0] == [0, PROBE_STALE], sizes
    assert min(n for n in sizes if n) >= 16  # the other steps still compute prompts
    growing = _steps(budget, [8 + 2 * i for i in range(1, 2 * PROBE_EVERY + 1)], first=100)
    assert [i for i, n in enumerate(growing) if n == 0] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1]
    # decodes alone measured at 8 rows: the target is AUTO_MULTIPLE x their lower quartile
    # (the smallest of fewer than five), carried to the rows asked by the prior's shape and the
    # model's (the smaller); a stretched probe (a neighbour) does not move it, even the second
    budget = _auto_budget()
    _probe(budget, 10, 8, 0.2)
    _probe(budget, 11, 8, 0.5)
    assert budget.target(8, 800) == pytest.approx(AUTO_MULTIPLE * 0.2, rel=0.01)
    for step, seconds in enumerate([0.21, 0.19, 4.0, 0.2, 0.22], start=12):
        _probe(budget, step, 8, seconds)
    assert budget.target(8, 800) == pytest.approx(AUTO_MULTIPLE * 0.2, rel=0.01)
    prior = DEFAULT.step_cost(0, 32, 3200) / DEFAULT.step_cost(0, 8, 800)
    assert budget.target(32, 3200) <= AUTO_MULTIPLE * 0.2 * prior * 1.01


def test_auto_targets_the_batch_the_waiting_prompts_grow_the_decodes_to():
    budget = _auto_budget()
    for step, rows in enumerate([4, 8, 16, 32, 8], start=10):
        _probe(budget, step, rows, budget.model.predict(0, rows, rows * 100))
    alone = budget.target(8, 800)
    grown = budget.target(8, 800, demand_rows=48)
    assert (
        grown == pytest.approx(AUTO_MULTIPLE * budget.decode_only_s(48, 4800), rel=1e-6)
        and grown > 1.5 * alone
    )
    assert budget.target(8, 800, demand_rows=4) == pytest.approx(alone)  # never below its own
    budget.prefill_tokens(8, 800)  # the probe
    assert budget.prefill_tokens(8, 800, demand_rows=48) > budget.prefill_tokens(8, 800)
