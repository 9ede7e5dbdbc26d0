"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
anthropic SDK against a real server (issue 33 item 2).

The tiny random model cannot decide to call a tool, so tool calls are made with
tool_choice ``any`` or ``tool`` (enforced by the grammar): their ``input`` must validate
against the tool's ``input_schema`` whatever the model. Greedy answers make the streamed
and the non-streamed runs of a request comparable.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest

from .conftest import CALL, FORECAST, WEATHER_CITY, ServerThread, running_server

TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": WEATHER_CITY,
    },
    {"name": "forecast", "input_schema": FORECAST},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
KEY = "sk-anthropic-test"
#: the SDK has no temperature argument (any more); the API still takes it
GREEDY = {"temperature": 0}
#: vLLM's structured_outputs makes the answer this text: reasoning, text, then a call
FORCED = {
    "structured_outputs": {"choice": [f"<think>It is in France.</think>Let me check.\n{CALL}"]}
}


@pytest.fixture(scope="module")
def srv(model_dir: str) -> Iterator[ServerThread]:
    with running_server(
        model_dir,
        **{
            "server.api_key": KEY,
            "server.reasoning_parser": "think",
            "structured_output.xgrammar.any_whitespace": False,
        },
    ) as s:
        yield s


@pytest.fixture
def client(srv: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60)


def create(client, srv, **kwargs):
    kwargs.setdefault("messages", USER)
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("extra_body", GREEDY)
    return client.messages.create(model=srv.model, **kwargs)


def test_text_answer_non_streamed_and_streamed_agree(srv, client):
    r = create(client, srv, system="You are terse.")
    assert r.type == "message" and r.role == "assistant" and r.model == srv.model
    assert r.id.startswith("msg")
    (block,) = r.content
    assert block.type == "text" and block.text
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert 0 < r.usage.output_tokens <= 16
    counted = client.messages.count_tokens(model=srv.model, messages=USER, system="You are terse.")
    assert r.usage.input_tokens == counted.input_tokens > 0

    with client.messages.stream(
        model=srv.model, messages=USER, system="You are terse.", max_tokens=16, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds
    assert kinds[-2] == "message_delta"
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert streamed == final.content[0].text == block.text
    assert final.stop_reason == r.stop_reason
    assert final.usage.output_tokens == r.usage.output_tokens
    assert final.usage.input_tokens == r.usage.input_tokens


def test_max_tokens_and_stop_sequences_are_the_stop_reason(srv, client):
    r = create(client, srv, max_tokens=3)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3
    text = create(client, srv, max_tokens=12).content[0].text
    stop = text[2:5]
    assert len(stop) == 3
    r = create(client, srv, max_tokens=12, stop_sequences=["\u2603", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]
    with client.messages.stream(
        model=srv.model, messages=USER, max_tokens=12, extra_body=GREEDY, stop_sequences=[stop]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_named_tool_is_a_tool_use_block_with_a_valid_input(srv, client, stream):
    kwargs = {
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "forecast"},
        "max_tokens": 60,
    }
    if stream:
        with client.messages.stream(
            model=srv.model, messages=USER, extra_body=GREEDY, **kwargs
        ) as s:
            events = list(s)
            r = s.get_final_message()
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert deltas and all(d.type == "input_json_delta" for d in deltas)
        assert json.loads("".join(d.partial_json for d in deltas)) == r.content[-1].input
    else:
        r = create(client, srv, **kwargs)
    assert r.stop_reason == "tool_use"
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "forecast"
    jsonschema.validate(call.input, FORECAST)


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_auto_reads_thinking_text_and_a_tool_use(srv, client, stream):
    kwargs = {"tools": TOOLS, "max_tokens": 120, "extra_body": {**GREEDY, **FORCED}}
    if stream:
        with client.messages.stream(model=srv.model, messages=USER, **kwargs) as s:
            events = list(s)
            r = s.get_final_message()
        starts = [e.content_block.type for e in events if e.type == "content_block_start"]
        assert starts == ["thinking", "text", "tool_use"]
        stops = [e.index for e in events if e.type == "content_block_stop"]
        assert stops == [0, 1, 2]
    else:
        r = create(client, srv, **kwargs)
    thinking, text, call = r.content
    assert thinking.type == "thinking" and thinking.thinking == "It is in France."
    assert text.type == "text" and text.text.strip() == "Let me check."
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input == {"city": "Paris"}
    assert r.stop_reason == "tool_use"


def test_any_tool_choice_calls_one_of_the_tools(srv, client):
    r = create(
        client,
        srv,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=60,
    )
    assert r.stop_reason == "tool_use"
    (call,) = [b for b in r.content if b.type == "tool_use"]
    schema = {t["name"]: t["input_schema"] for t in TOOLS}[call.name]
    jsonschema.validate(call.input, schema)


def test_none_tool_choice_answers_text(srv, client):
    r = create(client, srv, tools=TOOLS, tool_choice={"type": "none"})
    assert [b.type for b in r.content] == ["text"]
    assert r.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_output_config_format_constrains_the_text_to_the_schema(srv, client, stream):
    kwargs = {"output_config": {"format": {"type": "json_schema", "schema": FORECAST}}}
    if stream:
        with client.messages.stream(
            model=srv.model, messages=USER, max_tokens=60, extra_body=GREEDY, **kwargs
        ) as s:
            r = s.get_final_message()
    else:
        r = create(client, srv, max_tokens=60, **kwargs)
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), FORECAST)


def test_a_tool_result_turn_renders_as_the_chat_template_renders_it(srv, client):
    """count_tokens of a conversation with tool_use / tool_result blocks equals /tokenize of
    the same chat in OpenAI's shape (the one rendering both APIs share)."""
    conversation = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    counted = client.messages.count_tokens(
        model=srv.model, messages=conversation, tools=TOOLS, system="Be brief."
    )
    chat = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    functions = [
        {
            "type": "function",
            "function": {"parameters": t["input_schema"]}
            | {k: t[k] for k in ("name", "description") if k in t},
        }
        for t in TOOLS
    ]
    r = httpx.post(
        f"{srv.url}/tokenize",
        json={"messages": chat, "tools": functions},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert counted.input_tokens == r.json()["count"]
    answer = create(
        client, srv, messages=conversation, tools=TOOLS, system="Be brief.", max_tokens=4
    )
    assert answer.usage.input_tokens == counted.input_tokens


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": USER, "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"messages": USER, "tools": [{"name": "f"}]}, "tools.0.input_schema"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
        ({"messages": USER, "temperature": 5}, "temperature"),
    ],
    ids=["block-type", "role", "tool-without-name", "tool-without-schema", "misplaced", "range"],
)
def test_bad_requests_are_anthropic_shaped_400s_naming_the_field(srv, body, where):
    r = httpx.post(
        f"{srv.url}/v1/messages",
        json={"model": srv.model, "max_tokens": 4, **body},
        headers={"x-api-key": KEY},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert where in got["error"]["message"], got


def test_sdk_errors_keep_their_status_and_shape(srv, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", messages=USER, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=srv.model, messages=USER, max_tokens=4)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": e.value.body["error"]["message"]},
    }
    # the key as Anthropic's clients send it is taken on the OpenAI routes too
    r = httpx.get(f"{srv.url}/v1/models", headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 200
    r = httpx.get(f"{srv.url}/v1/models", headers={"x-api-key": "wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(anthropic.BadRequestError):  # over the model's context
        client.messages.create(model=srv.model, messages=USER, max_tokens=10**6)
