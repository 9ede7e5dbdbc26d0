"""A real `baton serve` server (uvicorn on 127.0.0.1, a free port) in a background thread.

The server runs the same code as the command (OpenAIServer.run) with a tiny
random model, so a test pays milliseconds per request; tests talk to it with
the official openai client.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.config import BatonConfig
from baton.processes import is_helper
from baton.testing.tiny_model import tiny_model
from baton_openai.http.server import OpenAIServer

MAX_MODEL_LEN = 1024

#: The tool fixtures every API's tool tests share, each test writing them in its API's shape.
#: Tight enough that a random model constrained by it finishes quickly (no free text, no
#: optional whitespace: any_whitespace is off on these servers).
FORECAST = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "tomorrow": {"type": "boolean"}},
    "required": ["unit", "tomorrow"],
    "additionalProperties": False,
}
#: get_weather's parameters where the city is one of two (the answer is checked against it).
WEATHER_CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
#: A hermes tool call of get_weather, as the model writes it.
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ServerThread:
    """OpenAIServer.run() on its own event loop in a thread; ``stop()`` returns its exit code."""

    def __init__(self, **overrides: Any) -> None:
        self.config = BatonConfig.load(**overrides)
        self.server = OpenAIServer(self.config)
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self._sock = sock
        self.thread = threading.Thread(target=self._main, name="openai-server", daemon=True)
        self.thread.start()
        while not self.server.started.wait(0.1):
            if not self.thread.is_alive():
                raise RuntimeError(f"the server failed to start: {self.error!r}")
        self.url = self.server.url

    def _main(self) -> None:
        try:
            self.exit_code = asyncio.run(self.server.run(self._sock))
        except BaseException as e:
            self.error = e
            raise

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kwargs)

    @property
    def model(self) -> str:
        return self.server.config.server.served_model_name or self.server.config.model.name

    def call(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine (e.g. engine.get_stats()) on the server's loop."""
        assert self.server.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result(timeout)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, parsed with prometheus-client's parser."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(
                    sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
                )
                out[(s.name, labels)] = s.value
        return out

    def stop(self, timeout: float = 60) -> int | None:
        self.server.request_exit()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server did not stop"
        self._sock.close()
        return self.exit_code


def metric(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate: Any, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(tiny_model("llama"))


@contextlib.contextmanager
def running_server(model_dir: str, **overrides: Any) -> Iterator[ServerThread]:
    overrides.setdefault("max_model_len", MAX_MODEL_LEN)
    srv = ServerThread(model=model_dir, **overrides)
    try:
        yield srv
    finally:
        if srv.thread.is_alive():
            srv.stop()


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerThread]:
    """One inproc server per test module (the engine on a thread of this process)."""
    with running_server(model_dir) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return server.client()


def engine_children() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != psutil.STATUS_ZOMBIE and not is_helper(p):
                out.append(p)
    return out
