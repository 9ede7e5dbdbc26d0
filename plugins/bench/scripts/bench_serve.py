"""Load benchmark of `baton serve` against the offline LLM on the same chat workload.

Each repeat: start `baton serve` (zmq transport by default, the default model),
send every request of the workload at once as a streaming chat completion
(its ``messages``, ``max_tokens`` = its ``max_new_tokens``, temperature 0,
``ignore_eos``; the load of ``baton bench serve``), check that each one
completes with exactly its token count and no error, stop the server; then run
``baton bench throughput --workload ... --json`` (the offline LLM) back to
back. Reports TTFT p50/p99, inter-token latency p50/p99 and output tokens/s
of both, the median over repeats, and how much CPU other processes took
meanwhile (others_cpu_frac: the machine is shared).

    .venv/bin/python plugins/bench/scripts/bench_serve.py [--repeats 2] [--json] [--model M] [--transport zmq]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from baton_bench.common import load_workload
from baton_bench.serve import SERVED_NAME, ServeProcess, run_load
from baton_bench.serve import summarize as summarize_load

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_WORKLOAD = ROOT.parent / "shared" / "bench" / "workload.json"


class TreeCpu:
    """CPU of the whole machine vs. of the processes we own (this one, the server and its engines)."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = [psutil.Process(p) for p in pids]

    def _owned(self) -> dict[int, float]:
        """CPU seconds per owned process (this one, the server, and their children)."""
        out: dict[int, float] = {}
        for p in self.procs:
            for q in [p, *p.children(recursive=True)]:
                if q.pid not in out:
                    try:
                        t = q.cpu_times()
                        out[q.pid] = t.user + t.system
                    except psutil.NoSuchProcess:
                        pass
        return out

    def __enter__(self) -> TreeCpu:
        self.t0 = time.monotonic()
        self.machine0 = psutil.cpu_times()
        self.owned0 = self._owned()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self.t0
        m1 = psutil.cpu_times()
        busy = sum(
            getattr(m1, f) - getattr(self.machine0, f)
            for f in ("user", "nice", "system", "irq", "softirq")
        )
        owned1 = self._owned()
        per_proc = {pid: owned1[pid] - self.owned0.get(pid, 0.0) for pid in owned1}
        owned = sum(per_proc.values())
        cpus = psutil.cpu_count() or 1
        client, server = self.procs[0].pid, self.procs[1].pid if len(self.procs) > 1 else None
        self.result = {
            "others_cpu_frac": round(max(0.0, busy - owned) / (wall * cpus), 3),
            "self_cpu_frac": round(owned / (wall * cpus), 3),
            # CPU seconds: the benchmark client, the server's frontend, its engine process(es)
            "client_cpu_s": round(per_proc.get(client, 0.0), 1),
            "frontend_cpu_s": round(per_proc.get(server, 0.0), 1) if server else None,
            "engine_cpu_s": round(
                sum(v for pid, v in per_proc.items() if pid not in (client, server)), 1
            ),
            "wall_s": round(wall, 1),
            "loadavg_1m": os.getloadavg()[0],
        }


def run_server(args: argparse.Namespace, requests: list[Any]) -> dict[str, Any]:
    """One `baton bench serve` run: the server started and stopped by baton_bench.serve."""
    argv = ["--transport", args.transport]
    if args.model:
        argv += ["--model", args.model]
    if args.config:
        argv += ["--config", args.config]
    serve = ServeProcess(argv)
    try:
        with TreeCpu([os.getpid(), serve.proc.pid]) as cpu:
            records, wall = asyncio.run(run_load(serve.url or "", requests, model=SERVED_NAME))
    finally:
        code = serve.stop()
    return {**summarize_load(records, wall), "cpu": cpu.result, "server_exit_code": code}


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "baton.cli.main",
        "bench",
        "throughput",
        "--workload",
        str(args.workload),
        "--json",
    ]
    if args.model:
        cmd += ["--model", args.model]
    if args.config:
        cmd += ["--config", args.config]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"offline bench failed:\n{proc.stderr[-3000:]}")
    d = json.loads(proc.stdout)
    return {
        "output_tokens": d["output_tokens"],
        "tok_per_s": d["tok_per_s"]["median"],
        "ttft_s": {k: d.get("ttft_s", {}).get(k) for k in ("p50", "p99")},
        "itl_s": {k: d.get("itl_s", {}).get(k) for k in ("p50", "p99")},
        "expected_tokens_ok": d["expected_tokens_ok"],
        "cpu": d["cpu"][-1] if d.get("cpu") else None,
        "transport": d.get("config", {}).get("transport"),
    }


def _median(runs: list[dict[str, Any]], *path: str) -> float | None:
    values = []
    for r in runs:
        v: Any = r
        for key in path:
            v = v.get(key) if isinstance(v, dict) else None
        if isinstance(v, int | float):
            values.append(float(v))
    return round(statistics.median(values), 4) if values else None


#: Runs where other processes took more of the CPU than this are contaminated (../shared/bench/README.md).
CLEAN_OTHERS_CPU_FRAC = 0.05


def _clean(run: dict[str, Any] | None) -> bool:
    return bool(run and run.get("cpu") and run["cpu"]["others_cpu_frac"] <= CLEAN_OTHERS_CPU_FRAC)


def summarize(
    args: argparse.Namespace, server_runs: list[dict[str, Any]], offline_runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """Medians over the clean (server, offline) pairs when there are any, else over every run."""
    offline: list[dict[str, Any] | None] = list(offline_runs) or [None] * len(server_runs)
    pairs = list(zip(server_runs, offline, strict=True))
    clean = [(s, o) for s, o in pairs if _clean(s) and (o is None or _clean(o))]
    used = clean or pairs
    summary: dict[str, Any] = {
        "workload": str(args.workload),
        "repeats": len(pairs),
        "transport": args.transport,
        "medians_over": f"{len(clean)} clean pair(s)"
        if clean
        else f"all {len(pairs)} runs (none clean)",
    }
    for name, runs in (
        ("server", [s for s, _ in used]),
        ("offline", [o for _, o in used if o is not None]),
    ):
        if runs:
            summary[name] = {
                "tok_per_s": _median(runs, "tok_per_s"),
                "ttft_p50_s": _median(runs, "ttft_s", "p50"),
                "ttft_p99_s": _median(runs, "ttft_s", "p99"),
                "itl_p50_s": _median(runs, "itl_s", "p50"),
                "itl_p99_s": _median(runs, "itl_s", "p99"),
            }
    summary["others_cpu_frac"] = {
        "server": [r["cpu"]["others_cpu_frac"] if r.get("cpu") else None for r in server_runs],
        "offline": [r["cpu"]["others_cpu_frac"] if r.get("cpu") else None for r in offline_runs],
    }
    summary["all_requests_ok"] = all(
        not r["num_errors"] and not r["wrong_token_counts"] for r in server_runs
    )
    if "offline" in summary:
        ratio = summary["server"]["tok_per_s"] / summary["offline"]["tok_per_s"]
        summary["server_over_offline"] = round(ratio, 3)
        summary["within_15_percent"] = ratio >= 0.85
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--model", help="default: the config's model (smollm2-135m-instruct)")
    p.add_argument("--config", help="a baton.toml for both the server and the offline run")
    p.add_argument("--transport", default="zmq")
    p.add_argument("--repeats", type=int, default=1, help="server + offline pairs, back to back")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    requests = load_workload(args.workload).requests
    server_runs, offline_runs = [], []
    for i in range(args.repeats):
        server_runs.append(run_server(args, requests))
        print(f"[{i + 1}/{args.repeats}] server: {json.dumps(server_runs[-1])}", file=sys.stderr)
        if not args.skip_offline:
            offline_runs.append(run_offline(args))
            print(
                f"[{i + 1}/{args.repeats}] offline: {json.dumps(offline_runs[-1])}", file=sys.stderr
            )
    summary = summarize(args, server_runs, offline_runs)
    summary["runs"] = {"server": server_runs, "offline": offline_runs}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for k, v in summary.items():
            if k != "runs":
                print(f"{k}: {v}")
    return 0 if summary["all_requests_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
