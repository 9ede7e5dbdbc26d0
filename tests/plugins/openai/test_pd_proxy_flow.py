"""pd-proxy's request to the producer: the prompt computed, one token, the KV saved."""

from __future__ import annotations

import pytest

from baton_openai.http.errors import OpenAIError
from baton_openai.pd_proxy.flow import prefill_body


def test_the_producer_gets_one_unstreamed_token_and_do_remote_decode() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.3,
        "cache_salt": "s",
    }
    out = prefill_body(body)
    assert out == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "temperature": 0.3,
        "cache_salt": "s",  # what changes the prompt's KV goes to the producer unchanged
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["stream"] is True and "kv_transfer_params" not in body  # the original is kept


def test_one_prompt_of_token_ids_is_one_prompt() -> None:
    assert prefill_body({"prompt": [1, 2, 3]})["prompt"] == [1, 2, 3]
    assert prefill_body({"prompt": ["only one"]})["prompt"] == ["only one"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "kv_transfer_params": {}}, "kv_transfer_params"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
    ],
)
def test_what_the_proxy_cannot_hand_over_is_refused(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        prefill_body(body)
    assert info.value.status == 400 and info.value.param == param
