"""Small helpers shared by the benchmarks: percentiles, peak RSS, CPU contamination, workloads."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec


def summarize(values: Iterable[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {"n": 0}
    return {"median": statistics.median(v), "min": v[0], "max": v[-1], "n": len(v)}


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def peak_rss_mb() -> float:
    """Peak resident set size of this process (MiB; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def children_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0


def digest(token_lists: Iterable[Sequence[int]]) -> str:
    """The workload digest of ../shared/bench (sha256 over "id,id,...;" per request, 16 hex digits)."""
    h = hashlib.sha256()
    for t in token_lists:
        h.update((",".join(map(str, t)) + ";").encode())
    return h.hexdigest()[:16]


class CpuMonitor:
    """``with CpuMonitor() as m: ...`` -> m.result: how much CPU other processes took meanwhile."""

    def __enter__(self) -> CpuMonitor:
        self.result: dict[str, float] | None = None
        self._t0 = _proc_stat()
        self._self0 = _self_ticks()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._t0 is None:
            return
        busy1, steal1, total1 = _proc_stat() or (0, 0, 0)
        busy0, steal0, total0 = self._t0
        dtot = max(1, total1 - total0)
        dself = _self_ticks() - self._self0
        self.result = {
            "others_cpu_frac": round(max(0.0, (busy1 - busy0) - dself) / dtot, 3),
            "self_cpu_frac": round(dself / dtot, 3),
            # this process's and its descendants' CPU seconds (the engine's, wherever it ran)
            "self_cpu_s": round(dself / os.sysconf("SC_CLK_TCK"), 2),
            "steal_frac": round((steal1 - steal0) / dtot, 3),
            "loadavg_1m": os.getloadavg()[0],
        }


def _proc_stat() -> tuple[int, int, int] | None:
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy, steal, busy + idle + iowait + steal


def _self_ticks() -> int:
    """CPU ticks of this process and all its descendants (engine process, executor workers).

    Waited-for children are in ``os.times()``; live ones (workers run during the
    measurement) are added from psutil, with what they reaped themselves.
    """
    t = os.times()
    seconds = t.user + t.system + t.children_user + t.children_system + _live_descendants_cpu()
    return int(seconds * os.sysconf("SC_CLK_TCK"))


def _live_descendants_cpu() -> float:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency of baton-core
        return 0.0
    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            c = p.cpu_times()
        except psutil.Error:  # gone meanwhile: its parent's children_* times hold it once reaped
            continue
        total += c.user + c.system + c.children_user + c.children_system
    return total


# --------------------------------------------------------------------------- workloads


class WorkloadRequest(msgspec.Struct, kw_only=True):
    id: str = ""
    prompt_token_ids: list[int]
    max_new_tokens: int
    arrival_time: float = 0.0
    user: str | None = None
    messages: list[dict[str, Any]] | None = None
    #: The request's own SLO targets (``SchedulingInfo.slo_ttft_ms`` / ``slo_tpot_ms``), if any.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


class Workload(msgspec.Struct, kw_only=True):
    """The chat-workload/v1 format of ../shared/bench (extra fields are ignored)."""

    format: str
    requests: list[WorkloadRequest]
    name: str = ""
    sampling: dict[str, Any] = msgspec.field(default_factory=dict)


def load_workload(path: str | os.PathLike[str]) -> Workload:
    data = Path(path).read_bytes()
    wl = msgspec.json.decode(data, type=Workload)
    if not wl.format.startswith("chat-workload/"):
        raise ValueError(f"{path}: format {wl.format!r} is not a chat-workload")
    return wl


def default_bench_dir() -> Path:
    """Where the shared workloads live: $BATON_BENCH_DIR, else ../shared/bench next to the checkout."""
    env = os.environ.get("BATON_BENCH_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent.parent / "shared" / "bench"
        if cand.is_dir():
            return cand
    return Path.cwd() / "bench"


def now() -> float:
    return time.perf_counter()


def dtype_config(llm: Any) -> dict[str, Any]:
    """The dtype the engine's model computes in and whether the device has it natively
    (``model.dtype`` resolved: "auto", and a 16-bit type emulated on CPU, differ from the setting)."""
    return {
        "model_dtype": llm.config.model.dtype,
        "dtype": llm.info.dtype,
        "dtype_native": llm.info.dtype_native,
    }


def spec_figures(llm: Any) -> dict[str, Any] | None:
    """Speculative decoding since the engine started (``speculative.method``), or None when off:
    verifications, draft and accepted tokens, acceptance rate, tokens per verification (the
    accepted drafts plus the model's own token) and acceptance by draft position."""
    method = llm.config.speculative.method
    if method == "none":
        return None
    from baton.metrics.spec import SpecTally

    s = llm.get_stats()  # totals since the start
    t = SpecTally()
    t.add(s)
    return {
        "method": method,
        "num_tokens": llm.config.speculative.num_tokens,
        "verifications": t.num_drafts,
        "draft_tokens": t.num_draft_tokens,
        "accepted_tokens": t.num_accepted_tokens,
        "acceptance_rate": round(t.acceptance_rate, 3) if t.num_draft_tokens else None,
        "tokens_per_verification": round(t.mean_accepted_length, 3) if t.num_drafts else None,
        "accepted_per_position": s.spec_accepted_per_position,
    }


def emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>28}: {v}")
