"""HTTP load on an OpenAI-compatible server: streaming requests at a rate, TTFT/ITL/TPOT.

``baton bench serve`` sends a chat workload's requests (``../shared/bench`` format:
``messages`` and ``max_new_tokens``, or ``prompt_token_ids`` on ``/v1/completions``)
as streaming requests, all at once or arriving as a Poisson process at
``--request-rate``, at most ``--max-concurrency`` in flight, each asking for
exactly its token count (``ignore_eos``, temperature 0). It reports request and
output-token throughput, TTFT, inter-token latency, TPOT and end-to-end
percentiles, every error, and how much CPU other processes took meanwhile.
Without ``--base-url`` it starts ``baton serve`` itself (the config and engine
flags given here, a free port on 127.0.0.1) and stops it afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from baton.cli.main import add_engine_arguments, engine_argv
from baton.errors import BatonError
from baton_bench.common import (
    CpuMonitor,
    WorkloadRequest,
    default_bench_dir,
    emit,
    load_workload,
    percentile,
)

#: Seconds ``baton serve`` may take to say where it listens (a cold model conversion included).
SERVE_START_TIMEOUT = 900.0
#: The model name a server started here serves under.
SERVED_NAME = "bench"


class RequestRecord(msgspec.Struct, kw_only=True):
    """What one request did, as the client saw it (seconds on the client's clock)."""

    id: str
    expected_tokens: int
    error: str | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = msgspec.field(default_factory=list)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url",
        help="a running server (http://127.0.0.1:8000); default: start `baton serve` with "
        "--config and the engine flags below, and stop it afterwards",
    )
    p.add_argument(
        "--model-name",
        help="the model name to send (default: the server's first /v1/models entry)",
    )
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    p.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="/v1/chat/completions with the workload's messages, or /v1/completions with its "
        "prompt token ids",
    )
    p.add_argument(
        "--workload", help="a chat-workload JSON (default: workload.json of ../shared/bench)"
    )
    p.add_argument("--num-requests", type=int, help="use only the first N requests")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        help="every request's time-to-first-token target, sent as scheduling.slo_ttft_ms; "
        "goodput (requests that met every target given) is reported",
    )
    p.add_argument(
        "--slo-tpot-ms",
        type=float,
        help="every request's time-per-output-token target (scheduling.slo_tpot_ms)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--per-request", action="store_true", help="include every request's record")
    add_engine_arguments(p)


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """When each of n requests is sent, seconds after the first: 0 for all at ``rate`` inf, else
    exponential gaps of mean 1 / rate (a Poisson process)."""
    if rate <= 0:
        raise BatonError(f"--request-rate {rate:g}: give a positive rate, or inf for all at once")
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def request_body(
    req: WorkloadRequest, endpoint: str, model: str, slo: dict[str, float] | None = None
) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of one workload request; ``slo``: its ``scheduling`` SLO fields."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if slo:
        body["scheduling"] = slo
    if endpoint == "chat":
        if req.messages is None:
            raise BatonError(
                f"workload request {req.id!r} has no messages: use --endpoint completions "
                "(it sends prompt_token_ids)"
            )
        return "/v1/chat/completions", {**body, "messages": req.messages}
    return "/v1/completions", {**body, "prompt": req.prompt_token_ids}


async def _one(
    client: Any, path: str, body: dict[str, Any], rid: str, expected: int
) -> RequestRecord:
    rec = RequestRecord(id=rid, expected_tokens=expected)
    t0 = time.perf_counter()
    times: list[float] = []
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    rec.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return rec
                if chunk.get("usage"):
                    rec.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                for c in chunk.get("choices") or ():
                    delta = c.get("delta") or {}
                    if delta.get("content") or c.get("text"):
                        times.append(time.perf_counter())
    except Exception as e:  # every failure is reported in the result: the verdict needs them
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    if times:
        rec.ttft_s = times[0] - t0
        rec.itl_s = [b - a for a, b in itertools.pairwise(times)]
    rec.e2e_s = time.perf_counter() - t0
    return rec


async def run_load(
    base_url: str,
    requests: Sequence[WorkloadRequest],
    *,
    endpoint: str = "chat",
    model: str | None = None,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str = "none",
    slo: dict[str, float] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request (arrivals and concurrency as given); returns the records and the
    seconds from the first send to the last request's end."""
    import httpx

    n = len(requests)
    limit = max_concurrency or n
    headers = {"Authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"), headers=headers, limits=limits, timeout=3600
    ) as client:
        if model is None:
            got = await client.get("/v1/models")
            if got.status_code != 200:
                raise BatonError(
                    f"{base_url}/v1/models answered HTTP {got.status_code}: {got.text[:300]} "
                    "(name the model with --model-name)"
                )
            model = str(got.json()["data"][0]["id"])
        # warm-up: the connection and the engine's first-step costs stay out of the figures
        path, body = request_body(requests[0], endpoint, model)
        warm = {**body, "max_tokens": 2, "stream": False}
        warm.pop("stream_options")
        got = await client.post(path, json=warm)
        if got.status_code != 200:
            raise BatonError(
                f"the warm-up request ({path}, model {model!r}) got HTTP {got.status_code}: "
                f"{got.text[:300]}: check --base-url, --model-name and --api-key"
            )
        gate = asyncio.Semaphore(limit)
        offsets = arrival_offsets(n, request_rate, seed)
        t0 = time.perf_counter()

        async def send(req: WorkloadRequest, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with gate:
                path, body = request_body(req, endpoint, model or "", slo)
                return await _one(client, path, body, req.id, req.max_new_tokens)

        records = await asyncio.gather(
            *(send(r, at) for r, at in zip(requests, offsets, strict=True))
        )
        duration = time.perf_counter() - t0
    return list(records), duration


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    out = {f"p{q}": round(percentile(values, q), 5) for q in (50, 90, 99)}
    out["mean"] = round(statistics.fmean(values), 5)
    return out


def slo_fields(ttft_ms: float | None, tpot_ms: float | None) -> dict[str, float]:
    """The ``scheduling`` SLO fields of ``--slo-ttft-ms`` / ``--slo-tpot-ms`` (those given)."""
    out = {"slo_ttft_ms": ttft_ms, "slo_tpot_ms": tpot_ms}
    return {k: v for k, v in out.items() if v is not None}


def met_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a request met every target in ``slo``, as the client saw it (a failed one did not)."""
    if r.error is not None or r.ttft_s is None or r.e2e_s is None:
        return False
    ttft = slo.get("slo_ttft_ms")
    if ttft is not None and r.ttft_s * 1000.0 > ttft:
        return False
    tpot = slo.get("slo_tpot_ms")
    if tpot is not None and r.output_tokens > 1:
        return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) * 1000.0 <= tpot
    return True


def goodput(
    records: Sequence[RequestRecord], duration: float, slo: dict[str, float]
) -> dict[str, Any]:
    """How many requests met their SLO, and their rate."""
    met = sum(met_slo(r, slo) for r in records)
    return {
        **slo,
        "met": met,
        "attainment": round(met / len(records), 4) if records else 0.0,
        "goodput_req_s": round(met / duration, 4) if duration > 0 else 0.0,
    }


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """Throughput and latency percentiles over the records (failed requests left out)."""
    ok = [r for r in records if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    tpots = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.e2e_s is not None and r.ttft_s is not None and r.output_tokens > 1
    ]
    return {
        "requests": len(records),
        "completed": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": [f"{r.id}: {r.error}" for r in records if r.error][:5],
        "wrong_token_counts": [r.id for r in ok if r.output_tokens != r.expected_tokens],
        "output_tokens": tokens,
        "duration_s": round(duration, 3),
        "request_per_s": round(len(ok) / duration, 3) if duration > 0 else 0.0,
        "tok_per_s": round(tokens / duration, 2) if duration > 0 else 0.0,
        "ttft_s": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": _pcts([x for r in ok for x in r.itl_s]),
        "tpot_s": _pcts(tpots),
        "e2e_s": _pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


class ServeProcess:
    """``baton serve`` in a subprocess on a free port of 127.0.0.1; its URL comes from its
    'listening on' log line."""

    def __init__(self, argv: list[str]) -> None:
        cmd = [sys.executable, "-m", "baton.cli.main", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", "0", "--served-model-name", SERVED_NAME, *argv]
        self.proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.log: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, name="serve-log", daemon=True).start()
        if not self._ready.wait(SERVE_START_TIMEOUT) or self.url is None:
            self.stop()
            raise BatonError(
                "baton serve did not start; its last log lines:\n" + "".join(self.log[-30:])
            )

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()  # exited before listening

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def serve_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags and --config given to ``baton bench serve``, for ``baton serve``."""
    argv: list[str] = []
    if getattr(args, "config", None):
        argv += ["--config", args.config]
    return argv + engine_argv(args)


def main(args: argparse.Namespace) -> int:
    path = args.workload or str(default_bench_dir() / "workload.json")
    wl = load_workload(path)
    reqs = wl.requests[: args.num_requests] if args.num_requests else wl.requests
    if not reqs:
        raise BatonError(f"{path}: no requests to send")
    server = None if args.base_url else ServeProcess(serve_argv(args))
    url = args.base_url or (server.url if server else None) or ""
    model = args.model_name or (SERVED_NAME if server else None)
    slo = slo_fields(args.slo_ttft_ms, args.slo_tpot_ms)
    try:
        with CpuMonitor() as cpu:
            records, duration = asyncio.run(
                run_load(
                    url,
                    reqs,
                    endpoint=args.endpoint,
                    model=model,
                    request_rate=args.request_rate,
                    max_concurrency=args.max_concurrency,
                    seed=args.seed,
                    api_key=args.api_key,
                    slo=slo,
                )
            )
    finally:
        code = server.stop() if server else None
    result: dict[str, Any] = {
        "bench": "serve",
        "base_url": url,
        "endpoint": args.endpoint,
        "workload": str(Path(path)),
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency,
        **summarize(records, duration),
        "cpu": cpu.result,
    }
    if slo:
        result["goodput"] = goodput(records, duration, slo)
    if server is not None:
        result["server_exit_code"] = code
    if args.per_request:
        result["per_request"] = msgspec.to_builtins(records)
    emit(result, args.json)
    ok = not result["num_errors"] and not result["wrong_token_counts"]
    return 0 if ok else 1
