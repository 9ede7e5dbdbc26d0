"""Offline throughput on a chat workload: output tokens/s, peak RSS and the output digest.

Runs the workload's ``prompt_token_ids`` with greedy decoding and each request's
exact ``max_new_tokens`` (EOS ignored), through ``LLM.generate`` with the
configured engine. ``--repeats N`` runs it N times on one warm engine (prefix
cache reset between runs) and reports the median.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import msgspec

from baton.kernels.report import collect
from baton_bench.common import (
    CpuMonitor,
    children_peak_rss_mb,
    default_bench_dir,
    digest,
    dtype_config,
    emit,
    load_workload,
    peak_rss_mb,
    percentile,
    spec_figures,
    summarize,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from baton.cli import add_engine_arguments

    p.add_argument(
        "--workload",
        default=None,
        help="a chat-workload JSON (default: workload.json of ../shared/bench)",
    )
    p.add_argument("--num-requests", type=int, help="use only the first N requests")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--per-request", action="store_true", help="include each request's output token ids"
    )
    add_engine_arguments(p)


def run_throughput(
    llm: Any, workload_path: str, num_requests: int | None = None, repeats: int = 1
) -> dict[str, Any]:
    from baton import SamplingParams

    wl = load_workload(workload_path)
    reqs = wl.requests[:num_requests] if num_requests else wl.requests
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_new_tokens, ignore_eos=True) for r in reqs
    ]
    runs, outputs, monitors = [], None, []
    latencies: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        llm.reset_prefix_cache()
        itl = _InterTokenLatencies(llm)
        with CpuMonitor() as mon, itl:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
        monitors.append(mon.result)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append(
            {"wall_s": round(wall, 3), "output_tokens": n_out, "tok_per_s": round(n_out / wall, 2)}
        )
        outputs = [o.outputs[0].token_ids for o in outs]
        latencies = {**_latencies(outs), **_decode_figures(outs), **itl.percentiles()}
    assert outputs is not None
    tok_s = summarize(r["tok_per_s"] for r in runs)
    return {
        "bench": "throughput",
        "workload": str(workload_path),
        "num_requests": len(reqs),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
        "output_tokens": runs[-1]["output_tokens"],
        "tok_per_s": tok_s,
        "runs": runs,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "engine_children_peak_rss_mb": round(children_peak_rss_mb(), 1),
        "outputs_sha256_16": digest(outputs),
        "cpu": monitors,
        "expected_tokens_ok": all(
            len(o) == r.max_new_tokens for o, r in zip(outputs, reqs, strict=True)
        ),
        # of the last run: every request arrives at the start (what the scheduler simulator compares with)
        **latencies,
        "_outputs": outputs,
    }


class _InterTokenLatencies:
    """A stat logger hooked onto the LLM for one run: every inter-token latency (seconds)."""

    def __init__(self, llm: Any) -> None:
        self.loggers = getattr(getattr(llm, "stat_loggers", None), "loggers", None)
        self.values: list[float] = []

    def __enter__(self) -> _InterTokenLatencies:
        if self.loggers is not None:
            self.loggers.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.loggers is not None:
            self.loggers.remove(self)

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_index: int = 0) -> None:
        if iteration_stats is not None:
            self.values.extend(iteration_stats.inter_token_latencies)

    def log(self) -> None:
        pass

    def percentiles(self) -> dict[str, dict[str, float]]:
        if not self.values:
            return {}
        return {"itl_s": {f"p{q}": round(percentile(self.values, q), 4) for q in (50, 90, 99)}}


def _latencies(outs: list[Any]) -> dict[str, dict[str, float]]:
    """TTFT and e2e percentiles (seconds) from the RequestOutputs' metrics."""
    figures: dict[str, dict[str, float]] = {}
    for name in ("ttft", "e2e_latency"):
        values = [getattr(o.metrics, name) for o in outs if o.metrics is not None]
        values = [v for v in values if v is not None]
        if values:
            key = "ttft_s" if name == "ttft" else "e2e_s"
            figures[key] = {f"p{q}": round(percentile(values, q), 4) for q in (50, 90, 99)}
    return figures


def _decode_figures(outs: list[Any]) -> dict[str, Any]:
    """Decoding alone, each request's prefill left out: TPOT percentiles (seconds per output
    token after the first, from its first token to its last) and decode tokens/s (those tokens
    over those times, summed over the requests: the decode speed when requests run one at a time,
    as with ``--max-num-seqs 1``)."""
    tpots, tokens, seconds = [], 0, 0.0
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m is None or m.ttft is None or m.e2e_latency is None or n < 2:
            continue
        span = m.e2e_latency - m.ttft
        tpots.append(span / (n - 1))
        tokens, seconds = tokens + n - 1, seconds + span
    if not tpots or seconds <= 0:
        return {}
    return {
        "tpot_s": {f"p{q}": round(percentile(tpots, q), 5) for q in (50, 90, 99)},
        "decode_tok_per_s": round(tokens / seconds, 2),
    }


def main(args: argparse.Namespace) -> int:
    from baton import LLM
    from baton.cli import engine_overrides

    path = args.workload or str(default_bench_dir() / "workload.json")
    t0 = time.perf_counter()
    with LLM(config=args.config, **engine_overrides(args)) as llm:
        startup = time.perf_counter() - t0
        result = run_throughput(llm, path, args.num_requests, args.repeats)
        result["config"] = {
            "transport": llm.config.transport.name,
            "executor": llm.config.executor.backend,
            "tp": llm.config.executor.tensor_parallel_size,
            "pp": llm.config.executor.pipeline_parallel_size,
            "max_num_seqs": llm.config.scheduler.max_num_seqs,
            "max_num_batched_tokens": llm.config.scheduler.max_num_batched_tokens,
            "block_size": llm.config.cache.block_size,
            "cache_dtype": llm.config.cache.dtype,
            **dtype_config(llm),
        }
        stats = llm.get_stats()
        result["kv_blocks"] = stats.num_total_blocks
        result["speculative"] = spec_figures(llm)
        result["host"] = msgspec.to_builtins(collect())  # what the figures were measured on
    result["startup_s"] = round(startup, 2)
    outputs = result.pop("_outputs")
    if args.per_request:
        result["outputs"] = outputs
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(prog="baton bench throughput")
    parser.add_argument("--config")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
