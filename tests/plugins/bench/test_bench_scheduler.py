"""`baton bench scheduler` on a small workload: figures present, deterministic, preemptions when tight."""

from __future__ import annotations

import argparse
import json

from baton.config import BatonConfig
from baton_bench import scheduler as bench


def _cfg(**kw):
    return BatonConfig.load(block_size=16, max_num_seqs=32, max_num_batched_tokens=1024, **kw)


def test_workload_is_deterministic_with_shared_prefixes():
    a = bench.make_workload(50, seed=1, output_len=8)
    assert a == bench.make_workload(50, seed=1, output_len=8) and a != bench.make_workload(
        50, seed=2
    )
    assert all(64 <= len(w.prompt_token_ids) <= 512 and w.max_new_tokens == 8 for w in a)
    heads = [tuple(w.prompt_token_ids[:32]) for w in a]
    assert len(set(heads)) < len(heads)  # some requests share a prefix


def test_tight_memory_preempts_and_loses_nothing():
    wl = bench.make_workload(60, seed=0, output_len=16)
    roomy = bench.run_scheduler_bench(wl, _cfg(), 4096)
    tight = bench.run_scheduler_bench(wl, _cfg(), 256)
    assert roomy["num_preemptions"] == 0 and tight["num_preemptions"] > 0
    assert roomy["output_tokens"] == tight["output_tokens"] == 60 * 16
    assert roomy["prefix_cache_hit_rate"] > 0 and roomy["max_running"] == 32
    again = bench.run_scheduler_bench(wl, _cfg(), 256)
    assert (again["steps"], again["num_preemptions"]) == (tight["steps"], tight["num_preemptions"])


def test_simulated_clock_with_arrivals_and_cost_model():
    wl = bench.make_workload(20, seed=0, output_len=4, arrival_rate=50.0)
    out = bench.run_scheduler_bench(
        wl,
        _cfg(policy="priority"),
        2048,
        executor_settings={"decode_s_per_token": 1e-3, "latency_s": 1e-3},
    )
    sim = out["simulated"]
    assert (
        sim["duration_s"] >= wl[-1].arrival_time and 0 < sim["ttft_s_median"] <= sim["e2e_s_median"]
    )


def test_main_prints_one_json_object(capsys):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(
        [
            "--json",
            "--num-requests",
            "30",
            "--output-len",
            "4",
            "--tight-num-blocks",
            "128",
            "--max-num-seqs",
            "16",
        ]
    )
    assert bench.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bench"] == "scheduler"
    for variant in ("default", "tight"):
        assert result[variant]["output_tokens"] == 30 * 4
        assert result[variant]["step_ms_median"] > 0
