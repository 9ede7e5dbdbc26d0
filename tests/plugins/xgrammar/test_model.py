"""Structured output with the real default model (SmolLM2-135M-Instruct) through the offline API.

Sampling at temperature 1.0 with 20 seeds: every JSON output validates against
its nested schema, every regex output fully matches, every choice output is
a choice. Unconstrained greedy requests give the same tokens with or without
constrained neighbours in their batch. Slow: each test runs the model.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from baton import LLM, SamplingParams, StructuredOutputSpec
from baton.errors import StructuredOutputError

pytestmark = pytest.mark.slow

SEEDS = range(20)
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 40},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "address", "tags"],
}
DATE_REGEX = r"(January|February|March|April|May|June|July|August|September|October|November|December) ([1-9]|[12][0-9]|3[01]), (19|20)[0-9]{2}"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(model="smollm2-135m-instruct", max_num_seqs=32)
    yield engine
    engine.shutdown()


def ask(
    llm, question: str, spec: StructuredOutputSpec, max_tokens: int, seeds: range = SEEDS
) -> list:
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=spec)
        for s in seeds
    ]
    messages = [{"role": "user", "content": question}]
    outs = llm.chat([messages] * len(params), params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_every_json_output_validates_against_a_nested_schema(llm):
    outs = ask(
        llm,
        "Invent a person. Answer in JSON with name, age, address (city, zip) and tags.",
        StructuredOutputSpec(json=PERSON_SCHEMA),
        max_tokens=300,
    )
    for o in outs:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), PERSON_SCHEMA)


def test_every_json_object_output_is_an_object(llm):
    outs = ask(
        llm,
        "Describe the weather in Paris as a JSON object.",
        StructuredOutputSpec(json_object=True),
        max_tokens=200,
        seeds=range(6),
    )
    for o in outs:
        if (
            o.finish_reason == "stop"
        ):  # an unbounded object may run to max_tokens; what ended must parse
            assert isinstance(json.loads(o.text), dict), o.text
        else:
            assert o.finish_reason == "length" and o.text.startswith("{")
    assert any(o.finish_reason == "stop" for o in outs)


def test_every_regex_output_fully_matches(llm):
    outs = ask(
        llm,
        "When was the Eiffel Tower completed? Give the date.",
        StructuredOutputSpec(regex=DATE_REGEX),
        max_tokens=30,
    )
    for o in outs:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        assert re.fullmatch(DATE_REGEX, o.text), o.text


def test_every_choice_output_is_one_of_the_choices(llm):
    outs = ask(
        llm,
        "Is the review 'I loved this film' positive, negative or neutral?",
        StructuredOutputSpec(choice=CHOICES),
        max_tokens=10,
    )
    assert all(o.finish_reason == "stop" and o.text in CHOICES for o in outs), [
        o.text for o in outs
    ]


def test_unconstrained_greedy_requests_ignore_constrained_neighbours(llm):
    prompts = ["The capital of France is", "List three colours:", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    constrained = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=60,
            structured_outputs=StructuredOutputSpec(json=PERSON_SCHEMA),
        )
        for s in range(3)
    ] + [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=10,
            structured_outputs=StructuredOutputSpec(choice=CHOICES),
        )
        for s in range(3)
    ]
    mixed_prompts = [
        p for pair in zip(prompts, prompts, strict=True) for p in pair
    ]  # interleaved in one batch
    mixed_params = [p for pair in zip([greedy] * 3, constrained[:3], strict=True) for p in pair]
    outs = llm.generate(
        mixed_prompts + ["Sentiment of 'meh':"] * 3, mixed_params + constrained[3:], use_tqdm=False
    )
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 4)] == alone


def test_a_spec_that_fails_to_compile_fails_only_its_request(llm):
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputSpec(regex="[0-9]{2}")
        ),
        SamplingParams(
            temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputSpec(regex="([0-9]")
        ),
        SamplingParams(temperature=0.0, max_tokens=8),
    ]
    good, bad, plain = llm.generate(["Pick a number:"] * 3, params, use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert "StructuredOutputError" in bad.error and "regex" in bad.error, bad.error
    assert good.outputs[0].finish_reason == "stop" and re.fullmatch(
        "[0-9]{2}", good.outputs[0].text
    )
    assert plain.outputs[0].finish_reason == "length" and plain.error is None


def test_no_backend_is_a_clear_error_naming_the_plugin():
    with LLM(model="smollm2-135m-instruct", structured_output={"backend": "none"}) as engine:
        spec = StructuredOutputSpec(choice=CHOICES)
        with pytest.raises(StructuredOutputError, match="pip install baton-plugin-xgrammar"):
            engine.generate(
                "Hi", SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False
            )
        out = engine.generate("Hi", SamplingParams(max_tokens=4), use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "length"
