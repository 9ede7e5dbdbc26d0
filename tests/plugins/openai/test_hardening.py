"""A responsive server: client-controlled work off the event loop, bounded, and no torn connections.

/health must answer within 100 ms (the acceptance criterion) while a client template
loops forever, a huge prompt or chat is refused by a prefix or the engine is busy; an unexpected
exception is one 500 on a connection that keeps serving; an empty API key is refused;
a non-loopback address without a key warns; a busy port fails before the model loads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import psutil
import pytest
from fastapi.responses import StreamingResponse

from baton import AsyncLLM
from baton.cli.main import main as baton_main
from baton.config import BatonConfig
from baton.errors import ConfigError
from baton_openai.http import address
from baton_openai.http.server import OpenAIServer

from .conftest import running_server
from .probes import (
    HealthProbe,
    Response,
    connect,
    exchange_or_error,
    probed,
    read_response,
    request_bytes,
    timed_exchange,
)

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]
#: 10^10 iterations: Jinja's sandbox caps range() at 100000, not the nesting.
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
SIMPLE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ eos_token }}"
PREPROCESS_TIMEOUT = 1.0


def chat(srv, timeout: float = 60, **body) -> httpx.Response:
    body = {"model": srv.model, "messages": MESSAGES, "max_tokens": 4, **body}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def sandboxed(model_dir):
    with running_server(
        model_dir, allow_client_chat_template=True, preprocess_timeout=PREPROCESS_TIMEOUT
    ) as srv:
        yield srv


def app_of(srv):
    assert srv.server.uvicorn is not None
    return srv.server.uvicorn.config.app


def sandbox_of(srv):
    return app_of(srv).state.baton.preprocess.sandbox


# ---------------------------------------------------------------------- client templates


@pytest.mark.parametrize(
    "body",
    [{"chat_template": SIMPLE}, {"chat_template_kwargs": {"chat_template": SIMPLE}}],
    ids=["top-level", "in-kwargs"],
)
def test_client_template_is_refused_by_default(server, body):
    r = chat(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and err["code"] == "unsupported_parameter"
    assert "server.allow_client_chat_template" in err["message"]


def test_endless_client_template_is_stopped_its_process_replaced(sandboxed):
    assert chat(sandboxed, chat_template=SIMPLE).status_code == 200  # a worker is up
    sandbox = sandbox_of(sandboxed)
    first = sandbox.idle_pids[-1]  # the one the next template goes to
    killed, started = len(sandbox.killed), len(sandbox.started)
    with HealthProbe(sandboxed.url) as probe:
        t0 = time.monotonic()
        r = chat(sandboxed, chat_template=ENDLESS)
        took = time.monotonic() - t0
        time.sleep(0.2)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "preprocess_timeout" and err["param"] == "chat_template"
    assert "server.preprocess_timeout" in err["message"]
    assert took < PREPROCESS_TIMEOUT + 1.0, took
    probe.check()
    assert sandbox.killed[killed:] == [first]
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE
    r = chat(sandboxed, chat_template=SIMPLE)  # the next one gets a fresh process
    assert r.status_code == 200, r.text
    assert len(sandbox.started) == started + 1 and sandbox.started[-1] != first


def test_client_template_errors_are_400s(sandboxed):
    r = chat(sandboxed, chat_template="{{ raise_exception('no system messages, please') }}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "no system messages, please" in r.json()["error"]["message"]
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    r = chat(sandboxed, chat_template=escape)
    assert r.status_code == 400 and "unsafe" in r.json()["error"]["message"]
    r = chat(sandboxed, chat_template=SIMPLE, chat_template_kwargs={"tokenize": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_prompt_ids_are_the_model_template_token_for_token(sandboxed, monkeypatch):
    """The server's path gives what apply_chat_template gives; the model's own template sent
    by the client renders in the sandbox to the same ids and the same greedy answer."""
    engine = sandboxed.server.engine
    tokenizer = engine.tokenizer
    seen: list[list[int]] = []
    generate = engine.generate

    def spy(prompt, *args, **kwargs):  # the server passes a CheckedRequest (checked once)
        seen.append(list(prompt.prompt_token_ids))
        return generate(prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    ours = chat(sandboxed, **greedy)
    theirs = chat(sandboxed, chat_template=tokenizer.chat_template, **greedy)
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert seen == [expected, expected]
    assert ours.json()["choices"][0]["message"] == theirs.json()["choices"][0]["message"]


# ---------------------------------------------------------------------- preprocessing


def long_chat(srv, repeat: int, **fields) -> bytes:
    """A chat request with one long message (the server's template could drop any message, so
    only the rendered chat says how long the prompt is)."""
    message = "All work and no play makes Jack a dull boy. " * repeat
    body = {"model": srv.model, "messages": [{"role": "user", "content": message}], **fields}
    return httpx.Request("POST", "/", json=body).read()


@pytest.mark.parametrize("template", ["server", "client"])
def test_huge_chat_message_is_refused_by_a_prefix_of_the_rendered_chat(sandboxed, template):
    """A 2 MB message (~500k tokens, the context is 1k): refused by counting a prefix of the
    rendered chat, not by tokenizing all of it (which kept a worker busy for seconds)."""
    fields = {"chat_template": SIMPLE} if template == "client" else {}
    body = request_bytes("POST", "/v1/chat/completions", long_chat(sandboxed, 45_000, **fields))
    r, took = timed_exchange(sandboxed.url, body)
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err
    assert (
        "the rendered chat has more than" in err["message"]
        and "model.max_model_len" in (err["message"])
    )
    assert took < 1.0, took


#: the Responses and Messages APIs' bodies around one long user message, and how each
#: names the field in its error shape
AGENT_APIS = {
    "/v1/responses": lambda text: {"input": text, "max_output_tokens": 4},
    "/v1/messages": lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 4},
    "/v1/messages/count_tokens": lambda text: {"messages": [{"role": "user", "content": text}]},
}


def api_error(path: str, body: dict) -> tuple[str, str]:
    """(type or code, message) of an error in the shape of ``path``'s API."""
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]["type"], body["error"]["message"]
    return body["error"]["code"], body["error"]["message"]


@pytest.mark.parametrize("path", sorted(AGENT_APIS))
def test_huge_message_on_the_agent_apis_is_refused_by_a_prefix(server, path):
    """A 2 MB message on /v1/responses and /v1/messages goes the chat's way: refused by a
    prefix of the rendered chat, in the API's own error shape, /health fast meanwhile."""
    text = "All work and no play makes Jack a dull boy. " * 45_000
    body = AGENT_APIS[path](text) | {"model": server.model}
    data = request_bytes("POST", path, httpx.Request("POST", "/", json=body).read())
    r, took = timed_exchange(server.url, data)
    assert r.status == 400, r.body
    kind, message = api_error(path, r.json())
    assert kind in ("context_length_exceeded", "invalid_request_error"), r.body
    assert "model.max_model_len" in message and took < 1.0, (message, took)
    assert not server.server.engine.errored


@pytest.mark.parametrize("path", sorted(AGENT_APIS))
def test_oversized_and_overlong_bodies_on_the_agent_apis_are_refused_in_their_shape(server, path):
    too_big = request_bytes(
        "POST", path, b"{}", headers={"content-length": str(9 * 1024**2)}
    )  # refused from the headers: the body is never read
    r = exchange_or_error(server.url, too_big)
    assert isinstance(r, Response) and r.status == 413
    kind, message = api_error(path, r.json())
    assert kind in ("request_too_large",) and "server.max_request_bytes" in message
    # more items than a request may carry: a 400 from the bound, before any of them is read
    many = AGENT_APIS[path]("hi")
    key = "input" if path == "/v1/responses" else "messages"
    many[key] = [{"role": "user", "content": "hi"}] * 5000
    r2 = httpx.post(f"{server.url}{path}", json={"model": server.model, **many}, timeout=60)
    assert r2.status_code == 400, r2.text
    assert key in api_error(path, r2.json())[1]


def test_an_unhandled_error_under_v1_messages_is_an_anthropic_shaped_500(server, caplog):
    async def boom() -> None:
        raise RuntimeError("kaboom")

    app_of(server).add_api_route("/v1/messages/test-boom", boom)
    caplog.set_level(logging.ERROR)
    r = httpx.get(f"{server.url}/v1/messages/test-boom", timeout=10)
    assert r.status_code == 500
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    assert "kaboom" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/messages/no-such-route", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.fixture
def slow_tokenizer(monkeypatch):
    """Make a server's tokenization take ``seconds`` (a sleep first). Nothing a client sends
    is that slow any more (long texts are refused by a prefix), but the limits must hold."""

    def slow_down(srv, seconds: float) -> None:
        processor = srv.server.engine.input_processor
        encode = processor.encode

        def slow(*args, **kwargs):
            time.sleep(seconds)
            return encode(*args, **kwargs)

        monkeypatch.setattr(processor, "encode", slow)

    return slow_down


def test_huge_text_prompt_is_refused_by_its_prefix(server):
    prompt = "All work and no play makes Jack a dull boy. " * 140_000  # ~6 MB, under the limit
    body = request_bytes(
        "POST",
        "/v1/completions",
        httpx.Request("POST", "/", json={"prompt": prompt, "max_tokens": 1}).read(),
    )
    r, took = timed_exchange(server.url, body)
    assert r.status == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.body
    assert "model.max_model_len" in r.json()["error"]["message"]
    assert took < 2.0, took  # not the ~7 s that tokenizing 6 MB takes


def test_preprocessing_over_its_time_limit_is_a_400_naming_the_setting(sandboxed, slow_tokenizer):
    slow_tokenizer(sandboxed, 3 * PREPROCESS_TIMEOUT)
    t0 = time.monotonic()
    r = chat(sandboxed)
    assert time.monotonic() - t0 < PREPROCESS_TIMEOUT + 1.0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "preprocess_timeout" and err["param"] == "messages"
    assert "server.preprocess_timeout" in err["message"]


def test_no_free_worker_is_a_503(model_dir, slow_tokenizer):
    with running_server(model_dir, preprocess_workers=1, preprocess_timeout=0.5) as srv:
        slow_tokenizer(srv, 2.0)
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(chat(srv))) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(60)
        codes = sorted((r.status_code, r.json()["error"]["code"]) for r in results)
        assert codes == [(400, "preprocess_timeout"), (503, "server_busy")], codes
        busy = next(r for r in results if r.status_code == 503).json()["error"]["message"]
        assert "server.preprocess_workers" in busy


def test_four_10mb_bodies_are_refused_with_the_default_limit(server):
    """The attack as found (four 10 MB bodies froze /health for 10 s): 413s from the headers."""
    prompt = "All work and no play makes Jack a dull boy. " * 238_000
    data = request_bytes(
        "POST",
        "/v1/completions",
        httpx.Request("POST", "/", json={"prompt": prompt, "max_tokens": 1}).read(),
    )
    results: list[object] = []
    probe = probed(
        server.url, lambda: results.append(exchange_or_error(server.url, data)), copies=4
    )
    statuses = [r.status if isinstance(r, Response) else r for r in results]
    assert statuses == [413] * 4
    probe.check()


def test_health_does_not_wait_for_a_busy_engine_step(server):
    client = server.client()

    def generate() -> None:
        client.completions.create(
            model=server.model,
            prompt="Once upon a time " * 200,
            max_tokens=200,  # long enough for the probe to sample it (20 took < 0.1 s)
            extra_body={"ignore_eos": True},
        )

    threads = [threading.Thread(target=generate) for _ in range(4)]
    with HealthProbe(server.url) as probe:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    probe.check()


# ---------------------------------------------------------------------- unhandled errors


def test_unhandled_exception_is_one_500_and_the_connection_keeps_serving(server, caplog):
    async def boom() -> None:
        raise RuntimeError("kaboom")

    app_of(server).add_api_route("/test/boom", boom)
    caplog.set_level(logging.ERROR)
    sock = connect(server.url)
    sock.sendall(request_bytes("GET", "/test/boom"))
    r = read_response(sock)
    assert r.status == 500 and "connection" not in r.headers
    err = r.json()["error"]
    assert err["code"] == "internal_error" and "kaboom" in err["message"]
    sock.sendall(request_bytes("GET", "/health"))  # the same keep-alive connection
    assert read_response(sock).status == 200
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert len(tracebacks) == 1 and "kaboom" in str(tracebacks[0].exc_info[1])
    assert not any("Exception in ASGI application" in rec.getMessage() for rec in caplog.records)


def test_exception_mid_stream_ends_the_stream_with_one_traceback(server, caplog):
    async def chunks():
        yield b"data: one\n\n"
        raise RuntimeError("mid-stream")

    async def stream() -> StreamingResponse:
        return StreamingResponse(chunks(), media_type="text/event-stream")

    app_of(server).add_api_route("/test/stream-boom", stream)
    caplog.set_level(logging.ERROR)
    with (
        pytest.raises(httpx.RemoteProtocolError),  # truncated: no final chunk
        httpx.stream("GET", f"{server.url}/test/stream-boom", timeout=10) as r,
    ):
        assert r.status_code == 200
        for _ in r.iter_bytes():
            pass
    time.sleep(0.2)
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert len(tracebacks) == 1 and "mid-stream" in str(tracebacks[0].exc_info[1])
    assert httpx.get(f"{server.url}/health").status_code == 200


# ---------------------------------------------------------------------- start-up checks


def test_empty_api_key_is_refused(capsys):
    for key in ("", "   "):
        with pytest.raises(ConfigError, match=r"server\.api_key"):
            BatonConfig.load(api_key=key)
    with pytest.raises(SystemExit) as exit_info:
        baton_main(["serve", "--api-key", ""])
    assert exit_info.value.code == 2
    assert "--api-key" in capsys.readouterr().err


class _NoModel(Exception):
    pass


@pytest.fixture
def no_model(monkeypatch):
    """AsyncLLM.create fails at once (and records that it was called): start-up up to the load."""
    calls: list[object] = []

    async def create(cls, config=None, **kwargs):
        calls.append(config)
        raise _NoModel

    monkeypatch.setattr(AsyncLLM, "create", classmethod(create))
    return calls


def test_non_loopback_address_without_api_key_warns(model_dir, no_model, caplog):
    cases = [
        ({"host": "0.0.0.0"}, True),
        ({"host": "0.0.0.0", "api_key": "k"}, False),
        ({"host": "127.0.0.1"}, False),
    ]
    for settings, warns in cases:
        caplog.clear()
        config = BatonConfig.load(model=model_dir, port=0, **settings)
        with caplog.at_level(logging.WARNING, logger="baton_openai"), pytest.raises(_NoModel):
            asyncio.run(OpenAIServer(config).run())
        assert ("without an API key" in caplog.text) is warns, settings


def test_busy_port_fails_before_the_model_loads(model_dir, no_model):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        config = BatonConfig.load(model=model_dir, port=port)
        with pytest.raises(address.BindError, match=rf"127\.0\.0\.1:{port}.*another process"):
            asyncio.run(OpenAIServer(config).run())
        assert no_model == []
    finally:
        taken.close()
