"""llama.cpp, the CPU peer of `make bench`: find its binaries, run llama-bench and llama-server.

The binaries come from ``../shared/bench/llamacpp/build.sh`` (``$LLAMACPP_HOME``,
default ``~/.cache/baton-peers/llama.cpp``, binaries in ``build-tools/bin``).
Nothing here builds them: when they are missing, :func:`llamacpp_bin_dir` says
so and the caller skips the peer. Figures are parsed from llama-bench's JSON
lines and from ``server_bench.py``'s run and summary lines; llama-server's peak
RSS is its VmHWM, read from /proc before it is stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

BINARIES = ("llama-bench", "llama-server")


def llamacpp_home() -> Path:
    env = os.environ.get("LLAMACPP_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "baton-peers" / "llama.cpp"


def llamacpp_bin_dir(home: Path | None = None) -> Path | None:
    """The folder holding llama-bench and llama-server, or None when either is missing."""
    bin_dir = (home or llamacpp_home()) / "build-tools" / "bin"
    if all(os.access(bin_dir / b, os.X_OK) for b in BINARIES):
        return bin_dir
    return None


# --------------------------------------------------------------------------- running commands


def run_measured(cmd: Sequence[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` to its end: exit code, stdout, stderr and the peak RSS of its process tree.

    The peak RSS is ``ru_maxrss`` from ``wait4`` on the child, which Linux takes
    as the largest of the child and the descendants it waited for (MiB).
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=err, text=True, env={**os.environ, **(env or {})}
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        return {
            "rc": proc.returncode,
            "stdout": _read(out),
            "stderr": _read(err),
            "tree_peak_rss_mb": round(usage.ru_maxrss / 1024.0, 1),
        }


def _read(f: IO[str]) -> str:
    f.seek(0)
    return f.read()


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` that is a JSON object, in order (other lines are skipped)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


# --------------------------------------------------------------------------- llama-bench


def parse_llama_bench(text: str) -> dict[str, Any]:
    """llama-bench ``-o jsonl`` (one pp test, one tg test) -> prompt / decode figures.

    tok/s are medians over llama-bench's own repetitions (``samples_ts``); the
    prompt time is the median time of the whole pp test, the llama.cpp side of
    a TTFT.
    """
    result: dict[str, Any] = {"bench": "llamacpp_batch1"}
    for row in json_lines(text):
        n_prompt, n_gen = int(row.get("n_prompt", 0)), int(row.get("n_gen", 0))
        samples_ts = row.get("samples_ts") or [row["avg_ts"]]
        samples_ns = row.get("samples_ns") or [row["avg_ns"]]
        ts = _stats(samples_ts)
        if n_prompt and not n_gen:
            result["pp_tokens"] = n_prompt
            result["pp_tok_per_s"] = ts
            result["pp_ms"] = _stats([ns / 1e6 for ns in samples_ns])
        elif n_gen and not n_prompt:
            result["tg_tokens"] = n_gen
            result["tg_tok_per_s"] = ts
        for key in ("build_commit", "cpu_info", "n_threads", "model_type", "model_size"):
            if key in row:
                result.setdefault(key, row[key])
    return result


def _stats(values: Sequence[float]) -> dict[str, float]:
    v = sorted(float(x) for x in values)
    return {
        "median": round(statistics.median(v), 2),
        "min": round(v[0], 2),
        "max": round(v[-1], 2),
        "n": len(v),
    }


# --------------------------------------------------------------------------- llama-server


def server_command(bin_dir: Path, gguf: Path, port: int, threads: int = 2) -> list[str]:
    """llama-server with 64 slots, each its own 512-token cache (its fastest setting for workload.json)."""
    return [
        str(bin_dir / "llama-server"),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-c",
        "32768",
        "-np",
        "64",
        "--no-kv-unified",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_vmhwm_mb(status_text: str) -> float | None:
    """``VmHWM`` (peak resident set) of a /proc/<pid>/status text, in MiB."""
    for line in status_text.splitlines():
        if line.startswith("VmHWM:"):
            parts = line.split()
            return round(int(parts[1]) / 1024.0, 1)  # reported in kB
    return None


class Server:
    """A server process started for one measurement: ``with Server(cmd, port) as s: ...``.

    Waits for ``/health`` to answer 200 (failing fast if the process exits),
    and on leaving reads its VmHWM into ``peak_rss_mb`` before stopping it
    (SIGTERM, then SIGKILL after ``stop_timeout`` seconds).
    """

    def __init__(
        self,
        cmd: Sequence[str],
        port: int,
        log_path: Path | None = None,
        health_timeout: float = 180.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.cmd, self.port = list(cmd), port
        self.log_path = log_path
        self.health_timeout, self.stop_timeout = health_timeout, stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.peak_rss_mb: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        if self.log_path is None:
            self.proc = subprocess.Popen(
                self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
        else:
            with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_health()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_health(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.health_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[0]} exited with {self.proc.returncode} at start")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.cmd[0]}: /health not ready after {self.health_timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            self.peak_rss_mb = parse_vmhwm_mb(Path(f"/proc/{self.proc.pid}/status").read_text())
        self.proc.terminate()
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def parse_server_bench(text: str) -> dict[str, Any]:
    """server_bench.py's output -> its summary line, with the run lines under ``runs``."""
    rows = json_lines(text)
    summary = next((r for r in reversed(rows) if r.get("kind") == "summary"), None)
    if summary is None:
        return {"error": "no summary line from server_bench.py"}
    runs = [r for r in rows if r.get("kind") == "run"]
    return {
        "bench": "llamacpp_server",
        "output_tok_per_s": summary["output_tok_s"],
        "digests": summary.get("digests", []),
        "all_exact_len": all(r.get("all_exact_len") for r in runs),
        "runs": [
            {k: r.get(k) for k in ("wall_s", "output_tokens", "output_tok_s", "cpu_monitor")}
            for r in runs
        ],
    }


# --------------------------------------------------------------------------- the side-by-side table

MODES = ("auto", "none")
GB = 1e9 / 2**20  # 1 GB in MiB


def _get(d: dict[str, Any] | None, *path: str) -> float | None:
    v: Any = d or {}
    for key in path:
        if not isinstance(v, dict):
            return None
        v = v.get(key)
    return float(v) if isinstance(v, int | float) else None


def _throughput_rss(r: dict[str, Any] | None) -> float | None:
    values = [_get(r, "peak_rss_mb"), _get(r, "engine_children_peak_rss_mb")]
    present = [v for v in values if v is not None]
    return max(present) if present else None


Getter = Callable[[dict[str, Any]], float | None]

# figure, which way is better, then where each column's value is in `make bench`'s results
# (keys: llamacpp_batch1, llamacpp_server, baton_latency_<mode>, baton_throughput_<mode>,
# hf_latency, hf_static; "{mode}" is replaced by each of MODES)
FIGURES: list[tuple[str, str, Getter, Callable[[dict[str, Any], str], float | None], Getter]] = [
    (
        "batch-1 decode tok/s",
        "higher",
        lambda r: _get(r.get("llamacpp_batch1"), "tg_tok_per_s", "median"),
        lambda r, m: _get(r.get(f"baton_latency_{m}"), "decode_tok_per_s", "median"),
        lambda r: _get(r.get("hf_latency"), "generate_decode_tok_per_s", "median"),
    ),
    (
        "TTFT 100-token prompt ms",
        "lower",
        lambda r: _get(r.get("llamacpp_batch1"), "pp_ms", "median"),
        lambda r, m: _get(r.get(f"baton_latency_{m}"), "ttft_ms", "median"),
        lambda r: _get(r.get("hf_latency"), "generate_prefill_ms", "median"),
    ),
    (
        "workload all at once, output tok/s",
        "higher",
        lambda r: _get(r.get("llamacpp_server"), "output_tok_per_s", "median"),
        lambda r, m: _get(r.get(f"baton_throughput_{m}"), "tok_per_s", "median"),
        lambda r: _get(r.get("hf_static"), "tok_per_s"),
    ),
    (
        "peak RSS MiB, batch-1 run",
        "lower",
        lambda r: _get(r.get("llamacpp_batch1"), "tree_peak_rss_mb"),
        lambda r, m: _get(r.get(f"baton_latency_{m}"), "peak_rss_mb"),
        lambda r: _get(r.get("hf_latency"), "peak_rss_mb"),
    ),
    (
        "peak RSS MiB, workload run",
        "lower",
        lambda r: _get(r.get("llamacpp_server"), "peak_rss_mb"),
        lambda r, m: _throughput_rss(r.get(f"baton_throughput_{m}")),
        lambda r: _get(r.get("hf_static"), "peak_rss_mb"),
    ),
]


def side_by_side_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per figure: llama.cpp, baton auto, baton none, transformers (None where not run)."""
    rows = []
    for name, better, llama, baton, hf in FIGURES:
        row: dict[str, Any] = {"figure": name, "better": better, "llama.cpp": llama(results)}
        row.update({f"baton {m}": baton(results, m) for m in MODES})
        row["transformers"] = hf(results)
        rows.append(row)
    return rows


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def format_side_by_side(rows: list[dict[str, Any]]) -> str:
    """The table of figures, then baton / llama.cpp and baton / transformers for each mode."""
    cols = ["llama.cpp", *(f"baton {m}" for m in MODES), "transformers"]
    ratio_cols = [(m, peer) for m in MODES for peer in ("llama.cpp", "transformers")]
    header = ["figure", *cols, *(f"{m}/{peer.split('.')[0]}" for m, peer in ratio_cols)]
    lines = [header]
    for row in rows:
        cells = [f"{row['figure']} ({row['better']})"]
        cells += [_fmt(row[c]) for c in cols]
        cells += [_fmt(ratio(row[f"baton {m}"], row[peer]), "x") for m, peer in ratio_cols]
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    )


def _fmt(v: float | None, suffix: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.2f}{suffix}" if suffix else f"{v:.1f}"


def targets(rows: list[dict[str, Any]], mode: str = "auto") -> list[tuple[str, bool | None]]:
    """Issue 12's targets for baton ``mode``: (what, met?), None where a figure is missing."""
    by = {row["figure"]: row for row in rows}
    b = f"baton {mode}"
    dec, ttft, wl = (by[f[0]] for f in FIGURES[:3])
    rss_b1, rss_wl = (by[f[0]][b] for f in FIGURES[3:])

    def ge(a: float | None, c: float | None, k: float = 1.0) -> bool | None:
        return None if a is None or c is None else a >= k * c

    return [
        ("batch-1 decode >= 1.0x llama-bench tg128", ge(dec[b], dec["llama.cpp"])),
        ("TTFT <= llama-bench pp100 time", ge(ttft["llama.cpp"], ttft[b])),
        ("workload >= 2.5x llama-server", ge(wl[b], wl["llama.cpp"], 2.5)),
        ("workload >= 2.5x transformers static batch", ge(wl[b], wl["transformers"], 2.5)),
        ("peak RSS < 1 GB, batch-1 run", ge(GB, rss_b1)),
        ("peak RSS < 1 GB, workload run", ge(GB, rss_wl)),
    ]
