"""Tools and reasoning through HTTP with the official openai client (issue 16 item 1).

A tiny random model cannot decide to call a tool, so the auto-mode tests make its
answer a call with a structured-output constraint (guided_choice) and check what the
server reads out of it; required and named tool_choice are constrained by the server
itself, so their arguments must parse against the schema whatever the model. The
chat template of these models (SmolLM2's) does not render tools: they reach the
prompt through the parser's instructions in the system message, unless a template
that renders them (a client template here) is used.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from baton_openai.parsing.tool_parsers import HermesToolParser
from baton_openai.protocol.openai import ChatTool

from .conftest import CALL, FORECAST, ServerThread, running_server

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
]


@pytest.fixture(scope="module")
def srv(model_dir: str) -> Iterator[ServerThread]:
    with running_server(
        model_dir,
        **{
            "server.reasoning_parser": "think",
            "server.allow_client_chat_template": True,
            "structured_output.xgrammar.any_whitespace": False,
        },
    ) as s:
        yield s


@pytest.fixture
def client(srv: ServerThread) -> openai.OpenAI:
    return srv.client()


def create(client, srv, **kwargs):
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=srv.model, **kwargs)


def accumulate(chunks) -> dict:
    """A streamed answer put together as a client does, with every tool-call delta kept."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "deltas": []}
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            out["content"] += d.content or ""
            out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            for t in d.tool_calls or []:
                out["deltas"].append(t)
                call = out["calls"].setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                if t.id:
                    call["id"] = t.id
                if t.function and t.function.name:
                    call["name"] += t.function.name
                if t.function and t.function.arguments:
                    call["arguments"] += t.function.arguments
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_auto_reads_hermes_calls_non_streamed_and_streamed(srv, client):
    forced = {"guided_choice": [f"Let me check.\n{CALL}"]}
    r = create(client, srv, tools=TOOLS, max_tokens=200, extra_body=forced)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    got = accumulate(
        create(client, srv, tools=TOOLS, max_tokens=200, extra_body=forced, stream=True)
    )
    assert got["content"].strip() == "Let me check." and got["finish"] == "tool_calls"
    assert [c["name"] for c in got["calls"].values()] == ["get_weather"]
    assert json.loads(got["calls"][0]["arguments"]) == {"city": "Paris"}
    first = got["deltas"][0]  # OpenAI's shape: index, id, type and name first, then arguments
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in got["deltas"][1:])


def test_auto_without_a_call_is_content(srv, client):
    r = create(client, srv, tools=TOOLS, max_tokens=20, extra_body={"guided_choice": ["Sunny."]})
    assert r.choices[0].message.content == "Sunny." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_required_constrains_the_answer_to_valid_calls(srv, client):
    for stream in (False, True):
        kwargs = dict(
            tools=[TOOLS[1]], tool_choice="required", parallel_tool_calls=False, max_tokens=60
        )
        if stream:
            got = accumulate(create(client, srv, stream=True, **kwargs))
            calls = [(c["name"], c["arguments"], c["id"]) for c in got["calls"].values()]
            finish = got["finish"]
        else:
            msg = create(client, srv, **kwargs).choices[0]
            calls = [(c.function.name, c.function.arguments, c.id) for c in msg.message.tool_calls]
            finish = msg.finish_reason
        assert finish == "tool_calls"
        ((name, arguments, call_id),) = calls
        assert name == "forecast" and call_id.startswith("call_")
        jsonschema.validate(json.loads(arguments), FORECAST)


def test_named_function_streams_its_arguments(srv, client):
    choice = {"type": "function", "function": {"name": "forecast"}}
    r = create(client, srv, tools=TOOLS, tool_choice=choice, max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "forecast" and r.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), FORECAST)
    got = accumulate(
        create(client, srv, tools=TOOLS, tool_choice=choice, max_tokens=60, stream=True)
    )
    assert got["calls"][0]["name"] == "forecast"
    assert json.loads(got["calls"][0]["arguments"]) == json.loads(call.function.arguments)
    assert len(got["deltas"]) > 2  # the arguments come in fragments, token by token


class Forecast(pydantic.BaseModel):
    """FORECAST as the openai SDK's pydantic_function_tool writes it (strict)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    unit: Literal["celsius", "fahrenheit"]
    tomorrow: bool


def test_the_sdks_own_helpers_read_the_calls(srv, client):
    # the SDK, not this file, puts the streamed deltas together and parses the arguments
    tool = openai.pydantic_function_tool(Forecast, name="forecast")
    kwargs = dict(
        model=srv.model,
        messages=MESSAGES,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "forecast"}},
        max_tokens=60,
        temperature=0,
    )
    with client.chat.completions.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events
    assert "tool_calls.function.arguments.done" in events
    (call,) = streamed.choices[0].message.tool_calls
    assert call.function.name == "forecast" and call.id.startswith("call_")
    assert isinstance(call.function.parsed_arguments, Forecast)
    parsed = client.chat.completions.parse(**kwargs)
    (whole,) = parsed.choices[0].message.tool_calls
    assert parsed.choices[0].finish_reason == streamed.choices[0].finish_reason == "tool_calls"
    assert whole.function.parsed_arguments == call.function.parsed_arguments


def test_none_hides_the_tools(srv, client):
    plain = create(client, srv, max_tokens=1)
    hidden = create(client, srv, tools=TOOLS, tool_choice="none", max_tokens=1)
    shown = create(client, srv, tools=TOOLS, max_tokens=1)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens
    assert shown.usage.prompt_tokens > plain.usage.prompt_tokens


def test_tools_reach_a_template_without_tool_support_as_instructions(srv, client, tokenizer):
    r = create(client, srv, tools=TOOLS, max_tokens=1)
    note = HermesToolParser().instructions([ChatTool.model_validate(t) for t in TOOLS])
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": note}, *MESSAGES], add_generation_prompt=True, tokenize=False
    )
    assert r.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
    # an earlier call and its result are written back in the parser's form
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    r = create(client, srv, tools=TOOLS, messages=history, max_tokens=1)
    expected = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": note},
            *MESSAGES,
            {"role": "assistant", "content": CALL.replace("\n{", "\n{", 1)},
            {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert r.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))


def test_a_template_that_renders_tools_gets_them(srv, client, tokenizer):
    template = (
        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    r = create(client, srv, tools=TOOLS, max_tokens=1, extra_body={"chat_template": template})
    text = f"TOOLS {json.dumps(TOOLS)}\nuser: {MESSAGES[0]['content']}\n"
    assert r.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_reasoning_is_split_non_streamed_and_streamed(srv, client):
    forced = {"guided_choice": ["<think>The user greets me.</think>\nHello there!"]}
    r = create(client, srv, max_tokens=40, extra_body=forced)
    msg = r.choices[0].message
    assert msg.content == "Hello there!"
    assert msg.model_extra["reasoning_content"] == "The user greets me."
    got = accumulate(create(client, srv, max_tokens=40, extra_body=forced, stream=True))
    assert got["reasoning"] == "The user greets me." and got["content"] == "Hello there!"


def test_reasoning_then_a_call(srv, client):
    forced = {"guided_choice": [f"<think>Weather needs a tool.</think>{CALL}"]}
    r = create(client, srv, tools=TOOLS, max_tokens=200, extra_body=forced)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", (msg, r.usage)
    assert msg.model_extra["reasoning_content"] == "Weather needs a tool."
    assert msg.tool_calls[0].function.name == "get_weather" and msg.content is None
    got = accumulate(
        create(client, srv, tools=TOOLS, max_tokens=200, extra_body=forced, stream=True)
    )
    assert got["reasoning"] == "Weather needs a tool." and got["calls"][0]["name"] == "get_weather"


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
        ({"extra_body": {"function_call": "auto"}}, "function_call"),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(srv, client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, srv, max_tokens=1, **kwargs)
    assert info.value.body["param"] == param, info.value.body


def test_json_tool_parser_selected_by_the_server_setting(model_dir):
    with running_server(model_dir, **{"server.tool_call_parser": "json"}) as s:
        forced = {"guided_choice": ['{"name": "get_weather", "arguments": {"city": "Oslo"}}']}
        r = s.client().chat.completions.create(
            model=s.model, messages=MESSAGES, tools=TOOLS, max_tokens=60, extra_body=forced
        )
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
            "city": "Oslo"
        }


def test_an_installed_parser_is_selected_by_name(model_dir, tmp_path, monkeypatch):
    from .test_tool_parsers import write_parser_distribution

    write_parser_distribution(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with running_server(model_dir, **{"server.tool_call_parser": "upper"}) as s:
        forced = {"guided_choice": ['Here.\nCALL get_weather {"city": "Rome"}']}
        r = s.client().chat.completions.create(
            model=s.model, messages=MESSAGES, tools=TOOLS, max_tokens=60, extra_body=forced
        )
        msg = r.choices[0].message
        assert msg.content == "Here." and msg.tool_calls[0].function.arguments == '{"city": "Rome"}'


def test_an_unknown_parser_fails_before_the_model_loads(model_dir):
    import asyncio

    from baton.config import BatonConfig
    from baton.errors import ConfigError
    from baton_openai.http.server import OpenAIServer

    server = OpenAIServer(BatonConfig.load(model=model_dir, **{"server.tool_call_parser": "nope"}))
    with pytest.raises(ConfigError, match="installed: hermes, json"):
        asyncio.run(server.run())
    assert server.engine is None
