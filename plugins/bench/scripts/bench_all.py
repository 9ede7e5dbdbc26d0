#!/usr/bin/env python3
"""`make bench`: baton's benchmarks side by side with transformers and llama.cpp, in one run.

Runs, back to back on the same machine (2 threads everywhere):

- the workload, all requests at once: `baton bench throughput` with
  model.quantization auto and none, llama-server with 64 slots driven by
  ../shared/bench/llamacpp/server_bench.py, transformers' static batch and
  (not with BENCH_QUICK=1) its continuous batching (../shared/bench/hf_baselines.py);
- batch 1 (~100-token prompt): `baton bench latency` (auto and none),
  llama-bench pp100 / tg128 (../shared/bench/llamacpp/batch1.sh), transformers;
- the scheduler and transport benches.

llama.cpp runs when its binaries are built (../shared/bench/llamacpp/build.sh;
$LLAMACPP_HOME, default ~/.cache/baton-peers/llama.cpp): otherwise a note says
it was skipped. llama.cpp runs the default model's own GGUF (Q4_1), baton the
same weights. Prints one JSON line per run, then a table of the figures with
the ratios baton / llama.cpp and baton / transformers and issue 12's targets;
everything goes to .bench/last.json. BENCH_REPEATS (default 3) repeats per
figure (medians), BENCH_QUICK=1 uses workload_small.json. BATON_BENCH_DIR
points at the shared bench folder.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from baton.model.loader import alias_gguf, resolve_model
from baton_bench import peers
from baton_bench.common import default_bench_dir

REPEATS = os.environ.get("BENCH_REPEATS", "3")
THREADS = "2"
MODEL = "smollm2-135m-instruct"
BATON = [sys.executable, "-m", "baton.cli.main"]


def run(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one bench command; its last JSON line, with the peak RSS of its process tree."""
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    out = peers.run_measured(cmd, env)
    rows = peers.json_lines(out["stdout"])
    if out["rc"] != 0 or not rows:
        print(out["stderr"][-4000:], file=sys.stderr)
        return {"error": f"exit {out['rc']}", "cmd": cmd}
    result = {**rows[-1], "tree_peak_rss_mb": out["tree_peak_rss_mb"]}
    print(json.dumps(result), flush=True)
    return result


def baton_settings(mode: str) -> list[str]:
    return ["--set", f"model.quantization={mode}", "--set", f"executor.num_threads={THREADS}"]


def baton_throughput(workload: str, mode: str) -> dict[str, Any]:
    return run(
        [
            *BATON,
            "bench",
            "throughput",
            "--json",
            "--workload",
            workload,
            "--repeats",
            REPEATS,
            *baton_settings(mode),
        ]
    )


def baton_latency(workload: str, mode: str) -> dict[str, Any]:
    return run(
        [
            *BATON,
            "bench",
            "latency",
            "--json",
            "--workload",
            workload,
            "--repeats",
            REPEATS,
            "--prompt-len",
            "100",
            "--decode-tokens",
            "128",
            *baton_settings(mode),
        ]
    )


def hf_command(bench: Path, workload: str) -> list[str]:
    model_dir = str(resolve_model(MODEL))
    return [
        sys.executable,
        str(bench / "hf_baselines.py"),
        "--workload",
        workload,
        "--model-dir",
        model_dir,
        "--threads",
        THREADS,
    ]


def llamacpp_batch1(bench: Path, gguf: Path) -> dict[str, Any]:
    """llama-bench pp100 / tg128 on 2 threads (its own 5 repetitions; medians)."""
    cmd = ["bash", str(bench / "llamacpp" / "batch1.sh"), str(gguf), THREADS]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    out = peers.run_measured(cmd)
    if out["rc"] != 0:
        print(out["stderr"][-4000:], file=sys.stderr)
        return {"error": f"exit {out['rc']}", "cmd": cmd}
    result = {**peers.parse_llama_bench(out["stdout"]), "tree_peak_rss_mb": out["tree_peak_rss_mb"]}
    print(json.dumps(result), flush=True)
    return result


def llamacpp_server(bench: Path, bin_dir: Path, gguf: Path, workload: str) -> dict[str, Any]:
    """llama-server with 64 slots, started for this run, on the whole workload at once."""
    port = peers.free_port()
    server_cmd = peers.server_command(bin_dir, gguf, port, int(THREADS))
    print("$", " ".join(server_cmd), "&", file=sys.stderr, flush=True)
    Path(".bench").mkdir(exist_ok=True)
    client = [sys.executable, str(bench / "llamacpp" / "server_bench.py"), "--port", str(port)]
    client += ["--workload", workload, "--repeats", REPEATS, "--label", "llama-server"]
    try:
        with peers.Server(server_cmd, port, log_path=Path(".bench/llama-server.log")) as server:
            print("$", " ".join(client), file=sys.stderr, flush=True)
            out = peers.run_measured(client)
    except (RuntimeError, TimeoutError) as e:
        print(f"llama-server: {e} (log: .bench/llama-server.log)", file=sys.stderr)
        return {"error": str(e), "cmd": server_cmd}
    if out["rc"] != 0:
        print(out["stderr"][-4000:], file=sys.stderr)
        return {"error": f"exit {out['rc']}", "cmd": client}
    result = {**peers.parse_server_bench(out["stdout"]), "peak_rss_mb": server.peak_rss_mb}
    print(json.dumps(result), flush=True)
    return result


def llamacpp_bin_dir() -> Path | None:
    bin_dir = peers.llamacpp_bin_dir()
    if bin_dir is None:
        print(
            f"note: llama.cpp skipped: no llama-bench / llama-server in "
            f"{peers.llamacpp_home()}/build-tools/bin (build them with "
            "../shared/bench/llamacpp/build.sh, or set LLAMACPP_HOME)",
            file=sys.stderr,
            flush=True,
        )
    return bin_dir


def print_summary(results: dict[str, Any], workload: str) -> None:
    rows = peers.side_by_side_rows(results)
    print(f"\n== side by side (medians; workload {Path(workload).name}; {THREADS} threads) ==")
    print(peers.format_side_by_side(rows))
    print("\n== issue 12 targets, baton model.quantization=auto ==")
    for what, ok in peers.targets(rows, "auto"):
        print(f"{what}: {'no figure' if ok is None else 'met' if ok else 'NOT met'}")
    cont = results.get("hf_continuous", {}).get("tok_per_s")
    for mode in peers.MODES:
        b = results.get(f"baton_throughput_{mode}", {}).get("tok_per_s", {}).get("median")
        if b and cont:
            print(f"baton {mode} / transformers continuous batching: {b / cont:.2f}x")
    digests = {
        "baton auto": results.get("baton_throughput_auto", {}).get("outputs_sha256_16"),
        "baton none": results.get("baton_throughput_none", {}).get("outputs_sha256_16"),
        "transformers": results.get("hf_static", {}).get("runs", [{}])[-1].get("outputs_sha256_16"),
        "llama.cpp (Q4_1 in its own kernels)": ",".join(
            d for d in results.get("llamacpp_server", {}).get("digests", []) if d
        )
        or None,
    }
    print("digests: " + ", ".join(f"{k} {v}" for k, v in digests.items()))


def main() -> int:
    bench = default_bench_dir()
    quick = os.environ.get("BENCH_QUICK") == "1"
    workload = str(bench / ("workload_small.json" if quick else "workload.json"))
    gguf = alias_gguf(MODEL)
    bin_dir = llamacpp_bin_dir()
    hf = hf_command(bench, workload)
    results: dict[str, Any] = {}
    for mode in peers.MODES:
        results[f"baton_throughput_{mode}"] = baton_throughput(workload, mode)
    if bin_dir is not None:
        results["llamacpp_server"] = llamacpp_server(bench, bin_dir, gguf, workload)
    results["hf_static"] = run([*hf, "--mode", "generate-static", "--repeats", REPEATS])
    if not quick:
        results["hf_continuous"] = run([*hf, "--mode", "continuous", "--repeats", "1"])
    for mode in peers.MODES:
        results[f"baton_latency_{mode}"] = baton_latency(workload, mode)
    if bin_dir is not None:
        results["llamacpp_batch1"] = llamacpp_batch1(bench, gguf)
    results["hf_latency"] = run([*hf, "--mode", "latency", "--repeats", REPEATS])
    results["scheduler"] = run([*BATON, "bench", "scheduler", "--json"])
    results["transport"] = run([*BATON, "bench", "transport", "--json"])
    print_summary(results, workload)
    Path(".bench").mkdir(exist_ok=True)
    Path(".bench/last.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
