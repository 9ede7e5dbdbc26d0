"""/v1/completions through the official openai client against a real server (tiny model)."""

from __future__ import annotations

import openai
import pytest

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_completion_non_streaming(server, client):
    r = client.completions.create(
        model=server.model, prompt="The weather today is", max_tokens=8, **GREEDY
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.text and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_completion_streaming_equals_non_streaming(server, client):
    full = client.completions.create(
        model=server.model, prompt="Once upon a time", max_tokens=12, **GREEDY
    )
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt="Once upon a time",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert (
        chunks[-1].usage.completion_tokens == 12
        and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    )


def test_batch_of_prompts_with_n2(server, client):
    r = client.completions.create(
        model=server.model,
        prompt=["one", "two three"],
        n=2,
        max_tokens=5,
        seed=3,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 20
    single = client.completions.create(
        model=server.model,
        prompt="two three",
        n=2,
        max_tokens=5,
        seed=3,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    by_index = {c.index: c.text for c in r.choices}
    assert [by_index[2], by_index[3]] == [
        c.text for c in sorted(single.choices, key=lambda c: c.index)
    ]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model=server.model,
        prompt=["one", "two three"],
        n=2,
        max_tokens=5,
        seed=3,
        temperature=1.0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == by_index


def test_token_id_prompt_and_echo(server, client):
    ids = [1, 504, 3158, 314]
    r = client.completions.create(model=server.model, prompt=ids, max_tokens=4, echo=True, **GREEDY)
    plain = client.completions.create(model=server.model, prompt=ids, max_tokens=4, **GREEDY)
    assert r.choices[0].text.endswith(plain.choices[0].text)
    assert len(r.choices[0].text) > len(plain.choices[0].text)
    assert r.usage.prompt_tokens == 4


def test_logprobs(server, client):
    r = client.completions.create(
        model=server.model, prompt="Hello there", max_tokens=5, logprobs=2, **GREEDY
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert (
            max(top.values()) == pytest.approx(value, abs=1e-5) and tok in top
        )  # greedy: the top token


def test_stop_strings(server, client):
    full = (
        client.completions.create(model=server.model, prompt="Numbers:", max_tokens=16, **GREEDY)
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    r = client.completions.create(
        model=server.model, prompt="Numbers:", max_tokens=16, stop=stop, **GREEDY
    )
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n"),
        (dict(max_tokens=2000), "max_tokens"),
        (dict(logprobs=50), "logprobs"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[10**9]), "prompt"),
        (dict(prompt="x " * 1100), "prompt"),
        (dict(best_of=3), "best_of"),
        (dict(suffix="end"), "suffix"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
    ],
)
def test_bad_parameters(server, client, kwargs, param):
    args = {"model": server.model, "prompt": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    assert info.value.body["param"] == param, info.value.body
