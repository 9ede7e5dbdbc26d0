"""The default model (SmolLM2-135M-Instruct) behind `baton serve` over zmq, through the openai client."""

from __future__ import annotations

import pytest

from .conftest import ServerThread

pytestmark = pytest.mark.slow


def test_smollm2_answers_over_http(default_model_dir):
    srv = ServerThread(transport="zmq", served_model_name="smollm2")
    try:
        client = srv.client()
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0
        )
        answer = r.choices[0].message.content
        assert "Paris" in answer, answer
        assert r.choices[0].finish_reason in ("stop", "length")
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True
            )
            if c.choices
        )
        assert streamed == answer
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        }
        r = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=40,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": schema},
            },
        )
        import json

        assert "Paris" in json.loads(r.choices[0].message.content)["city"]
    finally:
        assert srv.stop() == 0
