#!/usr/bin/env python3
"""`make bench`: baton's benchmarks side by side with the Hugging Face baselines, in one run.

Runs, back to back on the same machine: `baton bench throughput` on the shared
workload, transformers' static-batch generate and continuous batching on the
same workload (../shared/bench/hf_baselines.py), `baton bench latency` next to
the transformers batch-1 latency, and the scheduler and transport benches.
Prints one JSON line per run and a table of ratios. Set BATON_BENCH_DIR to
point at the shared bench folder; BENCH_QUICK=1 uses workload_small.json and
skips the slow continuous-batching baseline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from baton.bench.common import default_bench_dir
from baton.worker.model_loader import resolve_model

REPEATS = os.environ.get("BENCH_REPEATS", "3")


def run(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if out.returncode != 0:
        print(out.stderr[-4000:], file=sys.stderr)
        return {"error": f"exit {out.returncode}", "cmd": cmd}
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    print(line, flush=True)
    return json.loads(line)


def main() -> int:
    bench = default_bench_dir()
    quick = os.environ.get("BENCH_QUICK") == "1"
    workload = str(bench / ("workload_small.json" if quick else "workload.json"))
    model_dir = str(resolve_model("smollm2-135m-instruct"))
    baton = [sys.executable, "-m", "baton.cli.main"]
    hf = [
        sys.executable,
        str(bench / "hf_baselines.py"),
        "--workload",
        workload,
        "--model-dir",
        model_dir,
    ]
    results = {
        "baton_throughput": run(
            [*baton, "bench", "throughput", "--json", "--workload", workload, "--repeats", REPEATS]
        ),
        "hf_static": run([*hf, "--mode", "generate-static", "--repeats", REPEATS]),
    }
    if not quick:
        results["hf_continuous"] = run([*hf, "--mode", "continuous", "--repeats", "1"])
    results["baton_latency"] = run([*baton, "bench", "latency", "--json", "--workload", workload])
    results["hf_latency"] = run([*hf, "--mode", "latency", "--repeats", REPEATS])
    results["scheduler"] = run([*baton, "bench", "scheduler", "--json"])
    results["transport"] = run([*baton, "bench", "transport", "--json"])

    b = results["baton_throughput"].get("tok_per_s", {}).get("median")
    print("\n== summary (output tokens/s, medians) ==")
    for key in ("hf_static", "hf_continuous"):
        base = results.get(key, {}).get("tok_per_s")
        if b and base:
            print(f"baton {b:.1f} vs {key} {base:.1f}: {b / base:.2f}x")
    lat = results["baton_latency"].get("decode_tok_per_s", {}).get("median")
    hf_lat = results["hf_latency"].get("generate_decode_tok_per_s", {}).get("median")
    if lat and hf_lat:
        print(
            f"batch-1 decode: baton {lat:.1f} tok/s vs transformers {hf_lat:.1f} tok/s: {lat / hf_lat:.2f}x"
        )
    d = results["baton_throughput"].get("outputs_sha256_16")
    h = results["hf_static"].get("runs", [{}])[-1].get("outputs_sha256_16")
    print(
        f"digest: baton {d} vs transformers {h} ({'equal' if d == h else 'DIFFERENT: see the parity tests for near-ties'})"
    )
    Path(".bench").mkdir(exist_ok=True)
    Path(".bench/last.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
