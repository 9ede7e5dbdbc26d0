"""Per-step overhead of the parallel executors: broadcast, collectives, send/recv; KV memory per rank.

Runs a chat workload (greedy, exact max_new_tokens) through an EngineCore in this
process with each executor configuration, after one warm-up pass, and reads the
workers' own timings (``MultiprocExecutor.parallel_stats``):

- broadcast: executor side, encoding the SchedulerOutput and sending it to every
  worker; worker side, send -> received, for steps whose message arrived while
  the worker waited (the transport's latency, no queueing);
- all_reduce / gather: tensor-parallel collectives, summed per step (this
  includes waiting for the slower rank);
- send / recv: pipeline hidden states; recv includes waiting for the previous stage;
- the KV cache bytes of every rank (default sizing: the same number of blocks).

Throughput here is a by-product; ``baton bench throughput`` gives the official
figures. The machine is shared: each run reports others_cpu_frac.

    .venv/bin/python scripts/bench_parallel.py [--workload W] [--repeats 3] [--transports shm,zmq] [--json]
    .venv/bin/python scripts/bench_parallel.py --round-trip 2000 [--transports shm,zmq]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOAD = ROOT.parent / "shared" / "bench" / "workload_small.json"
CONFIGS: dict[str, dict[str, Any]] = {
    "tp1": {"executor": "uniproc"},
    "tp2": {"executor": "cuda-tp", "tensor_parallel_size": 2},
    "tp3": {"executor": "cuda-tp", "tensor_parallel_size": 3},
    "pp2": {"executor": "pipeline", "pipeline_parallel_size": 2},
}


def run_once(core: Any, wl: Any) -> tuple[float, int]:
    from baton.protocol import EngineCoreRequest
    from baton.sampling_params import SamplingParams

    stamp = time.monotonic_ns()
    for i, r in enumerate(wl.requests):
        params = SamplingParams(temperature=0.0, max_tokens=r.max_new_tokens, ignore_eos=True)
        core.add_request(
            EngineCoreRequest(
                request_id=f"{stamp}-{i}",
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=params,
            )
        )
    t0 = time.perf_counter()
    n = 0
    while core.has_work():
        outs, _ = core.step_fn()
        n += sum(len(o.new_token_ids) for o in outs.outputs) if outs else 0
    return time.perf_counter() - t0, n


def bench(
    name: str, overrides: dict[str, Any], wl: Any, repeats: int, model: str
) -> dict[str, Any]:
    from baton.bench.common import CpuMonitor
    from baton.config import BatonConfig
    from baton.engine.core import EngineCore

    cfg = BatonConfig.load(model=model, device="cpu", **overrides)
    core = EngineCore(cfg)
    try:
        run_once(core, wl)  # warm-up
        ex = core.executor
        parallel = hasattr(ex, "parallel_stats")
        if parallel:
            from baton.worker.worker_proc import reset_parallel_stats

            ex.collective_rpc(reset_parallel_stats)
            ex.broadcast_s.clear()
        runs = []
        for _ in range(repeats):
            core.reset_prefix_cache()
            with CpuMonitor() as mon:
                wall, n = run_once(core, wl)
            runs.append(
                {"wall_s": round(wall, 3), "tok_per_s": round(n / wall, 1), **(mon.result or {})}
            )
        out: dict[str, Any] = {
            "config": name,
            **overrides,
            "runs": runs,
            "tok_per_s_median": statistics.median(r["tok_per_s"] for r in runs),
            "others_cpu_frac_median": statistics.median(
                r.get("others_cpu_frac", 0.0) for r in runs
            ),
        }
        specs = ex.get_kv_cache_specs()
        out["kv_per_rank_mib"] = [
            round(core.num_blocks * s.page_size_bytes / 2**20, 2) for s in specs
        ]
        if parallel:
            out["broadcast_send_us_median"] = round(statistics.median(ex.broadcast_s) * 1e6, 1)
            out["ranks"] = [_rank_summary(s) for s in ex.parallel_stats()]
        return out
    finally:
        core.shutdown()


def bench_round_trip(transport: str, steps: int, world: int) -> dict[str, Any]:
    """Round trip of an empty step (broadcast to ``world`` workers + the driver's answer), tiny model."""
    from baton.config import BatonConfig
    from baton.plugins import get_registry
    from baton.protocol import SchedulerOutput
    from baton.testing.tiny_model import tiny_model

    cfg = BatonConfig.load(
        model=str(tiny_model("llama")),
        device="cpu",
        num_threads=1,
        executor="cuda-tp",
        tensor_parallel_size=world,
        **{"executor.cuda-tp": {"transport": transport}},
    )
    entry = get_registry().get("executor", "cuda-tp")
    ex = entry.create(cfg, cfg.plugin_settings("executor", "cuda-tp", entry.settings_model))
    try:
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            ex.execute_model(SchedulerOutput(step_id=i + 1))
            times.append(time.perf_counter() - t0)
        times.sort()
        return {
            "transport": transport,
            "workers": world,
            "steps": steps,
            "round_trip_us_p50": round(statistics.median(times) * 1e6, 1),
            "round_trip_us_p90": round(times[int(0.9 * len(times))] * 1e6, 1),
        }
    finally:
        ex.shutdown()


def _rank_summary(s: dict[str, Any]) -> dict[str, Any]:
    keep = {
        "rank": s["rank"],
        "steps": s["steps"],
        "kv_cache_mib": round(s["kv_cache_bytes"] / 2**20, 2),
    }
    for k in ("step", "broadcast_delivery", "all_reduce", "gather", "send", "recv"):
        if k in s:
            keep[f"{k}_us_median"] = round(s[k]["median_us"], 1)
            keep[f"{k}_steps"] = s[k]["n"]
    return keep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default="tp1,tp3,pp2")
    p.add_argument("--transports", default="shm,zmq", help="worker-channel transports to compare")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--round-trip",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead: round trip of STEPS empty steps to 2 workers over each transport",
    )
    args = p.parse_args()
    if args.round_trip:
        from baton.bench.common import CpuMonitor

        for t in args.transports.split(","):
            with CpuMonitor() as mon:
                res = bench_round_trip(t, args.round_trip, 2)
            print(json.dumps({**res, **(mon.result or {})}), flush=True)
        return
    from baton.bench.common import load_workload

    wl = load_workload(args.workload)
    results = []
    for name in args.configs.split(","):
        overrides = CONFIGS[name]
        transports = args.transports.split(",") if overrides["executor"] != "uniproc" else [None]
        for t in transports:
            ov = dict(overrides)
            if t is not None:
                ov[f"executor.{overrides['executor']}"] = {"transport": t}
            res = bench(name + (f"/{t}" if t else ""), ov, wl, args.repeats, args.model)
            results.append(res)
            if not args.json:
                print(json.dumps(res, indent=1), flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
