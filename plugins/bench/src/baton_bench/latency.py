"""Batch-1 latency: time to first token (prefill) and per-token decode latency.

Picks the workload request whose prompt length is closest to ``--prompt-len``;
TTFT from requests with max_tokens=1, decode from a longer generation
(timestamps of the first and last token), medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import msgspec

from baton.kernels.report import collect
from baton_bench.common import (
    CpuMonitor,
    default_bench_dir,
    dtype_config,
    emit,
    load_workload,
    peak_rss_mb,
    spec_figures,
    summarize,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from baton.cli import add_engine_arguments

    p.add_argument("--workload", default=None)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    add_engine_arguments(p)


def run_latency(
    llm: Any, workload_path: str, prompt_len: int, decode_tokens: int, repeats: int
) -> dict[str, Any]:
    from baton import SamplingParams

    wl = load_workload(workload_path)
    req = min(wl.requests, key=lambda r: abs(len(r.prompt_token_ids) - prompt_len))
    prompt = {"prompt_token_ids": req.prompt_token_ids}
    llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )  # warm-up
    ttfts, decode_rates, monitors = [], [], []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        with CpuMonitor() as mon:
            t0 = time.perf_counter()
            llm.generate(
                prompt,
                SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                use_tqdm=False,
            )
            ttfts.append(time.perf_counter() - t0)
            llm.reset_prefix_cache()
            out = llm.generate(
                prompt,
                SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True),
                use_tqdm=False,
            )[0]
        monitors.append(mon.result)
        m = out.metrics
        assert m is not None and m.first_token_time is not None and m.last_token_time is not None
        decode_rates.append((decode_tokens - 1) / (m.last_token_time - m.first_token_time))
    dec = summarize(decode_rates)
    return {
        "bench": "latency",
        "prompt_tokens": len(req.prompt_token_ids),
        "ttft_ms": {k: round(v * 1000, 1) if k != "n" else v for k, v in summarize(ttfts).items()},
        "decode_tok_per_s": {k: round(v, 2) if k != "n" else v for k, v in dec.items()},
        "per_token_ms_median": round(1000 / dec["median"], 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "cpu": monitors,
    }


def main(args: argparse.Namespace) -> int:
    from baton import LLM
    from baton.cli import engine_overrides

    path = args.workload or str(default_bench_dir() / "workload.json")
    with LLM(config=args.config, **engine_overrides(args)) as llm:
        result = run_latency(llm, path, args.prompt_len, args.decode_tokens, args.repeats)
        result["config"] = {"cache_dtype": llm.config.cache.dtype, **dtype_config(llm)}
        result["speculative"] = spec_figures(llm)
        result["host"] = msgspec.to_builtins(collect())  # what the figures were measured on
        emit(result, args.json)
    return 0
