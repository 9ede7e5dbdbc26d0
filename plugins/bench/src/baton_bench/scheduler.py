"""Scheduler overhead and the scheduler simulator: the real Scheduler + KVCacheManager, no model.

Overhead (default): only scheduler time is measured (``schedule()`` +
``update_from_output()``), per step, with the fake executor. Two variants:
``default`` (enough blocks for 256 running requests) and ``tight`` (2048
blocks, which forces preemptions). Deterministic for a seed.

Simulator (``--workload FILE|bursty-two-tenant``): replays a workload with
arrival times and tenants through each ``--policy`` (comma-separated) with a
timing model of the executor (``--cost-model``; ``--calibrate`` measures one
with the real model) and prints TTFT / ITL / e2e percentiles, throughput,
preemptions and per-tenant figures side by side. See ``baton_bench.simulator``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from baton.config import BatonConfig
from baton.request import Request
from baton.sampling_params import SamplingParams
from baton.sched.scheduler import Scheduler
from baton.testing.fake_executor import FakeExecutor
from baton.testing.sched_harness import SchedulerDriver, SimClock
from baton_bench import simulator_cli
from baton_bench.common import CpuMonitor, WorkloadRequest, emit, percentile
from baton_bench.simulator import make_policy

VOCAB = 32000


def make_workload(
    num_requests: int = 1000,
    seed: int = 0,
    min_prompt: int = 64,
    max_prompt: int = 512,
    output_len: int = 128,
    shared_prefix_frac: float = 0.5,
    num_prefixes: int = 8,
    arrival_rate: float | None = None,
    num_users: int = 1,
) -> list[WorkloadRequest]:
    """Prompts uniform in [min_prompt, max_prompt]; a fraction start with one of a few shared prefixes.

    ``arrival_rate`` (requests/s) gives Poisson arrivals; None: all arrive at 0.
    """
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(1, VOCAB) for _ in range(rng.randrange(32, max(33, min_prompt * 3)))]
        for _ in range(num_prefixes)
    ]
    t = 0.0
    out = []
    for i in range(num_requests):
        n = rng.randint(min_prompt, max_prompt)
        prompt: list[int] = []
        if prefixes and rng.random() < shared_prefix_frac:
            prompt = list(rng.choice(prefixes)[: max(0, n - 16)])
        prompt += [rng.randrange(1, VOCAB) for _ in range(n - len(prompt))]
        if arrival_rate:
            t += rng.expovariate(arrival_rate)
        out.append(
            WorkloadRequest(
                id=f"req-{i}",
                prompt_token_ids=prompt,
                max_new_tokens=output_len,
                arrival_time=t,
                user=f"user-{i % num_users}",
            )
        )
    return out


def run_scheduler_bench(
    workload: list[WorkloadRequest],
    config: BatonConfig,
    num_blocks: int,
    *,
    check: bool = True,
    executor_settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Replay ``workload`` through a Scheduler built from ``config``; return the figures.

    Time advances on the fake executor's simulated clock (its cost model;
    zero by default), so arrivals and the policy's ``peek(now)`` see a
    deterministic clock. Only scheduler calls are timed, with perf_counter.
    """
    ex = FakeExecutor(
        block_size=config.cache.block_size,
        num_blocks=num_blocks,
        vocab_size=VOCAB,
        simulate_time=True,
        check=check,
        **(executor_settings or {}),
    )
    clock = SimClock()  # follows the fake executor's simulated time (its cost model)
    sched = Scheduler(
        config.scheduler,
        config.cache,
        make_policy(config, config.scheduler.policy),
        num_blocks,
        clock=clock,
        max_model_len=config.model.max_model_len,
    )
    driver = SchedulerDriver(sched, ex, clock=clock, record=False)
    params = {
        n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        for n in {w.max_new_tokens for w in workload}
    }
    perf = time.perf_counter
    tally = _Tally()
    first_token: dict[str, float] = {}
    arrival = {w.id: w.arrival_time for w in workload}
    wall0 = perf()
    driver.submit(
        *(
            Request(
                w.id,
                w.prompt_token_ids,
                params[w.max_new_tokens],
                eos_token_id=0,
                arrival_time=w.arrival_time,
                user=w.user,
            )
            for w in workload
        )
    )
    while driver.has_work():
        so = driver.schedule()  # idle: the clock jumps to the next arrival
        ex.simulated_time = clock.now
        mro = ex.execute_model(so)
        clock.now = ex.simulated_time
        outs = driver.finish_step(so, mro)
        tally.step_s.append(driver.schedule_s + driver.update_s)
        tally.sched_s.append(driver.schedule_s)
        tally.update_s.append(driver.update_s)
        tally.running.append(len(so.num_scheduled_tokens))
        stats = sched.make_stats()
        tally.preemptions += stats.num_preemptions
        tally.queries += stats.prefix_cache_queries
        tally.hits += stats.prefix_cache_hits
        t = clock.now
        for o in outs:
            tally.num_tokens_out += len(o.new_token_ids)
            if o.request_id not in first_token:
                first_token[o.request_id] = t
                tally.ttft.append(t - arrival[o.request_id])
            if o.finish_reason is not None:
                tally.e2e.append(t - arrival[o.request_id])
    tally.add_s = driver.add_s
    wall = perf() - wall0
    if tally.num_tokens_out != sum(w.max_new_tokens for w in workload):
        raise AssertionError(f"the bench lost tokens: {tally.num_tokens_out} generated")
    return _figures(workload, config, num_blocks, tally, wall, clock.now)


@dataclass
class _Tally:
    """What one bench run counts, step by step (seconds; simulated seconds for ttft / e2e)."""

    step_s: list[float] = field(default_factory=list)
    sched_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    add_s: float = 0.0
    num_tokens_out: int = 0
    preemptions: int = 0
    queries: int = 0
    hits: int = 0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)


def _figures(
    workload: list[WorkloadRequest],
    config: BatonConfig,
    num_blocks: int,
    tally: _Tally,
    wall: float,
    sim_time: float,
) -> dict[str, Any]:
    ms = 1e3
    step_s, sched_s, update_s, running = tally.step_s, tally.sched_s, tally.update_s, tally.running
    add_s, ttft, e2e = tally.add_s, tally.ttft, tally.e2e
    full = config.scheduler.max_num_seqs
    busiest = max(running)
    at_full = [s for s, r in zip(step_s, running, strict=True) if r >= full]
    at_max = [s for s, r in zip(step_s, running, strict=True) if r == busiest]
    per_req = [s / r for s, r in zip(step_s, running, strict=True) if r >= max(1, busiest // 2)]
    total = sum(step_s) + add_s
    out: dict[str, Any] = {
        "num_requests": len(workload),
        "num_blocks": num_blocks,
        "policy": config.scheduler.policy,
        "steps": len(step_s),
        "step_ms_median": round(statistics.median(step_s) * ms, 4),
        "step_ms_p99": round(percentile(step_s, 99) * ms, 4),
        "schedule_ms_median": round(statistics.median(sched_s) * ms, 4),
        "update_ms_median": round(statistics.median(update_s) * ms, 4),
        f"step_ms_median_at_{full}_running": round(statistics.median(at_full) * ms, 4)
        if at_full
        else None,
        f"steps_at_{full}_running": len(at_full),
        "max_running": busiest,
        "step_ms_median_at_max_running": round(statistics.median(at_max) * ms, 4),
        "us_per_running_request_per_step": round(statistics.median(per_req) * 1e6, 3),
        "add_request_us_mean": round(add_s / len(workload) * 1e6, 2),
        "scheduler_s_total": round(total, 4),
        "requests_per_s_of_scheduler_time": round(len(workload) / total, 1),
        "output_tokens": tally.num_tokens_out,
        "num_preemptions": tally.preemptions,
        "prefix_cache_hit_rate": round(tally.hits / tally.queries, 4) if tally.queries else 0.0,
        "wall_s": round(wall, 2),
    }
    if sim_time > 0:
        out["simulated"] = {
            "duration_s": round(sim_time, 3),
            "ttft_s_median": round(statistics.median(ttft), 4),
            "e2e_s_median": round(statistics.median(e2e), 4),
            "e2e_s_p99": round(percentile(e2e, 99), 4),
        }
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="overhead: requests (default 1000); simulator: use only the first N arrivals",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks (overhead: 16384 in the default variant; simulator: the cost model's or enough)",
    )
    p.add_argument(
        "--tight-num-blocks",
        type=int,
        default=2048,
        help="blocks in the tight (preempting) variant",
    )
    p.add_argument("--variant", choices=("both", "default", "tight"), default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policy",
        default=None,
        help="scheduler policy, or several comma-separated to compare (default: the config's)",
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="default: 16 (simulator: the config's)"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="default: 256 (simulator: the config's)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="default: 8192 (simulator: the config's)",
    )
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--shared-prefix-frac", type=float, default=0.5)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--no-check", action="store_true", help="skip the fake executor's contract checks"
    )
    _add_simulator_arguments(p.add_argument_group("simulator"))
    # SUPPRESS: a --config given to the parent `baton bench` parser is not overwritten with None
    p.add_argument("--config", default=argparse.SUPPRESS, help="a TOML or YAML config file")


def _add_simulator_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--workload",
        help="a chat-workload JSON with arrival_time/user, or a generator: bursty-two-tenant, "
        "poisson",
    )
    g.add_argument(
        "--arrival-rate",
        type=float,
        default=None,
        metavar="REQ_PER_S",
        help="the poisson generator's rate (default 1.0)",
    )
    g.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="every request's time-to-first-token target (one without its own): goodput",
    )
    g.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=None,
        help="every request's time-per-output-token target (one without its own): goodput",
    )
    g.add_argument("--save-workload", metavar="FILE", help="write the (generated) workload to FILE")
    g.add_argument(
        "--cost-model",
        metavar="FILE|overhead=S,prefill=S,decode=S[,attention=S]",
        help="executor timing model (default: the built-in rough CPU figures)",
    )
    g.add_argument(
        "--cost-noise", type=float, default=0.0, help="log-normal sigma of a per-step cost factor"
    )
    g.add_argument(
        "--calibrate", action="store_true", help="measure the cost model with the real model"
    )
    g.add_argument(
        "--cost-model-out", metavar="FILE", help="where --calibrate writes the cost model JSON"
    )
    g.add_argument("--model", help="the model --calibrate runs (default: the config's)")
    g.add_argument(
        "--compare-real",
        metavar="FILE",
        help="a `baton bench throughput --json` result on the same workload: report the error",
    )


def main(args: argparse.Namespace) -> int:
    if args.calibrate or args.workload:
        return simulator_cli.main(args)
    config = BatonConfig.load(
        getattr(args, "config", None),
        block_size=args.block_size or 16,
        max_num_seqs=args.max_num_seqs or 256,
        max_num_batched_tokens=args.max_num_batched_tokens or 8192,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=True,
    )
    policies = args.policy.split(",") if args.policy else [config.scheduler.policy]
    workload = make_workload(
        args.num_requests or 1000,
        args.seed,
        args.min_prompt,
        args.max_prompt,
        args.output_len,
        args.shared_prefix_frac,
    )
    variants = {"default": args.num_blocks or 16384, "tight": args.tight_num_blocks}
    if args.variant != "both":
        variants = {args.variant: variants[args.variant]}
    result: dict[str, Any] = {
        "bench": "scheduler",
        "config": {
            "block_size": config.cache.block_size,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "prefix_caching": not args.no_prefix_caching,
            "output_len": args.output_len,
            "prompt_len": [args.min_prompt, args.max_prompt],
            "seed": args.seed,
        },
    }
    with CpuMonitor() as cpu:
        for policy in policies:
            # one policy: the figures at the top level, as always; several: one object per policy
            into = (
                result
                if len(policies) == 1
                else result.setdefault("policies", {}).setdefault(policy, {})
            )
            cfg = config.replace(policy=policy.strip())
            for name, blocks in variants.items():
                gc.collect()
                into[name] = run_scheduler_bench(workload, cfg, blocks, check=not args.no_check)
    result["cpu"] = cpu.result
    if args.json:
        emit(result, True)
    elif len(policies) == 1:
        _print_human(result, variants)
    else:
        for policy, figures in result["policies"].items():
            print(f"\n===== policy {policy}")
            _print_human({**result, **figures}, variants)
    return 0


def _print_human(result: dict[str, Any], variants: dict[str, int]) -> None:
    c = result["config"]
    print(
        f"scheduler bench: prompts {c['prompt_len'][0]}-{c['prompt_len'][1]} tokens, {c['output_len']} out, "
        f"block {c['block_size']}, max_num_seqs {c['max_num_seqs']}, "
        f"max_num_batched_tokens {c['max_num_batched_tokens']}, prefix caching {c['prefix_caching']}"
    )
    for name in variants:
        print(f"\n[{name}]")
        for k, v in result[name].items():
            print(f"  {k:>36}: {v}")
    print(f"\ncpu: {result['cpu']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m baton_bench.scheduler", description=__doc__)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
