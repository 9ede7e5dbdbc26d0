"""The scheduler simulator: cost model, workload generator, replay, figures, and the command line."""

from __future__ import annotations

import argparse
import json

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.request import Request
from baton.sampling_params import SamplingParams
from baton.sched.cost_model import DEFAULT, CostModel, step_features
from baton_bench import scheduler as bench
from baton_bench import simulate as simulate_cli
from baton_bench.calibrate import aggregate, fit
from baton_bench.common import WorkloadRequest, load_workload
from baton_bench.cost_files import load_cost_model, save_cost_model
from baton_bench.simulator import figures, simulate, table
from baton_bench.workloads import bursty_two_tenant, poisson, write_workload

COST = CostModel(step_overhead_s=0.05, prefill_s_per_token=0.001, decode_s_per_token=0.002)


def _small_bursty(seed: int = 0) -> list[WorkloadRequest]:
    return bursty_two_tenant(
        seed=seed, duration_s=60.0, burst_every_s=30.0, burst_size=24, interactive_rate=0.5
    ).requests


def _cfg(**kw) -> BatonConfig:
    return BatonConfig.load(max_num_seqs=16, max_num_batched_tokens=512, **kw)


def test_generator_is_deterministic_bursty_and_two_tenant():
    a, b = _small_bursty(1), _small_bursty(1)
    assert a == b and a != _small_bursty(2)
    assert {w.user for w in a} == {"interactive", "batch"}
    times = [w.arrival_time for w in a]
    assert times == sorted(times) and len({w.id for w in a}) == len(a)
    batch = [w.arrival_time for w in a if w.user == "batch"]
    assert batch[23] - batch[0] <= 1.0  # a burst arrives within a second


def test_write_and_load_workload_round_trip(tmp_path):
    wl = bursty_two_tenant(seed=3, duration_s=20.0, burst_every_s=10.0, burst_size=4)
    path = tmp_path / "wl.json"
    write_workload(wl, path)
    back = load_workload(path)
    assert back.format == "chat-workload/v1" and back.requests == wl.requests


def test_cost_model_from_the_command_line_and_a_file(tmp_path):
    m = load_cost_model("overhead=0.1,prefill=0.002,decode=0.003,num_blocks=100")
    assert (m.step_overhead_s, m.prefill_s_per_token, m.decode_s_per_token, m.num_blocks) == (
        0.1,
        0.002,
        0.003,
        100,
    )
    assert m.step_cost(10, 2, 0) == pytest.approx(0.1 + 0.02 + 0.006)
    save_cost_model(m, tmp_path / "c.json")
    assert load_cost_model(str(tmp_path / "c.json")) == m
    with pytest.raises(ConfigError, match="unknown field 'speed'"):
        load_cost_model("speed=3")
    with pytest.raises(ConfigError, match="no such file"):
        load_cost_model(str(tmp_path / "missing.json"))


def test_step_features_split_prefill_decode_and_count_attention_pairs():
    def req(rid, prompt, out, computed):
        r = Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=50))
        r.all_token_ids.extend([5] * out)
        r.num_computed_tokens = computed
        return r

    reqs = {"p": req("p", 20, 0, 8), "d": req("d", 10, 3, 13), "r": req("r", 10, 3, 13)}
    # p: a chunk of 8 prompt tokens from 0; d: one decode at position 12; r: resumed, 13 recomputed
    feats = step_features(reqs, {"p": 8, "d": 1, "r": 13})
    assert feats == (8 + 13, 1, (8 * 9 // 2) + (12 + 1) + (13 * 14 // 2))


def test_fit_recovers_known_coefficients():
    truth = CostModel(
        step_overhead_s=0.07,
        prefill_s_per_token=0.003,
        decode_s_per_token=0.004,
        attention_s_per_token_pair=1e-7,
    )
    shapes = [
        (48, 0, 1176),
        (384, 0, 20000),
        (2048, 0, 99328),
        (0, 1, 60),
        (0, 16, 2600),
        (0, 64, 9000),
        (512, 12, 40000),
        (0, 4, 400),
    ]
    samples = [(f, truth.step_cost(*f)) for f in shapes for _ in range(3)]
    samples.append(((0, 1, 60), 5.0))  # one outlier: the median per shape ignores it
    model, quality = fit(aggregate(samples))
    assert model.step_overhead_s == pytest.approx(0.07, rel=1e-3)
    assert model.prefill_s_per_token == pytest.approx(0.003, rel=1e-3)
    assert model.decode_s_per_token == pytest.approx(0.004, rel=1e-3)
    assert quality["rel_err_max"] < 1e-3


def test_replay_loses_nothing_and_is_deterministic_for_a_seed():
    wl = _small_bursty()
    runs = [figures(simulate(wl, _cfg(), "fcfs", COST, 4096, seed=5, noise=0.1)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0] != figures(simulate(wl, _cfg(), "fcfs", COST, 4096, seed=6, noise=0.1))
    f = runs[0]
    assert f["requests"] == len(wl) and f["output_tokens"] == sum(w.max_new_tokens for w in wl)
    assert 0 < f["ttft_s_p50"] <= f["e2e_s_p50"] and f["itl_s_p50"] > 0
    assert set(f["per_tenant"]) == {"interactive", "batch"}
    assert f["duration_s"] >= max(w.arrival_time for w in wl) - min(w.arrival_time for w in wl)


def test_policies_differ_where_they_should():
    wl = _small_bursty()
    cfg = _cfg()
    res = {
        p: figures(simulate(wl, cfg.replace(policy=p), p, COST, 4096))
        for p in ("fcfs", "fair", "sjf")
    }
    inter = {p: r["per_tenant"]["interactive"] for p, r in res.items()}
    # behind a burst, fcfs makes interactive requests wait; fair share and sjf do not
    assert inter["fair"]["queue_s_max"] < inter["fcfs"]["queue_s_max"] / 2
    assert inter["sjf"]["ttft_s_p90"] < inter["fcfs"]["ttft_s_p90"]
    assert len({r["output_tokens"] for r in res.values()}) == 1
    text = table(res)
    assert "fcfs" in text and "[interactive]" in text and "TTFT p99 s" in text


def test_tight_memory_preempts_in_the_simulator():
    wl = _small_bursty()
    f = figures(simulate(wl, _cfg(), "fcfs", COST, 80, check=True))
    assert f["preemptions"] > 0 and f["output_tokens"] == sum(w.max_new_tokens for w in wl)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_side_by_side_json_and_saved_workload(capsys, tmp_path):
    saved = tmp_path / "bursty.json"
    args = _args(
        "--policy",
        "fcfs,fair,sjf",
        "--workload",
        "bursty-two-tenant",
        "--num-requests",
        "60",
        "--cost-model",
        "overhead=0.05,prefill=0.001,decode=0.002",
        "--save-workload",
        str(saved),
        "--max-num-seqs",
        "16",
        "--json",
    )
    assert bench.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["policies"]) == ["fcfs", "fair", "sjf"] and out["config"]["max_num_seqs"] == 16
    assert all(p["requests"] == 60 for p in out["policies"].values())
    assert len(load_workload(saved).requests) == 60
    again = _args(
        "--policy",
        "fcfs",
        "--workload",
        str(saved),
        "--max-num-seqs",
        "16",
        "--cost-model",
        "overhead=0.05,prefill=0.001,decode=0.002",
        "--json",
    )
    assert bench.main(again) == 0
    assert json.loads(capsys.readouterr().out)["policies"]["fcfs"] == out["policies"]["fcfs"]


def test_cli_table(capsys):
    assert (
        bench.main(
            _args("--policy", "fcfs,sjf", "--workload", "bursty-two-tenant", "--num-requests", "30")
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "scheduler simulator" in text and "built-in default" in text and "sjf" in text


def test_overhead_bench_compares_policies(capsys):
    args = _args(
        "--json",
        "--num-requests",
        "20",
        "--output-len",
        "4",
        "--variant",
        "default",
        "--policy",
        "fcfs,priority",
    )
    assert bench.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == {"fcfs", "priority"}
    assert out["policies"]["priority"]["default"]["policy"] == "priority"


def test_compare_real_reports_the_error(capsys, tmp_path):
    real = tmp_path / "real.json"
    real.write_text(json.dumps({"ttft_s": {"p50": 2.0}, "tok_per_s": {"median": 50.0}}))
    args = _args(
        "--policy",
        "fcfs",
        "--workload",
        "bursty-two-tenant",
        "--num-requests",
        "20",
        "--cost-model",
        "overhead=0.05,prefill=0.001,decode=0.002",
        "--compare-real",
        str(real),
        "--json",
    )
    assert bench.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    sim, cmp = out["policies"]["fcfs"], out["comparison"]
    assert cmp["ttft_s_p50"]["real"] == 2.0 and cmp["ttft_s_p50"]["simulated"] == sim["ttft_s_p50"]
    assert cmp["throughput_tok_s"]["error_pct"] == pytest.approx(
        100 * (sim["throughput_tok_s"] - 50) / 50, abs=0.01
    )


def test_simulate_reports_goodput_and_recomputed_tokens_per_policy(capsys):
    p = argparse.ArgumentParser()
    simulate_cli.add_arguments(p)
    args = p.parse_args(
        [
            "--policy",
            "fcfs,slo",
            "--arrival-rate",
            "2",
            "--num-requests",
            "40",
            "--slo-ttft-ms",
            "3000",
            "--slo-tpot-ms",
            "500",
            "--num-blocks",
            "120",
            "--max-num-seqs",
            "16",
            "--json",
        ]
    )
    assert args.workload == "poisson"
    assert simulate_cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["slo_ttft_ms"] == 3000 and out["config"]["slo_tpot_ms"] == 500
    for f in out["policies"].values():
        assert f["requests"] == f["slo_requests"] == 40
        assert 0 <= f["slo_met"] <= 40 and f["slo_attainment"] == round(f["slo_met"] / 40, 4)
        assert f["preemptions"] > 0 and f["recomputed_tokens"] > 0  # 120 blocks: churn


def test_slo_beats_fcfs_on_goodput_under_overload_in_the_simulator():
    wl = poisson(seed=3, rate=0.73, duration_s=120.0).requests
    cfg = BatonConfig.load(max_num_seqs=64, max_num_batched_tokens=2048)
    met = {}
    for policy in ("fcfs", "slo"):
        f = figures(
            simulate(
                wl,
                cfg.replace(policy=policy),
                policy,
                DEFAULT,
                8192,
                slo_ttft_ms=5000,
                slo_tpot_ms=1000,
            )
        )
        assert f["slo_requests"] == len(wl)
        met[policy] = f["slo_met"]
    assert met["slo"] > met["fcfs"], met
