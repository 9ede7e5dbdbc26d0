"""/tokenize and /detokenize (vLLM's shapes) against a real server (tiny model, SmolLM2 tokenizer)."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MAX_MODEL_LEN


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_tokenize_a_prompt(server):
    tok = server.server.engine.tokenizer
    r = post(server, "/tokenize", {"model": server.model, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    want = tok.encode("Hello world")
    assert body == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want}


def test_token_strs_and_detokenize_round_trip(server):
    tok = server.server.engine.tokenizer
    body = post(server, "/tokenize", {"prompt": "a b c", "return_token_strs": True}).json()
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    r = post(server, "/detokenize", {"model": server.model, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "a b c"}


def test_tokenize_messages_as_chat_completions_renders_them(server):
    tok = server.server.engine.tokenizer
    messages = [{"role": "user", "content": "What is 2+2?"}]
    body = post(server, "/tokenize", {"messages": messages}).json()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = tok.encode(text, add_special_tokens=False)
    assert body["tokens"] == list(want) and body["count"] == len(want)
    without = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert without.json()["count"] < body["count"]
    # the prompt the chat endpoint counted is the same
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1},
        timeout=30,
    ).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/detokenize", {"tokens": [1, 49152]}, "tokens", "tokens[1] = 49152 is outside"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "greater than or equal to 0"),
        ("/detokenize", {"tokens": "abc"}, "tokens", "list"),
        (
            "/tokenize",
            {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
            None,
            "exactly one",
        ),
        ("/tokenize", {}, None, "exactly one"),
        ("/tokenize", {"prompt": 5}, "prompt", "string"),
        ("/tokenize", {"prompt": "x", "model": "nope"}, "model", "does not exist"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            "only text parts",
        ),
    ],
)
def test_bad_fields_are_400s_naming_them(server, path, body, param, words):
    r = post(server, path, body)
    err = r.json()["error"]
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert err["param"] == param and words in err["message"], err


def test_tokenize_refuses_a_text_far_over_the_context(server):
    r = post(server, "/tokenize", {"prompt": "word " * (40 * MAX_MODEL_LEN)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
