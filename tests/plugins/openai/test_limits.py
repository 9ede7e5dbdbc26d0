"""Request size and read deadlines (server.max_request_bytes, header_timeout, body_timeout).

Each hostile client runs while a probe checks that /health keeps answering within
100 ms; each is cut off within its limit plus a margin, with an OpenAI-shaped error
where a response can still be sent, and its connection closed.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from .conftest import running_server
from .probes import (
    HealthProbe,
    connect,
    exchange_or_error,
    is_closed,
    probed,
    read_response,
    request_bytes,
)

LIMIT = 1024**2  # server.max_request_bytes of the module's server
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
MARGIN = 0.6  # timers fire on the event loop: a little after their deadline


@pytest.fixture(scope="module")
def limited(model_dir):
    with running_server(
        model_dir,
        max_request_bytes="1MiB",
        header_timeout=HEADER_TIMEOUT,
        body_timeout=BODY_TIMEOUT,
    ) as srv:
        yield srv


def completion_body(size: int) -> bytes:
    body = json.dumps({"prompt": "x" * size, "max_tokens": 1}).encode()
    return body


def test_content_length_over_the_limit_is_413_before_the_body(limited):
    sock = connect(limited.url)
    t0 = time.monotonic()
    sock.sendall(
        request_bytes("POST", "/v1/completions", headers={"content-length": str(10 * 1024**2)})
    )
    r = read_response(sock)  # no body sent: the server answers from the headers alone
    assert time.monotonic() - t0 < 1.0
    assert r.status == 413 and r.headers["connection"] == "close"
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "server.max_request_bytes" in err["message"]
    assert str(10 * 1024**2) in err["message"]
    assert is_closed(sock)


def test_four_10mb_bodies_get_413s_and_health_stays_fast(limited):
    data = request_bytes("POST", "/v1/completions", completion_body(10 * 1024**2))
    results: list[object] = []

    def upload() -> None:
        # as a plain client does: the whole body, then read. The server answers from the headers
        # and drops the body while it closes (a lingering close), so the 413 is read, not a reset
        r = exchange_or_error(limited.url, data, timeout=30)
        results.append(r if isinstance(r, OSError) else (r.status, r.json()["error"]["code"]))

    probe = probed(limited.url, upload, copies=4, settle=0.3)
    assert results == [(413, "request_too_large")] * 4
    probe.check()
    # and an ordinary client (httpx) reads the 413 too
    r = httpx.post(
        f"{limited.url}/v1/completions",
        content=data.partition(b"\r\n\r\n")[2],
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_chunked_body_over_the_limit_gets_its_413(limited):
    sock = connect(limited.url)
    sock.sendall(request_bytes("POST", "/v1/completions", headers={"transfer-encoding": "chunked"}))
    chunk = b"x" * (LIMIT // 4)
    for _ in range(5):  # just past the limit, then wait for the answer
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    r = read_response(sock)
    assert r.status == 413 and r.json()["error"]["code"] == "request_too_large"
    assert r.headers["connection"] == "close"
    assert is_closed(sock)


def test_body_under_the_limit_is_served(limited):
    r = httpx.post(
        f"{limited.url}/v1/completions",
        json={"prompt": "hello " * 10, "max_tokens": 2, "model": limited.model},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def slow_send(sock, data: bytes, every: float, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.wait(every):
            return
        try:
            sock.sendall(data[i : i + 1])
        except OSError:
            return


def test_slow_headers_get_408_and_the_connection_closed(limited):
    head = request_bytes("POST", "/v1/completions", b"{}")[:-2]  # all but the final CRLF
    socks, stop = [], threading.Event()
    with HealthProbe(limited.url) as probe:
        for _ in range(8):
            sock = connect(limited.url)
            socks.append((sock, time.monotonic()))
            threading.Thread(target=slow_send, args=(sock, head, 0.2, stop), daemon=True).start()
        for sock, t0 in socks:
            r = read_response(sock)
            took = time.monotonic() - t0
            assert r.status == 408 and r.json()["error"]["code"] == "request_timeout"
            assert "server.header_timeout" in r.json()["error"]["message"]
            assert is_closed(sock)
            assert took < HEADER_TIMEOUT + 0.2 + MARGIN, took  # first byte after 0.2 s
    stop.set()
    probe.check()


def test_one_byte_every_two_seconds_is_cut_off(limited):
    """The attack as found: a header byte every 2 s. The timer runs from the first byte."""
    sock = connect(limited.url)
    t0 = time.monotonic()
    sock.sendall(b"P")
    time.sleep(HEADER_TIMEOUT + MARGIN)
    with pytest.raises(OSError):
        for b in b"OST /v1/completions HTTP/1.1\r\n":
            sock.sendall(bytes([b]))
            time.sleep(0.1)
    assert time.monotonic() - t0 < 10


def test_slow_body_gets_408_and_the_connection_closed(limited):
    body = completion_body(100)
    socks, stop = [], threading.Event()
    with HealthProbe(limited.url) as probe:
        for _ in range(8):
            sock = connect(limited.url)
            sock.sendall(request_bytes("POST", "/v1/completions", body)[: -len(body)])
            socks.append((sock, time.monotonic()))
            threading.Thread(target=slow_send, args=(sock, body, 0.2, stop), daemon=True).start()
        for sock, t0 in socks:
            r = read_response(sock)
            took = time.monotonic() - t0
            assert r.status == 408 and r.json()["error"]["code"] == "request_timeout"
            assert "server.body_timeout" in r.json()["error"]["message"]
            assert r.headers["connection"] == "close"
            assert is_closed(sock)
            assert took < BODY_TIMEOUT + MARGIN, took
    stop.set()
    probe.check()


def test_slow_body_on_a_route_that_ignores_bodies_is_cut_off_too(limited):
    sock = connect(limited.url)
    sock.sendall(request_bytes("GET", "/health", headers={"content-length": "100"}))
    t0 = time.monotonic()
    sock.sendall(b"x")
    r = read_response(sock)
    assert r.status == 408 and time.monotonic() - t0 < BODY_TIMEOUT + MARGIN


def test_idle_keep_alive_connections_follow_timeout_keep_alive(limited):
    """Between requests the header timer is off: an idle connection lives for the keep-alive time."""
    sock = connect(limited.url)
    sock.sendall(request_bytes("GET", "/health"))
    assert read_response(sock).status == 200
    time.sleep(HEADER_TIMEOUT + MARGIN)  # idle longer than header_timeout: still open
    sock.sendall(request_bytes("GET", "/health"))
    assert read_response(sock).status == 200
    t0 = time.monotonic()
    assert is_closed(sock, timeout=10)  # uvicorn's timeout_keep_alive (5 s)
    assert 4 < time.monotonic() - t0 < 7


def test_a_connection_that_never_sends_is_closed_after_the_keep_alive_time(limited):
    sock = connect(limited.url)
    t0 = time.monotonic()
    assert is_closed(sock, timeout=10)
    assert 4 < time.monotonic() - t0 < 7
