"""/v1/chat/completions through the official openai client against a real server (tiny model)."""

from __future__ import annotations

import json
import math

import openai
import pytest

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_chat_non_streaming(server, client):
    r = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=12, **GREEDY
    )
    assert (
        r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == server.model
    )
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_streaming_equals_non_streaming_and_reports_usage(server, client):
    full = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=16, **GREEDY
    )
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_without_include_usage_has_no_usage_chunk(server, client):
    chunks = list(
        client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=4, stream=True
        )
    )
    assert all(c.usage is None and c.choices for c in chunks)


def test_n2_non_streaming_and_streaming(server, client):
    r = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=10,
        n=2,
        seed=7,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content  # independent samples
    assert r.usage.completion_tokens == 20
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=10,
        n=2,
        seed=7,
        temperature=1.0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {
        c.index: c.message.content for c in r.choices
    }  # same seed, same samples, streamed


def test_seed_reproducible(server, client):
    def run(seed):
        return (
            client.chat.completions.create(
                model=server.model, messages=MESSAGES, max_tokens=16, seed=seed, temperature=1.0
            )
            .choices[0]
            .message.content
        )

    assert run(123) == run(123)
    assert run(123) != run(124)


def test_stop_string_ends_the_choice_before_it(server, client):
    full = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=16, **GREEDY
    )
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text[: text.index(stop)]
    r = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=16, stop=[stop], **GREEDY
    )
    assert r.choices[0].message.content == cut
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=16, stop=stop, stream=True, **GREEDY
        )
        if c.choices
    )
    assert streamed == cut


def test_logprobs_and_top_logprobs(server, client):
    r = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # greedy: the sampled token is the most likely one
        assert t.token == t.top_logprobs[0].token and math.isclose(
            t.logprob, values[0], abs_tol=1e-5
        )
        assert bytes(t.bytes).decode() == t.token
    streamed = [
        tok
        for c in client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            max_tokens=6,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            **GREEDY,
        )
        if c.choices and c.choices[0].logprobs
        for tok in c.choices[0].logprobs.content
    ]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [
        (t.token, round(t.logprob, 4)) for t in content
    ]


def test_logprobs_off_by_default(server, client):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=3)
    assert r.choices[0].logprobs is None


def test_max_completion_tokens_and_extras(server, client):
    r = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0.8,
        top_p=0.9,
        seed=1,
        user="alice",
        extra_body={
            "top_k": 20,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "min_tokens": 5,
            "priority": 0,
        },
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_content_parts_are_joined(server, client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    a = client.chat.completions.create(
        model=server.model, messages=parts, max_tokens=5, temperature=0
    )
    b = client.chat.completions.create(
        model=server.model, messages=MESSAGES[1:], max_tokens=5, temperature=0
    )
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=5000), "max_tokens"),
        (dict(max_completion_tokens=100_000), "max_completion_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=True, top_logprobs=30), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(extra_body={"min_tokens": 9}, max_tokens=4), "min_tokens"),
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (dict(messages=[]), "messages"),
        (
            dict(
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            ),
            "messages",
        ),
        (dict(logit_bias={"1": 101}), "logit_bias"),
        (dict(logit_bias={"one": 5}), "logit_bias"),
        (dict(extra_body={"allowed_token_ids": []}), "allowed_token_ids"),
        (dict(extra_body={"bad_words": [""]}), "bad_words"),
        (dict(extra_body={"prompt_logprobs": 1}, stream=True), "prompt_logprobs"),
        (
            dict(extra_body={"structured_outputs": {"regex": "a+"}, "guided_choice": ["x"]}),
            "guided_choice",
        ),
        (
            dict(extra_body={"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}),
            "structured_outputs.whitespace_pattern",
        ),
        (dict(response_format={"type": "json_schema"}), "response_format"),
        (dict(extra_body={"guided_regex": "a+", "guided_choice": ["x"]}), "guided_choice"),
    ],
)
def test_bad_parameters_are_openai_400s_naming_the_parameter(server, client, kwargs, param):
    args = {"model": server.model, "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"}
    assert body["param"] == param and body["type"] == "invalid_request_error", body
    assert param.split("_")[0] in body["message"] or param == "messages", body


def test_bad_parameter_in_a_stream_is_a_400_before_streaming(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.model, messages=MESSAGES, temperature=5, stream=True
        )
    assert info.value.body["param"] == "temperature"


def test_unknown_model_is_a_404(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-5", messages=MESSAGES)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"


def test_structured_output_json_schema_and_choice(server, client):
    # a random tiny model would wander through a grammar's optional whitespace: keep the schema tight
    schema = {"type": "string", "enum": ["red", "blue"]}
    r = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert json.loads(r.choices[0].message.content) in ("red", "blue")
    r = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].message.content in ("yes", "no")


def test_structured_output_without_a_backend_is_a_clear_400(model_dir):
    from .conftest import running_server

    with running_server(model_dir, max_model_len=256, structured_output={"backend": "none"}) as srv:
        with pytest.raises(openai.BadRequestError) as info:
            srv.client().chat.completions.create(
                model=srv.model, messages=MESSAGES, response_format={"type": "json_object"}
            )
        body = info.value.body
        assert body["param"] == "response_format" and "baton-plugin-xgrammar" in body["message"], (
            body
        )
        with pytest.raises(openai.BadRequestError) as info:
            srv.client().chat.completions.create(
                model=srv.model, messages=MESSAGES, extra_body={"guided_regex": "[ab]+"}
            )
        assert info.value.body["param"] == "guided_regex"
