"""The scheduler simulator: replay a workload through the real scheduler with a timing model instead of a model.

Each request enters the real ``Scheduler`` (with the chosen policy plugin and
the real ``KVCacheManager``) at its ``arrival_time``; the ``FakeExecutor``
supplies tokens and a ``CostModel`` says how long each step took, so the clock
is simulated: a four-minute workload replays in a second or two, deterministically
for a seed (``noise`` > 0 draws a per-step factor from that seed).

``simulate`` returns per-request timings; ``figures`` turns them into what
``baton bench scheduler --workload`` prints for each policy: TTFT, ITL, e2e and
queue-time percentiles, throughput, preemptions and the same per tenant
(``WorkloadRequest.user``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from baton.config import BatonConfig
from baton.plugins.registry import get_registry
from baton.protocol import EngineCoreOutput
from baton.request import Request
from baton.sampling_params import SamplingParams
from baton.sched.cost_model import CostModel, step_features
from baton.sched.scheduler import Scheduler
from baton.scheduling_info import SchedulingInfo
from baton.testing.fake_executor import FakeExecutor
from baton.testing.sched_harness import SchedulerDriver, SimClock
from baton_bench.common import WorkloadRequest, percentile

_NO_TENANT = "-"


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    user: str
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_tokens: int = 0
    num_preemptions: int = 0
    gaps: list[float] = field(default_factory=list)


@dataclass(slots=True)
class SimResult:
    policy: str
    requests: dict[str, RequestTimes]
    steps: int
    num_preemptions: int
    duration_s: float
    prefix_cache_hit_rate: float
    #: Goodput as the engine counts it: finished requests with an SLO, and those that met it.
    slo_finished: int = 0
    slo_met: int = 0
    #: Tokens computed again after preemptions (their KV was freed and not found cached).
    recomputed_tokens: int = 0


def make_policy(config: BatonConfig, name: str) -> Any:
    entry = get_registry().get("scheduler_policy", name)
    return entry.create(config, entry.settings(config))


def simulate(
    workload: list[WorkloadRequest],
    config: BatonConfig,
    policy: str,
    cost: CostModel,
    num_blocks: int,
    *,
    seed: int = 0,
    noise: float = 0.0,
    check: bool = False,
    max_steps: int = 10_000_000,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> SimResult:
    """Replay ``workload`` with scheduler policy ``policy``; see the module docstring.

    ``slo_ttft_ms`` / ``slo_tpot_ms``: the SLO of every request without its own
    (``WorkloadRequest.slo_ttft_ms`` / ``slo_tpot_ms``)."""
    rng = random.Random(seed)
    ex = FakeExecutor(block_size=config.cache.block_size, num_blocks=num_blocks, check=check)
    clock = SimClock()
    sched = Scheduler(
        config.scheduler,
        config.cache,
        make_policy(config, policy),
        num_blocks,
        clock=clock,
        max_model_len=config.model.max_model_len,
    )
    driver = SchedulerDriver(sched, ex, clock=clock, record=False)
    reqs, times = _requests(workload, slo_ttft_ms, slo_tpot_ms)
    driver.submit(*reqs.values())
    steps = preemptions = queries = hits = computed = 0
    while driver.has_work():
        if steps >= max_steps:
            raise RuntimeError(f"simulation of {policy!r} did not finish in {max_steps} steps")
        so = driver.schedule()
        steps += 1
        if not so.num_scheduled_tokens:
            # nothing runnable (an admission-control policy holding back): time still passes
            if so.finished_req_ids or so.preempted_req_ids:
                ex.execute_model(so)  # the runner still drops those requests
                preemptions += len(so.preempted_req_ids)
            next_arrival = driver.pending[0].arrival_time if driver.pending else 0.0
            clock.now = max(clock.now + cost.step_overhead_s, next_arrival)
            continue
        for new in so.scheduled_new_reqs:
            rt = times[new.req_id]
            if rt.first_scheduled is None:
                rt.first_scheduled = clock.now
        dt = cost.step_cost(*step_features(sched.requests, so.num_scheduled_tokens))
        if noise > 0:
            dt *= rng.lognormvariate(0.0, noise)
        clock.now += dt
        computed += so.total_num_scheduled_tokens
        outs = driver.finish_step(so, ex.execute_model(so))
        sched.observe_step_time(so.step_id, dt)  # as EngineCore does: the latency-aware budget
        preemptions += len(so.preempted_req_ids)
        stats = sched.make_stats()
        queries += stats.prefix_cache_queries
        hits += stats.prefix_cache_hits
        _stamp(times, outs, clock.now)
    for rid, rt in times.items():
        if rt.finished is None:
            raise AssertionError(f"simulation lost request {rid!r}")
        rt.num_preemptions = reqs[rid].num_preemptions
    return SimResult(
        policy,
        times,
        steps,
        preemptions,
        clock.now,
        hits / queries if queries else 0.0,
        sched.total_slo_finished,
        sched.total_slo_met,
        # every token once (the last sampled one is never fed back), less what the cache gave
        computed + hits - sum(len(w.prompt_token_ids) + w.max_new_tokens - 1 for w in workload),
    )


def _requests(
    workload: list[WorkloadRequest], slo_ttft_ms: float | None, slo_tpot_ms: float | None
) -> tuple[dict[str, Request], dict[str, RequestTimes]]:
    """The workload's requests in arrival order, and their (empty) timings."""
    params: dict[int, SamplingParams] = {}
    reqs: dict[str, Request] = {}
    times: dict[str, RequestTimes] = {}
    for w in sorted(workload, key=lambda w: w.arrival_time):
        sp = params.get(w.max_new_tokens)
        if sp is None:
            sp = params[w.max_new_tokens] = SamplingParams(
                max_tokens=w.max_new_tokens, ignore_eos=True
            )
        rid = w.id or f"req-{len(times)}"
        times[rid] = RequestTimes(w.arrival_time, w.user or _NO_TENANT)
        ttft = w.slo_ttft_ms if w.slo_ttft_ms is not None else slo_ttft_ms
        tpot = w.slo_tpot_ms if w.slo_tpot_ms is not None else slo_tpot_ms
        reqs[rid] = Request(
            rid,
            w.prompt_token_ids,
            sp,
            eos_token_id=None,
            arrival_time=w.arrival_time,
            user=w.user,
            scheduling=SchedulingInfo(slo_ttft_ms=ttft, slo_tpot_ms=tpot),
        )
    return reqs, times


def _stamp(times: dict[str, RequestTimes], outs: list[EngineCoreOutput], now: float) -> None:
    """Token and finish times of a step's outputs."""
    for o in outs:
        rt = times[o.request_id]
        if o.new_token_ids:
            if rt.first_token is None:
                rt.first_token = now
            else:
                rt.gaps.append(now - rt.last_token)  # type: ignore[operator]
            rt.last_token = now
            rt.num_tokens += len(o.new_token_ids)
        if o.finish_reason is not None:
            rt.finished = now


# ----------------------------------------------------------------------------- figures


def _pcts(
    values: list[float], name: str, qs: tuple[int, ...] = (50, 90, 99)
) -> dict[str, float | None]:
    return {f"{name}_p{q}": (round(percentile(values, q), 4) if values else None) for q in qs}


def _summary(rts: list[RequestTimes], start: float) -> dict[str, Any]:
    tokens = sum(r.num_tokens for r in rts)
    end = max(r.finished for r in rts)  # type: ignore[type-var]
    return {
        "requests": len(rts),
        "output_tokens": tokens,
        "throughput_tok_s": round(tokens / max(end - start, 1e-9), 3),
        **_pcts([r.first_token - r.arrival for r in rts], "ttft_s"),  # type: ignore[operator]
        **_pcts([g for r in rts for g in r.gaps], "itl_s"),
        **_pcts([r.finished - r.arrival for r in rts], "e2e_s"),  # type: ignore[operator]
        **_pcts([r.first_scheduled - r.arrival for r in rts], "queue_s", (50, 99)),  # type: ignore[operator]
        "queue_s_max": round(max(r.first_scheduled - r.arrival for r in rts), 4),  # type: ignore[operator]
        "preempted_requests": sum(1 for r in rts if r.num_preemptions),
    }


def figures(result: SimResult) -> dict[str, Any]:
    """TTFT / ITL / e2e / queue percentiles, throughput and preemptions; overall and per tenant."""
    rts = list(result.requests.values())
    start = min(r.arrival for r in rts)
    out = _summary(rts, start)
    out.update(
        steps=result.steps,
        preemptions=result.num_preemptions,
        duration_s=round(result.duration_s - start, 3),
        prefix_cache_hit_rate=round(result.prefix_cache_hit_rate, 4),
        recomputed_tokens=result.recomputed_tokens,
    )
    if result.slo_finished:
        out.update(
            slo_requests=result.slo_finished,
            slo_met=result.slo_met,
            slo_attainment=round(result.slo_met / result.slo_finished, 4),
            goodput_req_s=round(result.slo_met / max(result.duration_s - start, 1e-9), 4),
        )
    tenants = sorted({r.user for r in rts})
    if len(tenants) > 1 or tenants != [_NO_TENANT]:
        out["per_tenant"] = {t: _summary([r for r in rts if r.user == t], start) for t in tenants}
    return out


#: (row label, key) of the side-by-side table.
ROWS = (
    ("requests", "requests"),
    ("output tokens", "output_tokens"),
    ("throughput tok/s", "throughput_tok_s"),
    ("duration s", "duration_s"),
    ("TTFT p50 s", "ttft_s_p50"),
    ("TTFT p90 s", "ttft_s_p90"),
    ("TTFT p99 s", "ttft_s_p99"),
    ("ITL p50 s", "itl_s_p50"),
    ("ITL p99 s", "itl_s_p99"),
    ("e2e p50 s", "e2e_s_p50"),
    ("e2e p99 s", "e2e_s_p99"),
    ("queue max s", "queue_s_max"),
    ("preemptions", "preemptions"),
    ("recomputed tokens", "recomputed_tokens"),
    ("SLO met / with SLO", "slo_met"),
    ("SLO attainment", "slo_attainment"),
    ("goodput req/s", "goodput_req_s"),
    ("steps", "steps"),
    ("prefix hit rate", "prefix_cache_hit_rate"),
)
TENANT_ROWS = (
    ("requests", "requests"),
    ("tok/s", "throughput_tok_s"),
    ("TTFT p50 s", "ttft_s_p50"),
    ("TTFT p99 s", "ttft_s_p99"),
    ("e2e p50 s", "e2e_s_p50"),
    ("e2e p99 s", "e2e_s_p99"),
    ("queue max s", "queue_s_max"),
)


def table(results: dict[str, dict[str, Any]]) -> str:
    """Policies side by side: one column each, overall rows then per-tenant rows."""
    names = list(results)
    width = max(12, *(len(n) + 2 for n in names))
    lines = [f"{'':<26}" + "".join(f"{n:>{width}}" for n in names)]

    def row(label: str, values: list[Any]) -> None:
        cells = "".join(f"{_fmt(v):>{width}}" for v in values)
        lines.append(f"{label:<26}{cells}")

    for label, key in ROWS:
        row(label, [results[n].get(key) for n in names])
    tenants = sorted({t for n in names for t in results[n].get("per_tenant", {})})
    for t in tenants:
        lines.append(f"[{t}]")
        for label, key in TENANT_ROWS:
            row(f"  {label}", [results[n].get("per_tenant", {}).get(t, {}).get(key) for n in names])
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
