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

``--backend ray`` runs the parallel configs on the ``ray`` executor (baton-plugin-ray)
instead of the local ones, each on a local Ray instance it starts (loopback only), with
the same per-rank timings; ``--backend both`` runs each config on both, alternating,
so the two see the same machine. ``step_ms_median`` is the engine's own step time
(EngineCore.step_fn, wall clock): the overhead of an executor is the difference.

    .venv/bin/python plugins/bench/scripts/bench_parallel.py [--workload W] [--repeats 3] [--transports shm,zmq] [--json]
    .venv/bin/python plugins/bench/scripts/bench_parallel.py --backend both --configs tp3 --transports shm
    .venv/bin/python plugins/bench/scripts/bench_parallel.py --round-trip 2000 [--transports shm,zmq] [--backend ray]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_WORKLOAD = ROOT.parent / "shared" / "bench" / "workload.json"
CONFIGS: dict[str, dict[str, Any]] = {
    "tp1": {"executor": "uniproc"},
    "tp2": {"executor": "cuda-tp", "tensor_parallel_size": 2},
    "tp3": {"executor": "cuda-tp", "tensor_parallel_size": 3},
    "pp2": {"executor": "pipeline", "pipeline_parallel_size": 2},
}


def run_once(core: Any, wl: Any, steps: list[float] | None = None) -> tuple[float, int]:
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
        s0 = time.perf_counter()
        outs, ran = core.step_fn()
        if steps is not None and ran:
            steps.append(time.perf_counter() - s0)
        n += sum(len(o.new_token_ids) for o in outs.outputs) if outs else 0
    return time.perf_counter() - t0, n


def bench(
    name: str, overrides: dict[str, Any], wl: Any, repeats: int, model: str
) -> dict[str, Any]:
    from baton.config import BatonConfig
    from baton.engine.core import EngineCore
    from baton_bench.common import CpuMonitor

    cfg = BatonConfig.load(model=model, device="cpu", **overrides)
    core = EngineCore(cfg)
    try:
        run_once(core, wl)  # warm-up
        ex = core.executor
        parallel = hasattr(ex, "parallel_stats")
        if parallel:
            from baton.executor.rank import reset_parallel_stats

            ex.collective_rpc(reset_parallel_stats)
            ex.broadcast_s.clear()
        runs = []
        for _ in range(repeats):
            core.reset_prefix_cache()
            steps: list[float] = []
            with CpuMonitor() as mon:
                wall, n = run_once(core, wl, steps)
            runs.append(
                {
                    "wall_s": round(wall, 3),
                    "tok_per_s": round(n / wall, 1),
                    "steps": len(steps),
                    "step_ms_median": round(statistics.median(steps) * 1e3, 2),
                    "step_ms_mean": round(statistics.fmean(steps) * 1e3, 2),
                    **(mon.result or {}),
                }
            )
        out: dict[str, Any] = {
            "config": name,
            **overrides,
            "runs": runs,
            "tok_per_s_median": statistics.median(r["tok_per_s"] for r in runs),
            "step_ms_median": statistics.median(r["step_ms_median"] for r in runs),
            "step_ms_mean_median": statistics.median(r["step_ms_mean"] for r in runs),
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


def bench_round_trip(transport: str | None, steps: int, world: int) -> dict[str, Any]:
    """Round trip of an empty step (broadcast to ``world`` workers + the driver's answer), tiny
    model; ``transport`` None: the ray executor's."""
    from baton.config import BatonConfig
    from baton.plugins import get_registry
    from baton.protocol import SchedulerOutput
    from baton.testing.tiny_model import tiny_model

    name = "cuda-tp" if transport is not None else "ray"
    cfg = BatonConfig.load(
        model=str(tiny_model("llama")),
        device="cpu",
        num_threads=1,
        executor=name,
        tensor_parallel_size=world,
        **({"executor.cuda-tp": {"transport": transport}} if transport else {}),
    )
    entry = get_registry().get("executor", name)
    ex = entry.create(cfg, cfg.plugin_settings("executor", name, entry.settings_model))
    try:
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            ex.execute_model(SchedulerOutput(step_id=i + 1))
            times.append(time.perf_counter() - t0)
        times.sort()
        return {
            "transport": transport or "ray",
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
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help='a model, or "tiny" (tests\' llama)'
    )
    p.add_argument(
        "--requests", type=int, default=8, help="the workload's first N requests (0: all)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default="tp1,tp3,pp2")
    p.add_argument("--transports", default="shm,zmq", help="worker-channel transports to compare")
    p.add_argument(
        "--backend",
        choices=["local", "ray", "both"],
        default="local",
        help="the parallel configs on the local executors (cuda-tp, pipeline), on ray, or both",
    )
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
        from baton_bench.common import CpuMonitor

        local = args.transports.split(",") if args.backend != "ray" else []
        ray = [None] if args.backend != "local" else []
        for t in [*local, *ray]:
            with CpuMonitor() as mon:
                res = bench_round_trip(t, args.round_trip, 2)
            print(json.dumps({**res, **(mon.result or {})}), flush=True)
        return
    import msgspec

    from baton_bench.common import load_workload

    wl = load_workload(args.workload)
    if args.requests:
        wl = msgspec.structs.replace(wl, requests=wl.requests[: args.requests])
    if args.model == "tiny":
        from baton.testing.tiny_model import tiny_model

        args.model = str(tiny_model("llama"))
    results = []
    for name in args.configs.split(","):
        overrides = CONFIGS[name]
        runs: list[tuple[str, dict[str, Any]]] = []
        if overrides["executor"] == "uniproc":
            runs.append((name, dict(overrides)))
        else:
            if args.backend != "ray":
                for t in args.transports.split(","):
                    ov = {**overrides, f"executor.{overrides['executor']}": {"transport": t}}
                    runs.append((f"{name}/{t}", ov))
            if args.backend != "local":
                runs.append((f"{name}/ray", {**overrides, "executor": "ray"}))
        for label, ov in runs:
            res = bench(label, ov, wl, args.repeats, args.model)
            results.append(res)
            if not args.json:
                print(json.dumps(res, indent=1), flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
