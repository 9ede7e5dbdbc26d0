"""Tools with the real default model (SmolLM2-135M-Instruct) through the openai client: the
constrained tool choices give calls whose arguments are valid and sensible."""

from __future__ import annotations

import json

import jsonschema
import pytest

from .conftest import ServerThread

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": WEATHER,
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_smollm2_calls_a_tool_over_http(default_model_dir):
    srv = ServerThread(
        served_model_name="smollm2", **{"structured_output.xgrammar.any_whitespace": False}
    )
    try:
        client = srv.client()
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = client.chat.completions.create(
                model="smollm2",
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=choice,
                max_tokens=60,
                temperature=0,
            )
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
            (call,) = r.choices[0].message.tool_calls
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, WEATHER)
            assert call.function.name == "get_weather" and "Paris" in args["city"], args
            chunks = client.chat.completions.create(
                model="smollm2",
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=choice,
                max_tokens=60,
                temperature=0,
                stream=True,
            )
            name, arguments = "", ""
            for c in chunks:
                for t in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                    name += t.function.name or ""
                    arguments += t.function.arguments or ""
            assert name == "get_weather" and json.loads(arguments) == args
    finally:
        assert srv.stop() == 0
