"""Helpers for the hardening tests: a /health latency probe and raw-socket HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

#: The prober's script, run by the interpreter of the tests.
PROBER = Path(__file__).with_name("health_probe_main.py")


class HealthProbe:
    """GETs /health every ``interval`` seconds from a child process; ``worst`` is the slowest answer.

    A probe that fails (no answer, or not 200) is kept in ``failures``. Use as a context manager
    around the hostile work. The prober is a process of its own, as a load balancer or a kubelet
    is: a prober thread in the test process would wait for the GIL behind the test's senders and
    an in-process server (a switch interval, 5 ms, per blocking call of its own), and measure that.
    """

    def __init__(self, url: str, interval: float = 0.02) -> None:
        self.url = f"{url}/health"
        self.interval = interval
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> HealthProbe:
        self._proc = subprocess.Popen(
            [sys.executable, str(PROBER), self.url, str(self.interval)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        ready = self._proc.stdout.readline()
        assert ready.strip() == "ready", f"the /health prober did not start: {ready!r}"
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._proc is not None
        try:
            out, _ = self._proc.communicate(timeout=30)  # closes stdin: the prober's stop
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            raise
        assert self._proc.returncode == 0, f"the /health prober exited {self._proc.returncode}"
        result = json.loads(out.strip().splitlines()[-1])
        self.latencies, self.failures = result["latencies"], result["failures"]

    @property
    def worst(self) -> float:
        return max(self.latencies)

    def check(self, limit: float = 0.1, min_probes: int = 5) -> float:
        """Assert every probe answered 200 within ``limit`` seconds; the worst latency."""
        assert len(self.latencies) >= min_probes, f"only {len(self.latencies)} probes ran"
        assert not self.failures, self.failures[:5]
        worst = self.worst
        print(f"/health: {len(self.latencies)} probes, worst {worst * 1000:.1f} ms")
        assert worst < limit, f"/health took {worst * 1000:.0f} ms (limit {limit * 1000:.0f} ms)"
        return worst


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def connect(url: str, timeout: float = 10) -> socket.socket:
    sock = socket.create_connection(address(url), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def request_bytes(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    head = {"host": "test", "content-type": "application/json"}
    if method != "GET" or body:
        head["content-length"] = str(len(body))
    head.update(headers or {})
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode() + body


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


def read_response(sock: socket.socket) -> Response:
    """One HTTP/1.1 response with a Content-Length body (what the server sends for errors)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response; got {buf!r}")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return Response(status, headers, rest[:length])


def is_closed(sock: socket.socket, timeout: float = 3.0) -> bool:
    """True when the server closes the connection (EOF or reset) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def exchange(url: str, data: bytes, timeout: float = 60) -> Response:
    """Send raw request bytes on a new connection and read the response."""
    sock = connect(url, timeout=timeout)
    try:
        sock.sendall(data)
        return read_response(sock)
    finally:
        sock.close()


def exchange_or_error(url: str, data: bytes, timeout: float = 60) -> Response | OSError:
    """``exchange``, with a connection error as the result instead of raised."""
    try:
        return exchange(url, data, timeout)
    except OSError as e:
        return e


def probed(url: str, work: Callable[[], Any], copies: int = 1, settle: float = 0.2) -> HealthProbe:
    """Run ``copies`` of ``work`` at once, on threads, while /health is probed; the probe, to
    ``check()``. ``settle``: seconds probed after the work ends (a slow answer may trail it)."""
    with HealthProbe(url) as probe:
        threads = [threading.Thread(target=work) for _ in range(copies)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        time.sleep(settle)
    return probe


def timed_exchange(url: str, data: bytes) -> tuple[Response, float]:
    """One raw request while /health is probed (it must stay fast): the response, its seconds."""
    out: list[tuple[Response, float]] = []

    def send() -> None:
        t0 = time.monotonic()
        r = exchange(url, data)
        out.append((r, time.monotonic() - t0))

    probed(url, send).check()
    return out[0]
