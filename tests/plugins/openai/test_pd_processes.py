"""Disaggregation with the real commands: ``baton serve`` as producer and as consumer and
``baton pd-proxy``, each its own process; then the producer is killed.

A consumer does not need its producer alive: the producer's blocks are in the store before
its response leaves, so params it handed out still load after it died; params whose blocks
never came cost the consumer its load_timeout and a recompute; the proxy answers a 502 naming
the dead producer.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_lifecycle import ServeProcess

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT = [100 + (11 * i) % 900 for i in range(6 * BLOCK + 5)]


def config(tmp_path: Path, role: str, store: Path) -> str:
    path = tmp_path / f"{role}.toml"
    path.write_text(
        f'[kv_transfer]\nconnector = "pd"\nrole = "{role}"\n'
        f'[kv_transfer.pd]\npath = "{store}"\nload_timeout = 1.0\n'
    )
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def completion(url: str, **body: Any) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


@pytest.fixture
def pair(model_dir: str, tmp_path: Path) -> Iterator[tuple[ServeProcess, ServeProcess, str]]:
    store = tmp_path / "store"
    common = ("--model", model_dir, "--max-model-len", "1024")
    producer = ServeProcess("--config", config(tmp_path, "producer", store), *common)
    consumer = ServeProcess("--config", config(tmp_path, "consumer", store), *common)
    port = free_port()
    proxy = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "baton.cli.main",
            "pd-proxy",
            "--port",
            str(port),
            "--prefill",
            producer.url,
            "--decode",
            consumer.url,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proxy.poll() is None and time.monotonic() < deadline, "pd-proxy did not start"
            time.sleep(0.2)
        yield producer, consumer, url
    finally:
        proxy.terminate()
        proxy.wait(30)
        for serve in (producer, consumer):
            if serve.proc.poll() is None:
                serve.proc.send_signal(signal.SIGTERM)
                serve.wait()


def test_the_consumer_outlives_a_killed_producer(
    pair: tuple[ServeProcess, ServeProcess, str],
) -> None:
    producer, consumer, proxy = pair
    # one engine, no hand-off (the producer: the consumer must not have the prompt cached)
    want = completion(producer.url).json()["choices"][0]["text"]

    through = completion(proxy, prompt=[t + 2 for t in PROMPT])
    assert through.status_code == 200, through.text
    details = through.json()["usage"]["prompt_tokens_details"]
    assert len(PROMPT) - details["cached_tokens"] <= BLOCK

    r = completion(producer.url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    handed = r.json()["kv_transfer_params"]
    for pid in [*producer.engine_pids(), producer.proc.pid]:
        os.kill(pid, signal.SIGKILL)
    producer.proc.wait(30)

    # its blocks were in the store before it answered: they still load
    got = completion(consumer.url, kv_transfer_params=handed)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want
    assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BLOCK

    # params promising blocks of a prompt it never prefilled: load_timeout, then recomputed
    other = [t + 1 for t in PROMPT]
    got = completion(consumer.url, prompt=other, kv_transfer_params=handed)
    assert got.status_code == 200, got.text
    assert not (got.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    want_other = completion(consumer.url, prompt=other).json()["choices"][0]["text"]
    assert got.json()["choices"][0]["text"] == want_other

    r = completion(proxy)
    assert r.status_code == 502 and producer.url in r.json()["error"]["message"]
