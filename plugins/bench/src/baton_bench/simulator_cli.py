"""``baton bench scheduler --workload`` / ``--calibrate``: the simulator's command line.

Builds the engine config from ``--config`` and the flags, loads or generates the
workload, loads the cost model (or measures one with ``--calibrate``), runs
``baton_bench.simulator.simulate`` for each ``--policy`` and prints the figures
side by side (``--json``: one object). ``--compare-real`` puts the first
policy's TTFT p50 and throughput next to a ``baton bench throughput --json``
result on the same workload.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from baton.config import BatonConfig
from baton_bench.common import Workload, WorkloadRequest, load_workload
from baton_bench.cost_files import load_cost_model, save_cost_model
from baton_bench.simulator import figures, simulate, table
from baton_bench.workloads import GENERATORS, write_workload


def sim_config(args: Any) -> BatonConfig:
    """The engine config the simulator (and --calibrate) use: the config file, then the given flags."""
    overrides: dict[str, Any] = {
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "model": getattr(args, "model", None),
    }
    if args.no_prefix_caching:
        overrides["enable_prefix_caching"] = False
    return BatonConfig.load(getattr(args, "config", None), **overrides)


def load_or_generate(spec: str, seed: int, rate: float | None = None) -> list[WorkloadRequest]:
    """A workload file's requests, or a generator's (``rate``: the poisson generator's)."""
    if spec in GENERATORS:
        kwargs = {"rate": rate} if rate is not None and spec == "poisson" else {}
        return GENERATORS[spec](seed=seed, **kwargs).requests
    return load_workload(spec).requests


def enough_blocks(workload: list[WorkloadRequest], block_size: int) -> int:
    return 1 + sum(-(-(len(w.prompt_token_ids) + w.max_new_tokens) // block_size) for w in workload)


def main(args: Any) -> int:
    # the real engine (torch): only --calibrate needs it, not the simulator
    from baton_bench.calibrate import calibrate

    config = sim_config(args)
    if args.calibrate:
        model = calibrate(config, seed=args.seed)
        if args.cost_model_out:
            save_cost_model(model, args.cost_model_out)
        print(json.dumps(msgspec_builtins(model), indent=None if args.json else 2))
        return 0
    cost = load_cost_model(args.cost_model)
    workload = load_or_generate(args.workload, args.seed, getattr(args, "arrival_rate", None))
    if args.num_requests and args.num_requests < len(workload):
        workload = sorted(workload, key=lambda w: w.arrival_time)[: args.num_requests]
    if args.save_workload:
        write_workload(
            Workload(format="chat-workload/v1", name=str(args.workload), requests=workload),
            args.save_workload,
        )
    num_blocks = (
        args.num_blocks or cost.num_blocks or enough_blocks(workload, config.cache.block_size)
    )
    policies = [p.strip() for p in (args.policy or config.scheduler.policy).split(",")]
    results = {}
    for name in policies:
        sim = simulate(
            workload,
            config.replace(policy=name),
            name,
            cost,
            num_blocks,
            seed=args.seed,
            noise=args.cost_noise,
            check=not args.no_check,
            slo_ttft_ms=getattr(args, "slo_ttft_ms", None),
            slo_tpot_ms=getattr(args, "slo_tpot_ms", None),
        )
        results[name] = figures(sim)
    out = {
        "bench": "scheduler-simulator",
        "workload": str(args.workload),
        "seed": args.seed,
        "num_blocks": num_blocks,
        "config": {
            "block_size": config.cache.block_size,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "prefix_caching": config.cache.enable_prefix_caching,
            "cost_noise": args.cost_noise,
            "slo_ttft_ms": getattr(args, "slo_ttft_ms", None),
            "slo_tpot_ms": getattr(args, "slo_tpot_ms", None),
        },
        "cost_model": msgspec_builtins(cost),
        "policies": results,
    }
    if args.compare_real:
        out["comparison"] = compare_real(results[policies[0]], args.compare_real)
    if args.json:
        print(json.dumps(out))
    else:
        c = out["config"]
        print(
            f"scheduler simulator: {len(workload)} requests from {args.workload}, {num_blocks} KV blocks, "
            f"block {c['block_size']}, max_num_seqs {c['max_num_seqs']}, budget {c['max_num_batched_tokens']}"
        )
        print(
            f"cost model: overhead {cost.step_overhead_s:.4g} s + prefill {cost.prefill_s_per_token:.4g} s/tok "
            f"+ decode {cost.decode_s_per_token:.4g} s/tok + attention {cost.attention_s_per_token_pair:.3g} s/pair"
            f" ({cost.source})\n"
        )
        print(table(results))
        for key, c in out.get("comparison", {}).items():
            print(f"{key}: simulated {c['simulated']} vs real {c['real']} ({c['error_pct']:+.1f}%)")
    return 0


def compare_real(sim: dict[str, Any], path: str) -> dict[str, dict[str, float]]:
    """Simulated vs measured TTFT p50 and throughput; ``path`` is `baton bench throughput --json` output."""
    from pathlib import Path

    real = json.loads(Path(path).read_text())
    pairs = {
        "ttft_s_p50": (sim["ttft_s_p50"], real["ttft_s"]["p50"]),
        "throughput_tok_s": (sim["throughput_tok_s"], real["tok_per_s"]["median"]),
    }
    return {
        k: {"simulated": s, "real": r, "error_pct": round(100.0 * (s - r) / r, 2)}
        for k, (s, r) in pairs.items()
    }


def msgspec_builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj)
