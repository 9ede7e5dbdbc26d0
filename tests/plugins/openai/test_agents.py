"""An agent framework's tool-calling loop over the Responses API against the real `baton serve`
command (issue 33 item 5): the OpenAI Agents SDK (openai-agents) with a function tool.

The tiny random model cannot decide to call a tool, so the agent's first turn has
tool_choice required (the server's grammar makes the call, its argument one of the
tool's enum); the SDK runs the function, sends its output back, resets tool_choice
(its default reset_tool_choice) and the second turn answers with the agent's output_type
(text.format json_schema, which the grammar makes the model finish), which ends the run.
Both the SDK's ways of continuing are run: the whole conversation sent again as items,
and chained with previous_response_id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Literal

import pydantic
import pytest

from baton.testing.tiny_model import tiny_model

from .test_third_party_clients import BatonServe

agents = pytest.importorskip("agents")


@pytest.fixture(scope="module")
def serve() -> Iterator[BatonServe]:
    # no optional whitespace in constrained JSON: a random model's calls end in a few tokens
    with pytest.MonkeyPatch.context() as env:
        env.setenv("BATON_STRUCTURED_OUTPUT__XGRAMMAR__ANY_WHITESPACE", "false")
        s = _serve()
    try:
        yield s
    finally:
        s.stop()


def _serve() -> BatonServe:
    return BatonServe(
        "--model",
        str(tiny_model("llama")),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "1024",
    )


class Report(pydantic.BaseModel):
    sky: Literal["sunny", "rainy"]
    warm: bool


def weather_agent(serve: BatonServe, calls: list[str]) -> object:
    from openai import AsyncOpenAI

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}, 21 C"

    client = AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)
    return agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model="tiny", openai_client=client),
        output_type=Report,
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0
        ),
    )


@pytest.mark.parametrize("chained", [False, True], ids=["items", "previous_response_id"])
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agent_calls_the_function_and_answers(serve, chained, streamed):
    agents.set_tracing_disabled(True)
    calls: list[str] = []
    agent = weather_agent(serve, calls)
    kwargs = {"auto_previous_response_id": chained, "max_turns": 4}

    async def run() -> object:
        if not streamed:
            return await agents.Runner.run(agent, "Weather in Paris?", **kwargs)
        result = agents.Runner.run_streamed(agent, "Weather in Paris?", **kwargs)
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return result

    result = asyncio.run(run())
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    items = [item.type for item in result.new_items]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"]
    assert items[-1] == "message_output_item"
    assert isinstance(result.final_output, Report)
    # two model turns: the call, then the answer that read its output
    assert len(result.raw_responses) == 2
    first, second = result.raw_responses
    assert second.usage.input_tokens > first.usage.input_tokens
