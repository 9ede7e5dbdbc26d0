"""Prefill/decode disaggregation over HTTP: a producer server, a consumer server and the
``pd-proxy`` app between them (real servers on 127.0.0.1, two engines on the tiny model).

What is checked: the proxy's answer has the greedy tokens one engine gives; the consumer
computes at most the prompt's last partial block (usage.prompt_tokens_details.cached_tokens);
a consumer sent params whose blocks never come answers correctly after its load_timeout; bad
kv_transfer_params are a 400 naming the parameter.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from baton_openai.pd_proxy.app import create_app
from baton_openai.pd_proxy.flow import Upstreams
from tests.plugins.openai.conftest import ServerThread, running_server

BLOCK = 16
#: 5 full blocks and 3 tokens: the consumer must load 5 blocks and compute 3 tokens.
PROMPT = [100 + (7 * i) % 900 for i in range(5 * BLOCK + 3)]
LOAD_TIMEOUT = 1.0


def pd(role: str, path: Path) -> dict[str, Any]:
    return {
        "connector": "pd",
        "role": role,
        "pd": {"path": str(path), "load_timeout": LOAD_TIMEOUT},
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd-store")


@pytest.fixture(scope="module")
def single(model_dir: str) -> Iterator[ServerThread]:
    with running_server(model_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def producer(model_dir: str, store: Path) -> Iterator[ServerThread]:
    with running_server(model_dir, kv_transfer=pd("producer", store)) as srv:
        yield srv


@pytest.fixture(scope="module")
def consumer(model_dir: str, store: Path) -> Iterator[ServerThread]:
    with running_server(model_dir, kv_transfer=pd("consumer", store)) as srv:
        yield srv


class ProxyThread:
    """The pd-proxy app under uvicorn on a thread, on a free port of 127.0.0.1."""

    def __init__(self, prefill: str, decode: str) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        app = create_app(Upstreams([prefill], [decode], timeout=60))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self._sock])), daemon=True
        )
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "the proxy failed to start"
            self.thread.join(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self._sock.close()


@pytest.fixture(scope="module")
def proxy(producer: ServerThread, consumer: ServerThread) -> Iterator[ProxyThread]:
    p = ProxyThread(producer.url, consumer.url)
    yield p
    p.stop()


def completion(url: str, **body: Any) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def computed(usage: dict[str, Any]) -> int:
    """Prompt tokens the engine computed (not from its cache or a producer)."""
    details = usage.get("prompt_tokens_details") or {}
    return usage["prompt_tokens"] - details.get("cached_tokens", 0)


def test_the_producer_returns_where_its_prefill_lies(producer: ServerThread) -> None:
    r = completion(producer.url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["num_tokens"] == 5 * BLOCK  # the prompt's full blocks
    assert params["remote_engine_id"] and params["namespace"]
    assert completion(producer.url, max_tokens=1).json()["kv_transfer_params"] is None


def test_producer_then_consumer_gives_one_engines_greedy_tokens(
    single: ServerThread, proxy: ProxyThread
) -> None:
    want = completion(single.url).json()
    got = completion(proxy.url)
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["choices"][0]["text"] == want["choices"][0]["text"]
    assert computed(body["usage"]) <= BLOCK  # the prompt's last partial block, no more
    assert computed(body["usage"]) == len(PROMPT) - 5 * BLOCK


def test_a_streamed_chat_through_the_proxy(single: ServerThread, proxy: ProxyThread) -> None:
    messages = [{"role": "user", "content": "tell me a long story about a lighthouse " * 6}]
    body = {"messages": messages, "max_tokens": 10, "temperature": 0}
    want = httpx.post(f"{single.url}/v1/chat/completions", json=body, timeout=60).json()
    text = []
    usage = None
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=stream, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            for c in chunk["choices"]:
                text.append(c["delta"].get("content") or "")
            usage = chunk.get("usage") or usage
    assert "".join(text) == want["choices"][0]["message"]["content"]
    assert usage is not None and computed(usage) <= BLOCK


def test_params_whose_blocks_never_come_are_recomputed(
    single: ServerThread, producer: ServerThread, consumer: ServerThread
) -> None:
    """A dead producer: its params promise blocks that are not in the store (another prompt
    was prefilled); the consumer waits load_timeout, recomputes, and answers right."""
    other = [5 + t for t in PROMPT]
    r = completion(
        producer.url, prompt=other, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    params = r.json()["kv_transfer_params"]
    want = completion(single.url, prompt=[9 + t for t in PROMPT]).json()
    got = completion(consumer.url, prompt=[9 + t for t in PROMPT], kv_transfer_params=params)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert computed(got.json()["usage"]) == len(PROMPT)  # nothing came: all recomputed


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"do_remote_prefill": True, "num_tokens": "many"}, "is not a pd hand-off"),
        (
            {
                "do_remote_prefill": True,
                "remote_engine_id": "p",
                "num_tokens": 16,
                "namespace": "x",
            },
            "is another model",
        ),
    ],
)
def test_bad_params_are_a_400(consumer: ServerThread, params: dict[str, Any], match: str) -> None:
    r = completion(consumer.url, kv_transfer_params=params)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert match in err["message"] and err["param"] == "kv_transfer_params"


def test_a_producer_refuses_to_load_and_a_consumer_to_save(
    producer: ServerThread, consumer: ServerThread
) -> None:
    r = completion(producer.url, kv_transfer_params={"do_remote_prefill": True})
    assert r.status_code == 400 and "send the request to a consumer engine" in r.text
    r = completion(consumer.url, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 400 and "send the request to a producer engine" in r.text


def test_the_server_refuses_params_it_cannot_hand_over(single: ServerThread) -> None:
    for body, param in (
        ({"kv_transfer_params": {"do_remote_decode": True}, "n": 2}, "n"),
        (
            {"kv_transfer_params": {"do_remote_decode": True}, "prompt": ["a", "b"]},
            "kv_transfer_params",
        ),
        ({"kv_transfer_params": ["not", "an", "object"]}, "kv_transfer_params"),
    ):
        r = completion(single.url, **body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param


def test_the_proxy_refuses_params_of_the_client(proxy: ProxyThread) -> None:
    r = completion(proxy.url, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = completion(proxy.url, prompt=["one", "two"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_the_proxy_passes_an_engines_refusal_on(proxy: ProxyThread) -> None:
    r = completion(proxy.url, temperature=7)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
