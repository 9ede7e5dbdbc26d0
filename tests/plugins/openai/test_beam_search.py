"""use_beam_search on /v1/completions (vLLM's extension) through the openai client: the n
choices are the engine's beam search's n best beams, best first."""

from __future__ import annotations

import openai
import pytest

from baton import LLM
from baton.beam_search import BeamSearchParams

from .conftest import MAX_MODEL_LEN

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


def test_completions_use_beam_search_returns_the_best_beams(server, client, model_dir):
    r = client.completions.create(
        model=server.model,
        prompt=PROMPTS,
        n=3,
        max_tokens=5,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    with LLM(model=model_dir, max_model_len=MAX_MODEL_LEN) as llm:
        want = llm.beam_search(
            [{"prompt_token_ids": p} for p in PROMPTS],
            BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.5),
        )
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [s.text for o in want for s in o.sequences]
    eos = llm.get_tokenizer().eos_token_id
    reasons = ["stop" if s.tokens[-1] == eos else "length" for o in want for s in o.sequences]
    assert [c.finish_reason for c in r.choices] == reasons
    generated = sum(
        len(s.tokens) - len(p) for p, o in zip(PROMPTS, want, strict=True) for s in o.sequences
    )
    assert r.usage.prompt_tokens == sum(len(p) for p in PROMPTS)
    assert r.usage.completion_tokens == generated


def test_completions_beam_search_refuses_stream(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=server.model,
            prompt="hi",
            max_tokens=3,
            stream=True,
            extra_body={"use_beam_search": True},
        )
    assert e.value.body["param"] == "stream"


def test_chat_use_beam_search_returns_the_best_beams(server, client, model_dir):
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(
        model=server.model,
        messages=messages,
        n=2,
        max_completion_tokens=4,
        extra_body={"use_beam_search": True},
    )
    with LLM(model=model_dir, max_model_len=MAX_MODEL_LEN) as llm:
        ids = llm.input_processor.render_chat(messages)
        want = llm.beam_search(
            [{"prompt_token_ids": ids}], BeamSearchParams(beam_width=2, max_tokens=4)
        )[0]
    assert [c.message.content for c in r.choices] == [s.text for s in want.sequences]
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    "extra", [{"logprobs": True}, {"response_format": {"type": "json_object"}}]
)
def test_chat_beam_search_refuses_what_it_cannot_honour(server, client, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=3,
            extra_body={"use_beam_search": True},
            **extra,
        )
    assert e.value.body["param"] == next(iter(extra))
