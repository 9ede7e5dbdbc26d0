"""`baton bench transport` runs end to end (tiny sizes; figures are not judged here)."""

import argparse
import json

from baton_bench import transport as bench


def test_bench_transport_json(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        [
            "--json",
            "--transports",
            "inproc",
            "--runs",
            "1",
            "--round-trips",
            "20",
            "--messages",
            "50",
            "--tensor-mib",
            "1",
            "--tensor-count",
            "1",
        ]
    )
    assert bench.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    figures = result["transports"]["inproc"]
    for key in ("p50_us", "p99_us", "small_msgs_per_s", "tensor_gbps", "tensor_gb_per_cpu_s"):
        assert figures[key]["n"] == 1 and figures[key]["median"] > 0
    assert set(result["memcpy_gbps"]) == {"hot", "cold", "copy", "cold_per_cpu_s"}
    assert "inproc_tensor_within_3x_memcpy_cold" in result["targets"]
