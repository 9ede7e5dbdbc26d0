"""Large JSON bodies under server.max_request_bytes do not stop the event loop.

Four bodies of 1.2M token ids (7.6 MiB each) froze /health for 2.5 s, four chats of
150k messages for 3.2 s: the JSON parse and the validation ran on the event loop in
one piece each. Now a large body is decoded in pieces (http/json_body.py) and every list a
request may make long is bounded before its items are validated (protocol/openai.py), so
/health answers within 100 ms and each body gets a 400 naming its parameter.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from baton_openai.protocol.openai import (
    MAX_FIELDS,
    MAX_ITEMS,
    MAX_MESSAGE_FIELDS,
    MAX_MESSAGES,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
)

from .probes import exchange, probed, request_bytes

IDS = 1_200_000  # more than MAX_PROMPT_TOKENS; 7.6 MiB as JSON, under the 8 MiB default limit


def four_at_once(srv, path: str, body: dict[str, Any]) -> tuple[list[Any], float]:
    """Four copies of ``body`` sent at once while /health is probed: (the errors, the worst
    /health latency in seconds)."""
    data = request_bytes("POST", path, json.dumps(body).encode())
    assert len(data) < 8 * 1024**2
    errors: list[Any] = []
    # FastAPI builds some of a route's validation on its first error (~40 ms, once): not measured
    httpx.post(f"{srv.url}{path}", json={}, timeout=30)

    def send() -> None:
        r = exchange(srv.url, data)
        errors.append((r.status, r.json()["error"]))

    return errors, probed(srv.url, send, copies=4).check()


def test_four_bodies_of_a_million_token_ids(server):
    prompt = [i % 30_000 for i in range(IDS)]
    errors, _ = four_at_once(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert len(errors) == 4
    for status, err in errors:
        assert status == 400 and err["param"] == "prompt", err
        assert f"at most {MAX_PROMPT_TOKENS} token ids" in err["message"], err


def test_four_chats_of_150k_messages(server):
    messages = [{"role": "user", "content": "x"}] * 150_000
    errors, _ = four_at_once(server, "/v1/chat/completions", {"messages": messages})
    assert len(errors) == 4
    for status, err in errors:
        assert status == 400 and err["param"] == "messages", err
        assert f"at most {MAX_MESSAGES} items" in err["message"], err


def test_a_prompt_longer_than_the_context_is_refused_by_its_length(server):
    """Under MAX_PROMPT_TOKENS, still far over model.max_model_len: refused before its ids are
    checked one by one (a million took ~0.3 s of a preprocessing worker)."""
    t0 = time.monotonic()
    r = post(server, "/v1/completions", prompt=[5] * (MAX_PROMPT_TOKENS - 1), max_tokens=1)
    assert time.monotonic() - t0 < 2.0
    err = assert_400(r, "prompt")
    assert err["code"] == "context_length_exceeded" and "1048575 tokens" in err["message"], err


def post(srv, path: str, **body: Any) -> httpx.Response:
    body.setdefault("model", srv.model)
    return httpx.post(f"{srv.url}{path}", json=body, timeout=60)


def assert_400(r: httpx.Response, param: str | None) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


MESSAGE = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/chat/completions", dict(messages=[MESSAGE] * (MAX_MESSAGES + 1)), "messages", ""),
        ("/v1/completions", dict(prompt=["hi"] * (MAX_PROMPTS + 1)), "prompt", "prompts"),
        ("/v1/completions", dict(prompt=[[1]] * (MAX_PROMPTS + 1)), "prompt", "prompts"),
        ("/v1/completions", dict(prompt=[[1] * (MAX_PROMPT_TOKENS + 1)]), "prompt", "token ids"),
        ("/v1/completions", dict(prompt="hi", stop=["x"] * (MAX_ITEMS + 1)), "stop", ""),
        (
            "/v1/completions",
            dict(prompt="hi", logit_bias={str(i): 1.0 for i in range(MAX_ITEMS + 1)}),
            "logit_bias",
            "",
        ),
        (
            "/v1/chat/completions",
            dict(messages=[{**MESSAGE, **{f"x{i}": 1 for i in range(MAX_MESSAGE_FIELDS)}}]),
            "messages",
            "messages[0] has",
        ),
        (
            "/v1/completions",
            dict(prompt="hi", **{f"x{i}": 1 for i in range(MAX_FIELDS)}),
            None,
            "the request has",
        ),
    ],
    ids=[
        "messages",
        "prompts",
        "id-prompts",
        "ids",
        "stop",
        "logit_bias",
        "message-fields",
        "request-fields",
    ],
)
def test_a_list_over_its_bound_is_a_400_naming_the_param(server, path, body, param, says):
    err = assert_400(post(server, path, **body), param)
    assert says in err["message"], err


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ([1, "two"], "item 1 is 'two'"),
        ([[1], "two"], "has item 1 of type str"),
        (["one", 2], "has item 1 of type int"),
        ([1.5], "first item is float"),
        ([True], "first item is bool"),
        ({"a": 1}, "got dict"),
        ([-1], "outside the vocabulary"),
    ],
)
def test_prompt_shapes_are_checked_cheaply_and_each_id_later(server, prompt, says):
    err = assert_400(post(server, "/v1/completions", prompt=prompt, max_tokens=1), "prompt")
    assert says in err["message"], err


@pytest.mark.parametrize(
    ("prompt", "choices"),
    [("Hello", 1), (["Hello", "World"], 2), ([1, 2, 3], 1), ([[1, 2], [3, 4, 5]], 2)],
)
def test_every_prompt_shape_still_generates(server, prompt, choices):
    r = post(server, "/v1/completions", prompt=prompt, max_tokens=2)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == choices


def test_many_bad_items_make_a_short_message(server):
    r = post(server, "/v1/chat/completions", messages=[{"content": "no role"}] * MAX_MESSAGES)
    err = assert_400(r, "messages")
    assert err["message"].endswith(f"and {MAX_MESSAGES - 10} more errors"), err["message"][-200:]
    assert len(err["message"]) < 2000
    r = post(server, "/v1/completions", prompt="hi", n="x" * 1_000_000)
    err = assert_400(r, "n")
    assert len(err["message"]) < 300, len(err["message"])  # the value is not echoed whole
