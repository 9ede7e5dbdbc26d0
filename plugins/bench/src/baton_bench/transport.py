"""Transport benchmark: latency and throughput of every installed transport.

For each transport (multiprocess ones with a real engine-side echo process,
started with "spawn" as baton starts engine cores; inproc with a thread):

- round trip of a small message ([type byte, 128-byte body]) to the echo and
  back: p50 / p99 over ``--round-trips``, in microseconds;
- small-message throughput, engine -> frontend (the output direction): the
  engine sends ``--messages`` 128-byte messages unprompted, messages/s;
- tensor throughput, engine -> frontend: a float32 torch tensor of
  ``--tensor-mib`` MiB through the codec (encoded in the engine, decoded in the
  frontend), GB/s; next to a plain memcpy of the same size on this machine
  (``np.copyto``, cache-cold and cache-hot, and ``ndarray.copy()``); and the
  same per CPU-second of both processes, which a busy machine cannot skew.

Transports are measured in turns within each of ``--runs`` runs; the figures
are the medians (with min and max) over runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
from typing import Any

import numpy as np

from baton.config import BatonConfig
from baton.errors import TransportError
from baton.plugins.registry import get_registry
from baton.testing import echo
from baton_bench.common import CpuMonitor, emit, percentile, summarize

_BODY = bytes(range(128))
_GB = 1e9


def make_transport(config: BatonConfig, name: str) -> Any:
    entry = get_registry().get("transport", name)
    return entry.create(config, entry.settings(config))


class _Link:
    """A client channel with one echo engine, ready."""

    def __init__(self, transport: Any) -> None:
        self._stack = contextlib.ExitStack()
        self.client = transport.create_client(1)
        self._stack.callback(self.client.close)
        try:
            engines = self._stack.enter_context(
                echo.echo_engines(transport, self.client, ready_timeout=120.0)
            )
        except BaseException:
            self._stack.close()
            raise
        #: the processes that do the work (the engine may be a thread of this one)
        self.pids = sorted({os.getpid(), *(e.pid for e in engines)})

    def close(self) -> None:
        self._stack.close()


def cpu_seconds(pids: list[int]) -> float:
    """CPU time of every thread of ``pids`` so far (schedstat: nanoseconds, unlike 10 ms ticks)."""
    total = 0
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    return total / 1e9


def round_trips(link: _Link, n: int, warmup: int = 200) -> dict[str, float]:
    client = link.client
    message = [b"\x00", _BODY]
    for _ in range(warmup):
        client.send(message, 0)
        client.recv(timeout=10.0)
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        client.send(message, 0)
        if client.recv(timeout=10.0) is None:
            raise TransportError("round trip timed out")
        samples.append((clock() - t0) / 1000.0)
    return {"p50_us": percentile(samples, 50), "p99_us": percentile(samples, 99)}


def small_throughput(link: _Link, n: int) -> float:
    """Messages/s from the engine to the frontend."""
    client = link.client
    t0 = time.perf_counter()
    client.send([echo.emit(n, len(_BODY))], 0)
    for _ in range(n):
        if client.recv(timeout=30.0) is None:
            raise TransportError("small-message stream stalled")
    return n / (time.perf_counter() - t0)


def tensor_throughput(link: _Link, nbytes: int, count: int) -> dict[str, float]:
    """GB/s of tensors from the engine to the frontend, encoded and decoded by the codec; and GB
    per CPU-second of both processes (the figure a busy machine cannot skew: no waiting in it)."""
    from baton.serial import MsgpackDecoder

    decoder = MsgpackDecoder()
    client = link.client
    cpu0 = cpu_seconds(link.pids)
    t0 = time.perf_counter()
    client.send([echo.emit_tensors(count, nbytes)], 0)
    for _ in range(count):
        frames = client.recv(timeout=60.0)
        if frames is None:
            raise TransportError("tensor stream stalled")
        (tensor,) = decoder.decode(frames)
        if tensor.numel() * 4 != nbytes:
            raise TransportError(f"tensor of {tensor.numel() * 4} bytes arrived, {nbytes} sent")
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(link.pids) - cpu0
    return {
        "tensor_gbps": count * nbytes / wall / _GB,
        "tensor_gb_per_cpu_s": count * nbytes / cpu / _GB,
    }


def memcpy_gbps(nbytes: int, reps: int = 16) -> dict[str, float]:
    """A plain copy of ``nbytes``: ``hot`` repeats one copy (source and destination may sit in
    the CPU's last-level cache), ``cold`` rotates over 4 pairs (128 MiB for 16 MiB: more than a
    cache holds, like a transport's source, ring and destination), ``copy`` is ``ndarray.copy()``."""
    pairs = [
        (np.full(nbytes // 4, i, np.float32), np.empty(nbytes // 4, np.float32)) for i in range(4)
    ]
    for src, dst in pairs:
        np.copyto(dst, src)  # fault every page in before timing

    def rate(fn: Any, clock: Any = time.perf_counter) -> float:
        t0 = clock()
        for i in range(reps):
            fn(i)
        return reps * nbytes / (clock() - t0) / _GB

    def cold(i: int) -> None:
        np.copyto(pairs[i % 4][1], pairs[i % 4][0])

    return {
        "hot": rate(lambda i: np.copyto(pairs[0][1], pairs[0][0])),
        "cold": rate(cold),
        "copy": rate(lambda i: pairs[i % 4][0].copy()),
        "cold_per_cpu_s": rate(cold, time.thread_time),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = BatonConfig.load(getattr(args, "config", None))
    names = args.transports.split(",") if args.transports else get_registry().names("transport")
    nbytes = args.tensor_mib * (1 << 20)
    links: dict[str, _Link] = {}
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    memcpy: dict[str, list[float]] = {"hot": [], "cold": [], "copy": [], "cold_per_cpu_s": []}
    try:
        for name in names:
            links[name] = _Link(make_transport(config, name))
            tensor_throughput(links[name], nbytes, 1)  # warm-up: imports torch in the engine
        with CpuMonitor() as cpu:
            for _ in range(args.runs):
                for name, link in links.items():
                    gc.collect()
                    figures = round_trips(link, args.round_trips)
                    figures["small_msgs_per_s"] = small_throughput(link, args.messages)
                    figures.update(tensor_throughput(link, nbytes, args.tensor_count))
                    for key, value in figures.items():
                        samples[name].setdefault(key, []).append(value)
                for key, value in memcpy_gbps(nbytes).items():
                    memcpy[key].append(value)
    finally:
        for link in links.values():
            link.close()
    result: dict[str, Any] = {
        "bench": "transport",
        "runs": args.runs,
        "round_trips": args.round_trips,
        "messages": args.messages,
        "tensor_bytes": nbytes,
        "tensor_count": args.tensor_count,
        "memcpy_gbps": {k: summarize(v) for k, v in memcpy.items()},
        "transports": {n: {k: summarize(v) for k, v in s.items()} for n, s in samples.items()},
        "cpu": cpu.result,
    }
    result["targets"] = _targets(result)
    return result


def _targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets: shm p50 <= zmq p50 / 2; tensors within 3x of a memcpy (hot and cold,
    by the clock, and per CPU-second: what the transport costs whatever else the machine runs)."""
    t = result["transports"]
    out: dict[str, Any] = {}
    if "shm" in t and "zmq" in t:
        ratio = t["shm"]["p50_us"]["median"] / t["zmq"]["p50_us"]["median"]
        out["shm_p50_over_zmq_p50"] = round(ratio, 3)
        out["shm_p50_at_most_half_of_zmq"] = ratio <= 0.5
    mc = result["memcpy_gbps"]
    for name, figures in t.items():
        for kind, tensor in (
            ("cold", "tensor_gbps"),
            ("hot", "tensor_gbps"),
            ("cold_per_cpu_s", "tensor_gb_per_cpu_s"),
        ):
            slowdown = mc[kind]["median"] / figures[tensor]["median"]
            out[f"{name}_memcpy_{kind}_over_tensor"] = round(slowdown, 2)
            out[f"{name}_tensor_within_3x_memcpy_{kind}"] = slowdown <= 3.0
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--transports", default=None, help="comma-separated names (default: every installed one)"
    )
    p.add_argument("--runs", type=int, default=5, help="runs; figures are medians over runs")
    p.add_argument(
        "--round-trips", type=int, default=2000, help="small-message round trips per run"
    )
    p.add_argument("--messages", type=int, default=20000, help="small messages per throughput run")
    p.add_argument("--tensor-mib", type=int, default=16, help="size of each tensor")
    p.add_argument("--tensor-count", type=int, default=8, help="tensors per throughput run")
    # SUPPRESS: a --config given to the parent `baton bench` parser is not overwritten with None
    p.add_argument("--config", default=argparse.SUPPRESS, help="a TOML or YAML config file")


def main(args: argparse.Namespace) -> int:
    result = run(args)
    if args.json:
        emit(result, True)
        return 0
    mc = result["memcpy_gbps"]
    print(
        f"transport bench: {result['runs']} runs, medians [min-max]; tensors of "
        f"{result['tensor_bytes'] >> 20} MiB. memcpy of that size, GB/s: cold {_cell(mc['cold'], '{:.2f}')}, "
        f"hot (cache-resident) {_cell(mc['hot'], '{:.2f}')}, ndarray.copy {_cell(mc['copy'], '{:.2f}')}, "
        f"cold per CPU-second {_cell(mc['cold_per_cpu_s'], '{:.2f}')}"
    )
    columns = [
        ("rtt p50 us", "p50_us", "{:.1f}"),
        ("rtt p99 us", "p99_us", "{:.1f}"),
        ("small msg/s", "small_msgs_per_s", "{:,.0f}"),
        ("tensor GB/s", "tensor_gbps", "{:.2f}"),
        ("GB per CPU-s", "tensor_gb_per_cpu_s", "{:.2f}"),
    ]
    print(f"{'transport':<10}" + "".join(f"{title:>28}" for title, _, _ in columns))
    for name, f in result["transports"].items():
        print(f"{name:<10}" + "".join(f"{_cell(f[key], fmt):>28}" for _, key, fmt in columns))
    print(f"targets: {result['targets']}")
    print(f"cpu: {result['cpu']}")
    return 0


def _cell(s: dict[str, float], fmt: str) -> str:
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m baton_bench.transport", description=__doc__)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
