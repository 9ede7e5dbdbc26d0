"""``baton bench serve``: HTTP load on a real server (tiny model), its goodput, and the bench
registry it joins."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from baton import hookimpl
from baton.cli.main import main as baton_main
from baton.plugins.registry import get_plugins, get_registry
from baton_bench.serve import RequestRecord, arrival_offsets, goodput, slo_fields

from .conftest import engine_children


def write_workload(path: Path, n: int = 6) -> Path:
    """A chat-workload of n short requests (messages for chat, token ids for completions)."""
    reqs = [
        {
            "id": f"r{i}",
            "messages": [{"role": "user", "content": f"count to {i + 3}"}],
            "prompt_token_ids": [1, 2, 3 + i, 4, 5],
            "max_new_tokens": 4 + i,
        }
        for i in range(n)
    ]
    path.write_text(json.dumps({"format": "chat-workload/v1", "requests": reqs}))
    return path


def run_bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = baton_main(["bench", "serve", "--json", *argv])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_request_completes_with_its_token_count(server, tmp_path, capsys, endpoint):
    wl = write_workload(tmp_path / "wl.json")
    code, res = run_bench(
        ["--base-url", server.url, "--workload", str(wl), "--endpoint", endpoint], capsys
    )
    assert code == 0, res
    assert res["requests"] == res["completed"] == 6 and res["num_errors"] == 0
    assert res["wrong_token_counts"] == []
    assert res["output_tokens"] == sum(4 + i for i in range(6))
    assert res["tok_per_s"] > 0 and res["request_per_s"] > 0
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert set(res[key]) == {"p50", "p90", "p99", "mean"}, key
        assert 0 < res[key]["p50"] <= res[key]["p99"], key
    assert res["ttft_s"]["p50"] <= res["e2e_s"]["p50"]
    assert res["request_rate"] == "inf" and res["cpu"]["others_cpu_frac"] >= 0


def test_rate_and_concurrency_limit_shape_the_run(server, tmp_path, capsys):
    """4 requests at 20/s, one at a time: they cannot overlap, so the run takes at least the
    sum of their end-to-end times, and the arrivals are the seeded Poisson offsets."""
    wl = write_workload(tmp_path / "wl.json", n=4)
    code, res = run_bench(
        [
            "--base-url",
            server.url,
            "--workload",
            str(wl),
            "--request-rate",
            "20",
            "--max-concurrency",
            "1",
            "--per-request",
        ],
        capsys,
    )
    assert code == 0 and res["completed"] == 4 and res["max_concurrency"] == 1
    e2e = [r["e2e_s"] for r in res["per_request"]]
    assert res["duration_s"] >= sum(e2e) * 0.999
    assert res["duration_s"] >= arrival_offsets(4, 20.0, 0)[-1]


def test_arrivals_are_a_seeded_poisson_process():
    assert arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    a, b = arrival_offsets(2000, 50.0, 7), arrival_offsets(2000, 50.0, 7)
    assert a == b and a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 50.0, rel=0.1)
    assert arrival_offsets(2000, 50.0, 8) != a
    with pytest.raises(Exception, match="request-rate"):
        arrival_offsets(3, 0.0, 0)


def test_failed_requests_are_counted_and_fail_the_command(server, tmp_path, capsys):
    wl = write_workload(tmp_path / "wl.json", n=3)
    # the warm-up request fails first: an unknown model is refused before any load
    code = baton_main(
        [
            "bench",
            "serve",
            "--json",
            "--base-url",
            server.url,
            "--workload",
            str(wl),
            "--model-name",
            "no-such-model",
        ]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "warm-up request" in err and "404" in err and "--model-name" in err
    # a request the server refuses (its prompt is too long for max_model_len) is an error
    reqs = json.loads(wl.read_text())
    reqs["requests"][1]["max_new_tokens"] = 10**6
    wl.write_text(json.dumps(reqs))
    code, res = run_bench(["--base-url", server.url, "--workload", str(wl)], capsys)
    assert code == 1
    assert res["completed"] == 2 and res["num_errors"] == 1
    assert res["errors"][0].startswith("r1: HTTP 400")


def test_starts_and_stops_its_own_server(model_dir, tmp_path, capsys):
    """Without --base-url: `baton serve` in a subprocess with the engine flags given here."""
    wl = write_workload(tmp_path / "wl.json", n=3)
    code, res = run_bench(
        ["--workload", str(wl), "--model", model_dir, "--set", "model.max_model_len=512"], capsys
    )
    assert code == 0, res
    assert res["completed"] == 3 and res["server_exit_code"] == 0
    assert res["base_url"].startswith("http://127.0.0.1:")
    assert not engine_children()


class EchoBench:
    """A third party's benchmark: registered through register_benches."""

    BATON_PLUGIN_API = 1

    @staticmethod
    def factory(parser: argparse.ArgumentParser) -> Any:
        """Echo a number (a plugin's benchmark)."""
        parser.add_argument("--n", type=int, required=True)

        def run(args: argparse.Namespace) -> int:
            print(json.dumps({"bench": "echo", "n": args.n}))
            return 0

        return run

    @hookimpl
    def register_benches(self, register: Any) -> None:
        register("echo", self.factory)


def test_hook_register_benches(capsys):
    get_plugins().register(EchoBench(), "echo-bench", "baton-contrib-echo", "0.1")
    try:
        names = {e.name: e.distribution for e in get_registry().of_kind("bench")}
        assert names["echo"] == "baton-contrib-echo"
        for name in ("scheduler", "simulate", "transport", "throughput", "latency", "serve"):
            assert names[name] == "baton-bench", name
        assert baton_main(["bench", "echo", "--n", "7"]) == 0
        assert json.loads(capsys.readouterr().out) == {"bench": "echo", "n": 7}
        with pytest.raises(SystemExit):
            baton_main(["bench", "--help"])
        assert "Echo a number" in capsys.readouterr().out
    finally:
        get_plugins().unregister("echo-bench")


def test_bench_serve_goodput_counts_requests_meeting_every_target():
    slo = slo_fields(500.0, 50.0)
    assert slo == {"slo_ttft_ms": 500.0, "slo_tpot_ms": 50.0}
    records = [
        RequestRecord(id="ok", expected_tokens=5, output_tokens=5, ttft_s=0.4, e2e_s=0.6),
        RequestRecord(id="slow-first", expected_tokens=5, output_tokens=5, ttft_s=0.6, e2e_s=0.7),
        RequestRecord(id="slow-rest", expected_tokens=5, output_tokens=5, ttft_s=0.1, e2e_s=0.4),
        RequestRecord(id="failed", expected_tokens=5, error="HTTP 500"),
    ]
    g = goodput(records, 2.0, slo)
    assert (g["met"], g["attainment"], g["goodput_req_s"]) == (1, 0.25, 0.5)
    assert slo_fields(None, None) == {}
