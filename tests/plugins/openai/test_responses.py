"""OpenAI's Responses API (/v1/responses) through the official openai SDK against a real
server (issue 33 item 1): responses.create / stream / parse / retrieve / delete.

The tiny random model cannot decide to call a tool or to reason, so those answers are
forced with vLLM's structured_outputs (a choice of one text) and the test checks what
the server reads out of them; tool_choice required and a named function are enforced by
the server's grammar, so their arguments must validate whatever the model writes.
Whether an earlier turn is in context is told by token counts: a continued response's
``input_tokens`` equals /tokenize of the whole conversation in chat's shape.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from baton_openai.endpoints.response_store import ResponseStore
from baton_openai.protocol.openai import ChatMessage
from baton_openai.protocol.responses import ResponseObject

from .conftest import CALL, FORECAST, WEATHER_CITY, ServerThread, running_server

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER_CITY,
    },
    {"type": "function", "name": "forecast", "parameters": FORECAST},
]
FORCED = {
    "structured_outputs": {"choice": [f"<think>Paris is in France.</think>Let me check.\n{CALL}"]}
}


@pytest.fixture(scope="module")
def srv(model_dir: str) -> Iterator[ServerThread]:
    with running_server(
        model_dir,
        **{
            "server.reasoning_parser": "think",
            "structured_output.xgrammar.any_whitespace": False,
        },
    ) as s:
        yield s


@pytest.fixture
def client(srv: ServerThread) -> openai.OpenAI:
    return srv.client()


def create(client, srv, **kwargs):
    kwargs.setdefault("input", "What is the weather in Paris?")
    kwargs.setdefault("temperature", 0)
    return client.responses.create(model=srv.model, **kwargs)


def stream(client, srv, **kwargs) -> tuple[list, object]:
    """Every event of a streamed response, and the last one's response."""
    kwargs.setdefault("input", "What is the weather in Paris?")
    kwargs.setdefault("temperature", 0)
    with client.responses.stream(model=srv.model, **kwargs) as s:
        events = list(s)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, events[-1].response


def tokenize_chat(srv, messages: list[dict], tools: list[dict] | None = None) -> int:
    body = {"messages": messages}
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {k: v for k, v in t.items() if k != "type"},
            }
            for t in tools
        ]
    r = httpx.post(f"{srv.url}/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_cut_short_text_is_incomplete_streamed_or_not(srv, client):
    r = create(client, srv, max_output_tokens=8, instructions="Be terse.")
    assert r.object == "response" and r.model == srv.model
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and r.output_text
    assert r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.input_tokens == tokenize_chat(
        srv,
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "What is the weather in Paris?"},
        ],
    )

    events, final = stream(client, srv, max_output_tokens=8, instructions="Be terse.")
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == r.output_text
    assert final.status == "incomplete" and final.usage.output_tokens == 8


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
def test_text_format_json_schema_constrains_the_answer(srv, client, streamed):
    text = {"format": {"type": "json_schema", "name": "forecast", "schema": FORECAST}}
    if streamed:
        _, r = stream(client, srv, text=text, max_output_tokens=60)
    else:
        r = create(client, srv, text=text, max_output_tokens=60)
    assert r.status == "completed" and r.incomplete_details is None
    jsonschema.validate(json.loads(r.output_text), FORECAST)
    assert r.text.format.type == "json_schema"


def test_the_sdks_parse_helper_reads_a_pydantic_answer(srv, client):
    class Forecast(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        unit: Literal["celsius", "fahrenheit"]
        tomorrow: bool

    r = client.responses.parse(
        model=srv.model,
        input="Forecast?",
        text_format=Forecast,
        max_output_tokens=60,
    )
    assert isinstance(r.output_parsed, Forecast)
    with client.responses.stream(
        model=srv.model, input="Forecast?", text_format=Forecast, max_output_tokens=60
    ) as s:
        final = s.get_final_response()
    assert isinstance(final.output_parsed, Forecast)


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
def test_reasoning_text_and_a_call_are_three_output_items(srv, client, streamed):
    kwargs = {"tools": TOOLS, "max_output_tokens": 120, "extra_body": FORCED}
    if streamed:
        events, r = stream(client, srv, **kwargs)
        kinds = {e.type for e in events}
        assert {
            "response.reasoning_text.delta",
            "response.output_text.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
        } <= kinds
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert added == ["reasoning", "message", "function_call"]
    else:
        r = create(client, srv, **kwargs)
    assert r.status == "completed"
    reasoning, message, call = r.output
    assert reasoning.type == "reasoning"
    assert reasoning.content[0].text == "Paris is in France."
    assert message.content[0].text.strip() == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
def test_named_function_arguments_follow_its_schema(srv, client, streamed):
    kwargs = {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "name": "forecast"},
        "max_output_tokens": 60,
    }
    if streamed:
        events, r = stream(client, srv, **kwargs)
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert "".join(deltas) == done.arguments == r.output[0].arguments
    else:
        r = create(client, srv, **kwargs)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "forecast"
    jsonschema.validate(json.loads(call.arguments), FORECAST)


def test_required_calls_one_tool_and_the_loop_continues(srv, client):
    tools_kw = {"tools": TOOLS, "max_output_tokens": 60}
    r = create(client, srv, tool_choice="required", parallel_tool_calls=False, **tools_kw)
    (call,) = r.output
    schema = {t["name"]: t["parameters"] for t in TOOLS}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    follow = create(
        client, srv, input=[result], previous_response_id=r.id, max_output_tokens=4, tools=TOOLS
    )
    assert follow.previous_response_id == r.id
    # the same conversation sent whole, as items, renders to the same prompt
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        result,
    ]
    whole = create(client, srv, input=items, max_output_tokens=4, tools=TOOLS)
    assert whole.usage.input_tokens == follow.usage.input_tokens
    chat = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]
    assert follow.usage.input_tokens == tokenize_chat(srv, chat, TOOLS)


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
def test_previous_response_id_puts_the_earlier_turn_in_context(srv, client, streamed):
    first_kw = {"input": "Hi!", "instructions": "Be terse.", "max_output_tokens": 6}
    first = stream(client, srv, **first_kw)[1] if streamed else create(client, srv, **first_kw)
    second = create(
        client, srv, input="And then?", previous_response_id=first.id, max_output_tokens=4
    )
    # the instructions are not carried over (OpenAI's rule); the answer is
    want = tokenize_chat(
        srv,
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert second.usage.input_tokens == want > first.usage.input_tokens
    third = create(client, srv, input="Go on.", previous_response_id=second.id, max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens - 2


def test_stored_responses_are_retrieved_and_deleted(srv, client):
    r = create(client, srv, max_output_tokens=4, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = create(client, srv, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        create(client, srv, previous_response_id=unstored.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "response_not_found"


@pytest.mark.parametrize(
    ("body", "param", "where"),
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input", "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "input.0"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "tools.0"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice", "tool_choice"),
        ({"input": "hi", "background": True}, "background", "background"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation", "conversation"),
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens", "max_output_tokens"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema",
            "schema",
        ),
    ],
    ids=[
        "item-type",
        "part-type",
        "tool-type",
        "choice-without-tools",
        "background",
        "conversation",
        "too-long",
        "format-without-schema",
    ],
)
def test_bad_requests_are_400s_naming_the_field(srv, body, param, where):
    r = httpx.post(f"{srv.url}/v1/responses", json={"model": srv.model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and where in err["message"], err


def test_unknown_item_type_message_names_the_accepted_ones(srv):
    body = {"input": [{"role": "user", "content": "hi"}, {"type": "computer_call"}]}
    r = httpx.post(f"{srv.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("input.1: unknown item type") and "function_call_output" in message


def test_the_store_drops_the_oldest_past_its_size_and_any_past_its_age():
    def response(i: int) -> ResponseObject:
        return ResponseObject(id=f"resp-{i}", status="completed", model="m")

    history = [ChatMessage(role="user", content="x" * 100)]
    one = len(response(0).model_dump_json()) + len(history[0].model_dump_json())
    store = ResponseStore(max_bytes=3 * one, ttl=60)
    for i in range(5):
        assert store.put(response(i), history)
    assert [i for i in range(5) if store.get(f"resp-{i}")] == [2, 3, 4]
    assert store.bytes == 3 * one and len(store) == 3
    assert not store.put(response(9), history * 30)  # larger than the whole store: not kept
    assert store.delete("resp-3") and not store.delete("resp-3") and store.bytes == 2 * one
    short = ResponseStore(max_bytes=10 * one, ttl=0.05)
    short.put(response(0), history)
    assert short.get("resp-0") is not None
    time.sleep(0.1)
    assert short.get("resp-0") is None and short.bytes == 0


def test_a_small_store_forgets_old_responses_over_http(model_dir):
    with running_server(model_dir, **{"server.response_store_max_bytes": 3000}) as s:
        c = s.client()
        ids = [
            c.responses.create(model=s.model, input="Hi", max_output_tokens=2).id for _ in range(4)
        ]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[0])
        assert c.responses.retrieve(ids[-1]).id == ids[-1]
