"""The llama.cpp peer of `make bench`: finding its binaries, parsing its output, the side-by-side table.

No llama.cpp here: its outputs are written out by hand in the shape its tools print, and
a few lines of Python stand in for llama-server. Figures are never judged.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from baton_bench import peers

LLAMA_BENCH_JSONL = "\n".join(
    [
        "build: 0c1e570 (1) with cc for x86_64-linux-gnu",  # a stray non-JSON line
        json.dumps(
            {
                "build_commit": "0c1e570",
                "cpu_info": "AMD EPYC",
                "model_type": "llama ?B Q4_1",
                "n_threads": 2,
                "n_prompt": 100,
                "n_gen": 0,
                "avg_ns": 400_000_000,
                "avg_ts": 250.0,
                "samples_ns": [500_000_000, 400_000_000, 380_000_000],
                "samples_ts": [200.0, 250.0, 263.2],
            }
        ),
        json.dumps(
            {
                "build_commit": "0c1e570",
                "n_prompt": 0,
                "n_gen": 128,
                "avg_ns": 1_000_000_000,
                "avg_ts": 128.0,
                "samples_ns": [1_100_000_000, 1_000_000_000, 900_000_000],
                "samples_ts": [116.4, 128.0, 142.2],
            }
        ),
    ]
)


def test_parse_llama_bench_medians():
    r = peers.parse_llama_bench(LLAMA_BENCH_JSONL)
    assert r["pp_tokens"] == 100 and r["tg_tokens"] == 128
    assert r["pp_tok_per_s"] == {"median": 250.0, "min": 200.0, "max": 263.2, "n": 3}
    assert r["pp_ms"]["median"] == 400.0 and r["pp_ms"]["max"] == 500.0
    assert r["tg_tok_per_s"]["median"] == 128.0
    assert r["build_commit"] == "0c1e570" and r["n_threads"] == 2


def test_parse_llama_bench_without_samples_uses_averages():
    row = {"n_prompt": 0, "n_gen": 128, "avg_ns": 2_000_000_000, "avg_ts": 64.0}
    assert peers.parse_llama_bench(json.dumps(row))["tg_tok_per_s"]["median"] == 64.0


def test_parse_server_bench():
    runs = [
        {"kind": "run", "rep": i, "wall_s": w, "output_tokens": 4899, "output_tok_s": 4899 / w}
        | {"all_exact_len": True, "outputs_sha256_16": "abc", "cpu_monitor": None}
        for i, w in enumerate((100.0, 90.0, 110.0))
    ]
    summary = {"kind": "summary", "output_tok_s": {"median": 48.99, "min": 44.5, "max": 54.4}}
    text = "\n".join(json.dumps(r) for r in [*runs, summary | {"digests": ["abc"]}])
    r = peers.parse_server_bench(text)
    assert r["output_tok_per_s"]["median"] == 48.99
    assert r["all_exact_len"] and r["digests"] == ["abc"] and len(r["runs"]) == 3
    assert "error" in peers.parse_server_bench("server not healthy")


def test_parse_vmhwm():
    status = "Name:\tllama-server\nVmPeak:\t  900000 kB\nVmHWM:\t  204800 kB\nVmRSS:\t  100 kB\n"
    assert peers.parse_vmhwm_mb(status) == 200.0
    assert peers.parse_vmhwm_mb("Name:\tx\n") is None


def _fake_binaries(home: Path) -> Path:
    bin_dir = home / "build-tools" / "bin"
    bin_dir.mkdir(parents=True)
    for name in peers.BINARIES:
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir


def test_bin_dir_needs_both_binaries(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMACPP_HOME", str(tmp_path))
    assert peers.llamacpp_bin_dir() is None
    bin_dir = _fake_binaries(tmp_path)
    assert peers.llamacpp_bin_dir() == bin_dir
    (bin_dir / "llama-server").unlink()
    assert peers.llamacpp_bin_dir() is None


def test_server_command_is_the_documented_one(tmp_path):
    cmd = peers.server_command(tmp_path, Path("m.gguf"), 8123)
    assert cmd[0] == str(tmp_path / "llama-server")
    assert " ".join(cmd[1:]) == (
        "-m m.gguf -t 2 -c 32768 -np 64 --no-kv-unified --port 8123 --host 127.0.0.1"
    )


def test_run_measured_reports_exit_output_and_peak_rss():
    code = "import sys; b = bytearray(64 << 20); print('{\"ok\": 1}'); sys.exit(3)"
    out = peers.run_measured([sys.executable, "-c", code])
    assert out["rc"] == 3
    assert peers.json_lines(out["stdout"]) == [{"ok": 1}]
    assert out["tree_peak_rss_mb"] >= 64


FAKE_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_waits_for_health_and_reads_peak_rss(tmp_path):
    port = peers.free_port()
    cmd = [sys.executable, "-c", FAKE_SERVER, str(port)]
    with peers.Server(cmd, port, log_path=tmp_path / "log", health_timeout=30) as server:
        assert server.proc is not None and server.proc.poll() is None
    assert server.proc.poll() is not None  # stopped
    assert server.peak_rss_mb is not None and server.peak_rss_mb > 0


def test_server_that_exits_at_start_fails_fast(tmp_path):
    port = peers.free_port()
    server = peers.Server([sys.executable, "-c", "raise SystemExit(2)"], port, health_timeout=30)
    with pytest.raises(RuntimeError, match="exited"):
        server.__enter__()


def _results(**over):
    r = {
        "llamacpp_batch1": {
            "tg_tok_per_s": {"median": 100.0},
            "pp_ms": {"median": 400.0},
            "tree_peak_rss_mb": 150.0,
        },
        "llamacpp_server": {"output_tok_per_s": {"median": 40.0}, "peak_rss_mb": 300.0},
        "baton_latency_auto": {
            "decode_tok_per_s": {"median": 120.0},
            "ttft_ms": {"median": 300.0},
            "peak_rss_mb": 700.0,
        },
        "baton_throughput_auto": {
            "tok_per_s": {"median": 120.0},
            "peak_rss_mb": 800.0,
            "engine_children_peak_rss_mb": 1500.0,
        },
        "hf_latency": {
            "generate_decode_tok_per_s": {"median": 20.0},
            "generate_prefill_ms": {"median": 500.0},
        },
        "hf_static": {"tok_per_s": 60.0, "peak_rss_mb": 2800.0},
    }
    return r | over


def test_side_by_side_rows_ratios_and_targets():
    rows = peers.side_by_side_rows(_results())
    by = {row["figure"]: row for row in rows}
    assert [row["figure"] for row in rows] == [f[0] for f in peers.FIGURES]
    dec = by["batch-1 decode tok/s"]
    assert (dec["llama.cpp"], dec["baton auto"], dec["baton none"], dec["transformers"]) == (
        100.0,
        120.0,
        None,
        20.0,
    )
    assert by["peak RSS MiB, workload run"]["baton auto"] == 1500.0  # the engine's process
    table = peers.format_side_by_side(rows)
    assert "1.20x" in table and "6.00x" in table  # decode auto / llama.cpp, / transformers
    assert "3.00x" in table  # workload auto / llama-server
    met = dict(peers.targets(rows))
    assert met["batch-1 decode >= 1.0x llama-bench tg128"] is True
    assert met["TTFT <= llama-bench pp100 time"] is True
    assert met["workload >= 2.5x llama-server"] is True
    assert met["workload >= 2.5x transformers static batch"] is False  # 2.0x
    assert met["peak RSS < 1 GB, batch-1 run"] is True
    assert met["peak RSS < 1 GB, workload run"] is False
    assert all(ok is None for _, ok in peers.targets(rows, "none"))


def test_side_by_side_without_llamacpp():
    results = _results()
    del results["llamacpp_batch1"], results["llamacpp_server"]
    rows = peers.side_by_side_rows(results | {"baton_latency_none": {"error": "exit 1"}})
    assert all(row["llama.cpp"] is None for row in rows)
    assert rows[0]["baton none"] is None
    peers.format_side_by_side(rows)  # "-" cells, no exception
