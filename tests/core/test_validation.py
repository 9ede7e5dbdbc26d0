"""Request validation: SamplingParams bounds, baton.validation.check_request, prompts, chat templates.

The engine-level tests use the fake executor; the prompt and chat-template
tests use the tiny model's real tokenizer (SmolLM2's, with its chat template).
"""

from __future__ import annotations

import math
import pickle
import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.errors import ContextLengthError, InvalidRequestError, error_from_message
from baton.frontend.prompts import (
    PREFIX_CHARS_PER_TOKEN,
    RESERVED_CHAT_TEMPLATE_KWARGS,
    InputProcessor,
)
from baton.model_info import read_model_info
from baton.protocol import EngineCoreRequest, ModelInfo
from baton.sampling_params import RequestOutputKind, SamplingParams
from baton.testing import FakeExecutor
from baton.testing.tiny_model import tiny_model
from baton.validation import check_request

INFO = ModelInfo(
    path="fake", architecture="Fake", vocab_size=1000, max_model_len=64, eos_token_ids=[0]
)
MESSAGES = [{"role": "user", "content": "hi"}]

# ---------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(top_k=10**20), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k="5"), "top_k"),
        (dict(n=129), "n"),
        (dict(n=True), "n"),
        (dict(max_tokens=2**31), "max_tokens"),
        (dict(max_tokens=1.5), "max_tokens"),
        (dict(min_tokens=2**31, max_tokens=None), "min_tokens"),
        (dict(seed=2**63), "seed"),
        (dict(seed="7"), "seed"),
        (dict(stop_token_ids=[2**31]), "stop_token_ids"),
        (dict(stop_token_ids=[1, "2"]), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature="0.5"), "temperature"),
        (dict(temperature=10**400), "temperature"),
        (dict(top_p=math.nan), "top_p"),
        (dict(min_p=math.inf), "min_p"),
        (dict(presence_penalty=math.nan), "presence_penalty"),
        (dict(frequency_penalty=-math.inf), "frequency_penalty"),
        (dict(repetition_penalty=math.inf), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[1]), "stop"),
        (dict(stop=5), "stop"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=1.0), "logprobs"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(output_kind=7), "output_kind"),
        (dict(structured_outputs={"regex": "a+"}), "structured_outputs"),
    ],
)
def test_sampling_params_bounds_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field
    message = str(info.value)
    assert f"SamplingParams.{field} " in message and "got " in message
    assert len(message) < 300  # huge values are shown by their size, not their 10**20 digits


def test_sampling_params_normalise_what_they_accept():
    p = SamplingParams(
        top_k=-1, stop="x", temperature=1, max_tokens=np.int64(5), stop_token_ids=(3, np.int32(4))
    )
    assert p.top_k == 0 and p.stop == ["x"] and p.stop_token_ids == [3, 4]
    assert type(p.temperature) is float and type(p.max_tokens) is int
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    assert SamplingParams(n=128, seed=2**63 - 1, top_k=2**31 - 1).n == 128


def test_temperatures_too_small_for_float32_are_greedy():
    assert SamplingParams(temperature=1e-40, top_p=0.5).greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_huge_values_are_shown_by_size():
    with pytest.raises(InvalidRequestError, match="an integer of 16610 bits"):
        SamplingParams(top_k=10**5000)


def test_invalid_request_error_keeps_its_param():
    e = InvalidRequestError("SamplingParams.top_k is bad", param="top_k")
    assert InvalidRequestError("plain").param is None
    assert pickle.loads(pickle.dumps(e)).param == "top_k"
    # across a process only the message survives: the field is read back from it
    assert error_from_message(f"InvalidRequestError: {e}").param == "top_k"
    rebuilt = error_from_message("ContextLengthError: the prompt has 9 tokens")
    assert isinstance(rebuilt, ContextLengthError) and rebuilt.param is None


# ---------------------------------------------------------------------- check_request


def check(ids=(1, 2, 3), **kwargs):
    priority = kwargs.pop("priority", 0)
    user = kwargs.pop("user", None)
    kwargs.setdefault("max_tokens", 4)
    check_request(list(ids), SamplingParams(**kwargs), INFO, priority=priority, user=user)


@pytest.mark.parametrize(
    ("ids", "kwargs", "param", "match"),
    [
        ([], {}, "prompt", "the prompt is empty"),
        ([1] * 64, {}, "prompt", "64 tokens but model.max_model_len is 64"),
        ([1] * 64, dict(max_tokens=None), "prompt", "at most 63 tokens"),
        ([1] * 60, dict(max_tokens=5), "max_tokens", "lower max_tokens to at most 4"),
        ([1, -1], {}, "prompt", r"token id -1 at position 1 is outside the vocabulary \[0, 1000\)"),
        ([1, 1000], {}, "prompt", "token id 1000 at position 1"),
        ([1, 2**200], {}, "prompt", "an integer of 201 bits"),
        ([1, True], {}, "prompt", "item 1 is True"),
        ([1, 2.0], {}, "prompt", r"item 1 is 2\.0 \(float\)"),
        ([1], dict(top_k=1001), "top_k", "at most the vocabulary size"),
        ([1], dict(stop_token_ids=[1000000], min_tokens=2), "stop_token_ids", r"\[0, 1000\)"),
        ([1], dict(priority=2**63), "priority", "int64"),
        ([1], dict(priority=-(2**63) - 1), "priority", "int64"),
        ([1], dict(priority="1"), "priority", "must be an integer"),
        ([1], dict(priority=True), "priority", "must be an integer"),
        ([1], dict(user=5), "user", "must be a string"),
    ],
)
def test_check_request_refuses(ids, kwargs, param, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        check(ids, **kwargs)
    assert info.value.param == param


def test_check_request_boundaries():
    check([1] * 60, max_tokens=4)  # prompt + max_tokens == max_model_len
    check([1] * 63, max_tokens=None)  # room for one token
    check([0, 999], top_k=1000, stop_token_ids=[999], priority=-(2**63))
    check([1], priority=2**63 - 1, user="alice")
    with pytest.raises(ContextLengthError):
        check([1] * 61, max_tokens=4)


def test_check_request_rechecks_a_changed_struct():
    params = SamplingParams()
    params.top_k = 10**20  # msgspec structs do not validate on assignment
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\.top_k"):
        check_request([1], params, INFO)
    with pytest.raises(InvalidRequestError, match="must be a SamplingParams"):
        check_request([1], {"top_k": 1}, INFO)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the engine


def engine() -> EngineCore:
    config = BatonConfig.load(max_model_len=64)
    return EngineCore(config, executor=FakeExecutor(block_size=config.cache.block_size), info=INFO)


def request(rid: str, ids: list[int], priority: int = 0, **params) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=ids,
        sampling_params=SamplingParams(temperature=0, **params),
        eos_token_id=0,
        priority=priority,
    )


@pytest.mark.parametrize(
    ("ids", "priority", "params", "match"),
    [
        ([1] * 60, 0, dict(max_tokens=10), "lower max_tokens to at most 4"),
        ([1, 2], 0, dict(top_k=5000), "SamplingParams.top_k"),
        ([1, 2], 0, dict(min_tokens=2, stop_token_ids=[1000000]), "SamplingParams.stop_token_ids"),
        ([1, 2], 2**64, {}, "priority"),
    ],
)
def test_the_engine_runs_the_same_check(ids, priority, params, match):
    core = engine()
    with pytest.raises(InvalidRequestError, match=match):
        core.add_request(request("bad", ids, priority, **params))
    core.add_request(request("ok", [1, 2, 3], max_tokens=3))
    while core.has_work():
        core.step_fn()
    assert not core.scheduler.requests


# ---------------------------------------------------------------------- prompts and chats


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    folder = tiny_model("llama")
    return InputProcessor(AutoTokenizer.from_pretrained(folder), read_model_info(folder, 256))


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (b"hello", r"bytes is neither text nor token ids: decode it"),
        (bytearray(b"hello"), r"bytearray is neither text nor token ids"),
        ({"prompt": b"hello"}, r"bytes is neither text nor token ids"),
        ([1, 2.0], r"item 1 is 2\.0 \(float\)"),
        ([True, 5], r"item 0 is True \(bool\)"),
        ({"prompt_token_ids": [1, "2"]}, r"item 1 is '2' \(str\)"),
        ({"prompt_token_ids": [1], "prompt": 5}, "'prompt' must be text"),
        ("\udc80x", r"'\\udc80' at position 0 is a lone surrogate"),
        ({"prompt": "ok \ud800"}, "at position 3"),
        (3.5, "a prompt is text, a list of token ids or a dict"),
    ],
)
def test_bad_prompts_are_refused(processor, prompt, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        processor.tokenize(prompt)
    assert info.value.param == "prompt"


def test_good_prompts(processor):
    ids = processor.tokenizer.encode("hello", add_special_tokens=True)
    assert processor.tokenize("hello") == ("hello", ids)
    assert processor.tokenize([np.int64(5), 6]) == (None, [5, 6])
    assert processor.tokenize((5, 6)) == (None, [5, 6])


@pytest.mark.parametrize("name", sorted(RESERVED_CHAT_TEMPLATE_KWARGS))
def test_apply_chat_template_options_are_refused(processor, name):
    with pytest.raises(InvalidRequestError, match=f"'{name}' is an option") as info:
        processor.render_chat(MESSAGES, chat_template_kwargs={name: False})
    assert info.value.param == "chat_template_kwargs"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tokenize": False},
        {"return_tensors": "np"},
        {"tokenizer_kwargs": {"add_special_tokens": True}},
    ],
)
def test_issue_exploits_are_refused_as_keywords_and_in_the_dict(processor, kwargs):
    for call in (
        lambda: processor.render_chat(MESSAGES, **kwargs),
        lambda: processor.render_chat(MESSAGES, chat_template_kwargs=kwargs),
    ):
        with pytest.raises(InvalidRequestError) as info:
            call()
        assert info.value.param == "chat_template_kwargs"


def test_template_variables_pass_and_tokens_match_transformers(processor):
    tok = processor.tokenizer
    expected = list(
        tok.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    assert processor.render_chat(MESSAGES) == expected
    assert processor.render_chat(MESSAGES, chat_template_kwargs={"enable_thinking": False}) == (
        expected
    )


@pytest.mark.parametrize(
    ("template", "param", "match"),
    [
        ("{{ raise_exception('roles must alternate') }}", "chat_template", "roles must alternate"),
        ("{% if %}", "chat_template", "TemplateSyntaxError"),
        ("{{ ''.__class__.__mro__ }}", "chat_template", "SecurityError"),
        ("{{ 1 / 0 }}", "chat_template", "ZeroDivisionError"),
        ("{{ messages[5]['content'] }}", "chat_template", "the chat template failed"),
    ],
)
def test_template_errors_are_invalid_requests(processor, template, param, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        processor.render_chat(MESSAGES, chat_template=template)
    assert info.value.param == param
    assert str(info.value).startswith("the chat template failed: ")


def test_a_given_template_replaces_the_tokenizers(processor):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    ids = processor.render_chat(MESSAGES, chat_template=template)
    assert ids == processor.tokenizer.encode("<user>hi", add_special_tokens=False)


def test_a_failing_tokenizer_template_names_the_messages(processor, monkeypatch):
    monkeypatch.setattr(processor.tokenizer, "chat_template", "{{ raise_exception('no') }}")
    with pytest.raises(InvalidRequestError, match="the chat template failed") as info:
        processor.render_chat(MESSAGES)
    assert info.value.param == "messages"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        ([{"content": "hi"}], r"messages\[0\] must be a dict with 'role'"),
        ([{"role": "user", "content": "a\udc80"}], r"messages\[0\]\.content is not valid UTF-8"),
    ],
)
def test_bad_messages(processor, messages, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        processor.render_chat(messages)
    assert info.value.param == "messages"


# ---------------------------------------------------------------------- bounded tokenization

JACK = "All work and no play makes Jack a dull boy. "  # ~11 tokens in 44 characters


def test_a_text_far_over_the_context_is_refused_by_a_prefix_fast(processor):
    """2 MB (~500k tokens; the context is 256): refused by counting a prefix, not tokenized."""
    text = JACK * 45_000
    t0 = time.monotonic()
    with pytest.raises(ContextLengthError, match=r"model\.max_model_len is 256") as info:
        processor.encode(text, add_special_tokens=True)
    assert time.monotonic() - t0 < 0.5
    assert info.value.param == "prompt" and "in its first" in str(info.value)
    with pytest.raises(ContextLengthError):
        processor.tokenize(text)


def test_a_chat_whose_message_is_ten_times_the_context_is_refused_before_tokenizing(
    processor, monkeypatch
):
    message = JACK * (10 * 256 // 11 + 1)  # ~10x the 256-token context
    encoded: list[int] = []
    encode = processor.tokenizer.encode

    def spy(text, **kwargs):
        encoded.append(len(text))
        return encode(text, **kwargs)

    monkeypatch.setattr(processor.tokenizer, "encode", spy)
    with pytest.raises(ContextLengthError, match="the rendered chat has more than") as info:
        processor.render_chat([{"role": "user", "content": message}])
    assert info.value.param == "messages"
    assert encoded and max(encoded) < len(message)  # only a prefix was tokenized
    t0 = time.monotonic()
    with pytest.raises(ContextLengthError):
        processor.render_chat([{"role": "user", "content": JACK * 45_000}])  # 2 MB
    assert time.monotonic() - t0 < 0.5


@pytest.mark.parametrize("repeat", [1, 5, 20])
def test_what_fits_is_tokenized_as_before(processor, repeat):
    tok = processor.tokenizer
    text = JACK * repeat
    assert processor.encode(text, add_special_tokens=True) == tok.encode(text)
    assert processor.tokenize(text) == (text, tok.encode(text))
    messages = [{"role": "user", "content": text}]
    expected = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert processor.render_chat(messages) == list(expected)


def test_a_long_text_of_few_tokens_is_counted_then_tokenized_whole(processor):
    """Over PREFIX_CHARS_PER_TOKEN characters per token of the context, but a rule line of
    ~64 characters per token: its prefix counts few tokens, so all of it is tokenized, as
    before, and refused (or not) by its real length."""
    text = "-" * (PREFIX_CHARS_PER_TOKEN * 256 * 2)
    ids = processor.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) < 2 * 256 + 64  # the tokenizer's: the test needs such a text
    assert processor.encode(text, add_special_tokens=False) == ids


def test_token_ids_longer_than_the_context_are_refused_by_their_length(processor):
    ids = [1] * 1_000_000
    t0 = time.monotonic()
    for prompt in (ids, {"prompt_token_ids": ids}):
        with pytest.raises(ContextLengthError, match="the prompt has 1000000 tokens"):
            processor.tokenize(prompt)
    assert time.monotonic() - t0 < 0.1  # not a million ids checked one by one
    with pytest.raises(InvalidRequestError, match="item 1 is 'x'"):
        processor.tokenize([1, "x"])  # a short one is still checked id by id


def test_message_checks_and_template_variables_are_public(processor):
    """The server's client-template path calls these: the same refusals, the same messages."""
    with pytest.raises(InvalidRequestError, match=r"messages\[1\] must be a dict") as info:
        processor.check_messages([{"role": "user"}, "hi"])
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="'tokenize' is an option") as info:
        processor.template_variables({"tokenize": True})
    assert info.value.param == "chat_template_kwargs"
    assert processor.template_variables(None) == {}
    assert processor.template_variables({"enable_thinking": False}) == {"enable_thinking": False}
