#!/usr/bin/env python3
"""baton and vLLM's own CPU build on one workload, in alternating rounds, per dtype: the ratio.

    py=$(../shared/bench/vllm_cpu/setup.sh)             # once: vLLM CPU in its own venv
    .venv/bin/python ../shared/bench/save_hf_model.py /tmp/smollm2-hf   # once: the same weights
    .venv/bin/python plugins/bench/scripts/bench_vs_vllm.py --vllm-python "$py" --hf-model /tmp/smollm2-hf \\
        [--workload ../shared/bench/workload.json] [--dtype float32 --dtype bfloat16] [--rounds 3]

Each round runs, for each dtype, `baton bench throughput --json` (model.dtype = the dtype, 2
threads) and ``../shared/bench/vllm_cpu/bench.py`` (the same workload: all requests at once,
greedy, exact lengths), the side that goes first alternating between rounds, each a fresh
process timing one pass after its warm-up. Prints one JSON line per run, then a summary line
per dtype: the medians, their ratio, the rounds' ratios and each side's output digests (baton's
must not move between rounds; vLLM's bfloat16 does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from baton_bench import peers
from baton_bench.common import default_bench_dir

VLLM_BENCH = default_bench_dir() / "vllm_cpu" / "bench.py"


def baton_run(workload: Path, dtype: str, threads: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "baton.cli.main",
        "bench",
        "throughput",
        "--json",
        "--repeats",
        "1",
        "--workload",
        str(workload),
        "--set",
        f"model.dtype={dtype}",
        "--set",
        f"executor.num_threads={threads}",
    ]
    return _one(cmd, "baton", lambda r: (r["tok_per_s"]["median"], r["outputs_sha256_16"]))


def vllm_run(python: str, workload: Path, model: str, dtype: str) -> dict[str, Any]:
    """vLLM CPU binds its OpenMP threads to the cores of the machine (2 here) by itself."""
    cmd = [python, str(VLLM_BENCH), str(workload), model, dtype, "--repeats", "1"]
    return _one(cmd, "vllm-cpu", lambda r: (r["tok_per_s"][-1], r["outputs_sha256_16"]))


def _one(cmd: list[str], engine: str, pick: Any) -> dict[str, Any]:
    out = peers.run_measured(cmd)
    lines = peers.json_lines(out["stdout"])
    if out["rc"] != 0 or not lines:
        raise SystemExit(f"{engine} failed (exit {out['rc']}): {out['stderr'][-2000:]}")
    tok_s, digest = pick(lines[-1])
    return {"engine": engine, "tok_per_s": tok_s, "digest": digest}


def summary(dtype: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of each side, their ratio, the per-round ratios and the digests seen."""
    ours = [r["tok_per_s"] for r in runs if r["engine"] == "baton"]
    theirs = [r["tok_per_s"] for r in runs if r["engine"] == "vllm-cpu"]
    return {
        "dtype": dtype,
        "baton_tok_per_s": ours,
        "vllm_tok_per_s": theirs,
        "ratio_of_medians": round(statistics.median(ours) / statistics.median(theirs), 3),
        "round_ratios": [round(a / b, 3) for a, b in zip(ours, theirs, strict=True)],
        "baton_digests": sorted({r["digest"] for r in runs if r["engine"] == "baton"}),
        "vllm_digests": sorted({r["digest"] for r in runs if r["engine"] == "vllm-cpu"}),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="the python of vllm_cpu/setup.sh's venv")
    ap.add_argument("--hf-model", required=True, help="an HF folder of the same weights")
    ap.add_argument("--workload", type=Path, default=default_bench_dir() / "workload.json")
    ap.add_argument("--dtype", action="append", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="baton's executor.num_threads")
    a = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {d: [] for d in a.dtype or ("float32", "bfloat16")}
    for i in range(a.rounds):
        for dtype, done in runs.items():
            sides = [
                lambda d=dtype: baton_run(a.workload, d, a.threads),
                lambda d=dtype: vllm_run(a.vllm_python, a.workload, a.hf_model, d),
            ]
            for side in sides if i % 2 == 0 else sides[::-1]:
                run = {"round": i, "dtype": dtype, **side()}
                print(json.dumps(run), flush=True)
                done.append(run)
    for dtype, done in runs.items():
        print(json.dumps({"summary": summary(dtype, done)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
