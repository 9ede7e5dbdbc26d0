#!/usr/bin/env python3
"""Issue 34's simulator figures: ``target_step_ms = "auto"`` against ``"off"``, and ``slo``
against ``fcfs`` on workload.json's requests sent as ``baton bench serve`` sends them.

    .venv/bin/python plugins/bench/scripts/sim_step_budget.py auto [--workload W] [--noise 0.15]
        [--seeds 5]
    .venv/bin/python plugins/bench/scripts/sim_step_budget.py slo [--workload W] [--load 1.2]
        [--slo-ttft-ms 5000] [--slo-tpot-ms 1000] [--seeds 5]

``auto``: the workload all at once (max_num_seqs 64, budget 2048) through the real scheduler
with the built-in cost model on three machines (x1: the cost model; x5: every term five
times slower; x0.05: overhead, decode and attention x0.05, prompt tokens x0.005, a GPU-like
ratio) and a log-normal factor per step (``--noise``), seeds 0..N-1; one table row per
machine and seed: ITL p50 / p99 of both, auto's p99 / p50, auto's throughput over off's of
the same seed and over off's median, TTFT p50 / p90 of both.

``slo``: the rate the simulated engine sustains (all requests at once, fcfs), then the same
requests as Poisson arrivals at ``--load`` times it (``baton_bench.serve.arrival_offsets``,
seeds 1..N), every request with the given SLO; requests that met it under fcfs and slo.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import msgspec

from baton.config import BatonConfig
from baton.sched.cost_model import DEFAULT, CostModel
from baton_bench.common import WorkloadRequest, default_bench_dir, load_workload
from baton_bench.serve import arrival_offsets
from baton_bench.simulator import figures, simulate
from baton_bench.simulator_cli import enough_blocks

#: (overhead, prompt token, decode row, attention pair) factors on the built-in cost model.
MACHINES = {"x1": (1, 1, 1, 1), "x5": (5, 5, 5, 5), "x0.05": (0.05, 0.005, 0.05, 0.05)}


def machine(name: str) -> CostModel:
    f = MACHINES[name]
    return CostModel(
        step_overhead_s=DEFAULT.step_overhead_s * f[0],
        prefill_s_per_token=DEFAULT.prefill_s_per_token * f[1],
        decode_s_per_token=DEFAULT.decode_s_per_token * f[2],
        attention_s_per_token_pair=DEFAULT.attention_s_per_token_pair * f[3],
        source=f"built-in {name}",
    )


def run(
    workload: list[WorkloadRequest],
    config: BatonConfig,
    cost: CostModel,
    seed: int,
    noise: float,
    **slo: Any,
) -> dict[str, Any]:
    policy = config.scheduler.policy
    blocks = enough_blocks(workload, config.cache.block_size)
    return figures(simulate(workload, config, policy, cost, blocks, seed=seed, noise=noise, **slo))


def auto_table(workload: list[WorkloadRequest], noise: float, seeds: int) -> None:
    base = BatonConfig.load(None, max_num_seqs=64, max_num_batched_tokens=2048)
    print(
        "| machine | seed | off ITL p50 / p99 s | auto ITL p50 / p99 s | auto p99 / p50 "
        "| auto / off tok/s (same seed) | auto / off's median | TTFT p50 / p90 s off | auto |"
    )
    for name in MACHINES:
        cost = machine(name)
        res = {
            s: {
                t: run(workload, base.replace(target_step_ms=t), cost, s, noise)
                for t in ("off", "auto")
            }
            for s in range(seeds)
        }
        off_median = statistics.median(r["off"]["throughput_tok_s"] for r in res.values())
        for s, r in res.items():
            o, a = r["off"], r["auto"]
            print(
                f"| {name} | {s} | {o['itl_s_p50']:.3g} / {o['itl_s_p99']:.3g} "
                f"| {a['itl_s_p50']:.3g} / {a['itl_s_p99']:.3g} "
                f"| {a['itl_s_p99'] / a['itl_s_p50']:.2f}x "
                f"| {a['throughput_tok_s'] / o['throughput_tok_s']:.3f} "
                f"| {a['throughput_tok_s'] / off_median:.3f} "
                f"| {o['ttft_s_p50']:.3g} / {o['ttft_s_p90']:.3g} "
                f"| {a['ttft_s_p50']:.3g} / {a['ttft_s_p90']:.3g} |"
            )


def slo_table(
    workload: list[WorkloadRequest], load: float, ttft: float, tpot: float, seeds: int
) -> None:
    base = BatonConfig.load(None, max_num_seqs=64, max_num_batched_tokens=2048)
    cost = machine("x1")
    reqs = [
        msgspec.structs.replace(w, id=f"r{i}", arrival_time=0.0) for i, w in enumerate(workload)
    ]
    burst = run(reqs, base, cost, 0, 0.15)
    rate = load * burst["requests"] / burst["duration_s"]
    print(f"sustained {rate / load:.3f} requests/s; arrivals at {rate:.3f} ({load}x)")
    print("| seed | fcfs met | slo met | slo / fcfs | TTFT p50 s fcfs / slo |")
    met = {"fcfs": 0, "slo": 0}
    for seed in range(1, seeds + 1):
        sent = [
            msgspec.structs.replace(w, arrival_time=t)
            for w, t in zip(reqs, arrival_offsets(len(reqs), rate, seed), strict=True)
        ]
        row = {
            p: run(
                sent, base.replace(policy=p), cost, seed, 0.15, slo_ttft_ms=ttft, slo_tpot_ms=tpot
            )
            for p in ("fcfs", "slo")
        }
        for p in met:
            met[p] += row[p]["slo_met"]
        f, s = row["fcfs"], row["slo"]
        print(
            f"| {seed} | {f['slo_met']} / {f['slo_requests']} | {s['slo_met']} / {s['slo_requests']} "
            f"| {s['slo_met'] / max(1, f['slo_met']):.2f}x | {f['ttft_s_p50']:.3g} / {s['ttft_s_p50']:.3g} |"
        )
    print(f"| all | {met['fcfs']} | {met['slo']} | {met['slo'] / max(1, met['fcfs']):.2f}x | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("table", choices=("auto", "slo"))
    p.add_argument("--workload", default=None, help="default: workload.json of ../shared/bench")
    p.add_argument("--noise", type=float, default=0.15)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--load", type=float, default=1.2)
    p.add_argument("--slo-ttft-ms", type=float, default=5000)
    p.add_argument("--slo-tpot-ms", type=float, default=1000)
    args = p.parse_args()
    workload = load_workload(args.workload or default_bench_dir() / "workload.json").requests
    if args.table == "auto":
        auto_table(workload, args.noise, args.seeds)
    else:
        slo_table(workload, args.load, args.slo_ttft_ms, args.slo_tpot_ms, args.seeds)


if __name__ == "__main__":
    main()
