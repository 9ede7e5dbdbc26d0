"""Every content-borne exploit of issue 15 is an OpenAI-shaped 400 naming the parameter, never a 500.

Raw JSON over httpx (the openai client would refuse some of these bodies
itself); after each, a normal request on the same server still succeeds.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.plugins.openai.conftest import ServerThread, running_server

MESSAGES = [{"role": "user", "content": "Say something."}]
BIG = 10**20  # above 2**64: msgspec cannot encode it


def post(server: ServerThread, path: str, body: dict[str, Any] | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(
        f"{server.url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def chat(server: ServerThread, **fields: Any) -> httpx.Response:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 3, **fields}
    return post(server, "/v1/chat/completions", body)


def completion(server: ServerThread, **fields: Any) -> httpx.Response:
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 3, **fields}
    return post(server, "/v1/completions", body)


def assert_400(r: httpx.Response, param: str) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"], err
    return err


def assert_still_serving(server: ServerThread) -> None:
    r = chat(server, temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


CHAT_EXPLOITS = [
    (dict(top_k=BIG), "top_k"),
    (dict(top_k=100_000), "top_k"),  # an int32, but above the vocabulary
    (dict(priority=BIG), "priority"),
    (dict(priority=-BIG), "priority"),
    (dict(stop_token_ids=[BIG]), "stop_token_ids"),
    (dict(stop_token_ids=[1_000_000], min_tokens=2), "stop_token_ids"),
    (dict(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs"),
    (dict(chat_template_kwargs={"return_tensors": "np"}), "chat_template_kwargs"),
    (dict(chat_template_kwargs={"return_dict": False}), "chat_template_kwargs"),
    (dict(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
    (dict(chat_template_kwargs={"tokenizer_kwargs": {"x": 1}}), "chat_template_kwargs"),
    (dict(messages=[{"role": "user", "content": "a\udc80b"}]), "messages"),
]


@pytest.mark.parametrize(("fields", "param"), CHAT_EXPLOITS)
def test_chat_exploits_are_400s(server, fields, param):
    assert_400(chat(server, **fields), param)
    assert_still_serving(server)


def test_context_length_is_its_own_code(server):
    err = assert_400(chat(server, max_tokens=5000), "max_tokens")
    assert err["code"] == "context_length_exceeded"
    assert (
        "max_tokens=5000 is too large" in err["message"] and "SamplingParams" not in err["message"]
    )


def test_template_variables_still_pass(server):
    r = chat(server, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "fields", "param", "bound"),
    [
        ("/v1/chat/completions", dict(max_tokens=BIG), "max_tokens", "2147483648"),
        (
            "/v1/chat/completions",
            dict(max_completion_tokens=BIG),
            "max_completion_tokens",
            "2147483648",
        ),
        ("/v1/chat/completions", dict(min_tokens=BIG), "min_tokens", "2147483648"),
        ("/v1/completions", dict(best_of=BIG), "best_of", "128"),
    ],
)
def test_integer_fields_are_bounded_by_the_request_model(server, path, fields, param, bound):
    send = chat if path.endswith("chat/completions") else completion
    err = assert_400(send(server, **fields), param)
    assert bound in err["message"], err  # refused by pydantic, before anything is built
    assert_still_serving(server)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (dict(max_tokens="2"), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(temperature="0.5"), "temperature"),
        (dict(stream=1), "stream"),
        (dict(echo="yes"), "echo"),
        (dict(n=True), "n"),
        (dict(priority=1.0), "priority"),
        (dict(prompt=[[True, False]]), "prompt"),
    ],
)
def test_json_types_are_taken_as_the_schema_states_them(server, fields, param):
    # lax coercion would accept requests the OpenAPI schema calls invalid (schemathesis'
    # negative-data check found "n": true and boolean token ids going through)
    assert_400(completion(server, **{"max_tokens": 2, **fields}), param)
    assert_still_serving(server)


COMPLETION_EXPLOITS = [
    (dict(prompt="\udc80x"), "prompt"),
    (dict(priority=2**63), "priority"),
    (dict(top_k=BIG), "top_k"),
    (dict(stop_token_ids=[49152]), "stop_token_ids"),
]


@pytest.mark.parametrize(("fields", "param"), COMPLETION_EXPLOITS)
def test_completion_exploits_are_400s(server, fields, param):
    assert_400(completion(server, **fields), param)
    assert_still_serving(server)


# ---------------------------------------------------------------------- a model whose template raises


@pytest.fixture(scope="module")
def strict_template_server(model_dir: str, tmp_path_factory) -> Iterator[ServerThread]:
    """The tiny model with a chat template that refuses system messages (raise_exception)."""
    folder = Path(tmp_path_factory.mktemp("strict")) / "model"
    shutil.copytree(model_dir, folder)
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    )
    with running_server(str(folder), max_model_len=256) as srv:
        yield srv


def test_a_template_that_raises_is_a_400(strict_template_server):
    srv = strict_template_server
    messages = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    err = assert_400(chat(srv, messages=messages), "messages")
    assert "the chat template failed" in err["message"]
    assert "System role not supported" in err["message"]
    assert_still_serving(srv)
