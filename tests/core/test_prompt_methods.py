"""LLM's and AsyncLLM's tokenization and chat methods (what a server uses instead of the
internal InputProcessor): the engine's own ids and checks, on a real engine (tiny llama with
SmolLM2's tokenizer and chat template)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from baton import LLM, AsyncLLM
from baton.errors import ContextLengthError, InvalidRequestError
from baton.frontend.prompts import PREFIX_CHARS_PER_TOKEN
from baton.testing.tiny_model import tiny_model

MESSAGES = [{"role": "user", "content": "hi"}]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(model=str(tiny_model("llama")), max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


def test_tokenize_gives_the_ids_generate_would_use(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer
    with_bos = tok.encode("hello there", add_special_tokens=True)
    assert llm.tokenize("hello there") == with_bos
    assert llm.tokenize({"prompt": "hello there"}) == with_bos
    assert llm.tokenize("hello there", add_special_tokens=False) == tok.encode(
        "hello there", add_special_tokens=False
    )
    assert llm.tokenize([5, 6]) == [5, 6]
    assert llm.tokenize({"prompt_token_ids": (5, 6)}) == [5, 6]
    # generate tokenizes the same way: its prompt ids are these
    out = llm.generate("hello there")[0]
    assert out.prompt_token_ids == with_bos


def test_tokenize_refuses_what_generate_refuses(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="lone surrogate") as info:
        llm.tokenize("\udc80x")
    assert info.value.param == "prompt"
    with pytest.raises(ContextLengthError, match="max_model_len"):
        llm.tokenize(list(range(MAX_MODEL_LEN + 1)))
    with pytest.raises(ContextLengthError, match="in its first"):  # refused by a prefix
        llm.tokenize("word " * (PREFIX_CHARS_PER_TOKEN * MAX_MODEL_LEN))


def test_chat_methods(llm: LLM) -> None:
    ids = llm.render_chat(MESSAGES)
    text = llm.get_tokenizer().apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    # a chat rendered elsewhere gets no further special tokens: the same ids
    assert llm.tokenize_rendered_chat(text) == ids
    with pytest.raises(InvalidRequestError, match="lone surrogate") as info:
        llm.tokenize_rendered_chat("\ud800")
    assert info.value.param == "messages"
    llm.check_messages(MESSAGES)
    for bad in ([], "hi", [{"content": "no role"}], [{"role": "user", "content": "\udc80"}]):
        with pytest.raises(InvalidRequestError) as info:
            llm.check_messages(bad)
        assert info.value.param == "messages"
    assert llm.chat_template_variables(None) == {}
    assert llm.chat_template_variables({"enable_thinking": False}) == {"enable_thinking": False}
    with pytest.raises(InvalidRequestError, match="'tokenize' is an option") as info:
        llm.chat_template_variables({"tokenize": True})
    assert info.value.param == "chat_template_kwargs"


async def test_async_llm_has_the_same_methods() -> None:
    engine = await AsyncLLM.create(model=str(tiny_model("llama")), max_model_len=MAX_MODEL_LEN)
    try:
        tok = engine.get_tokenizer()
        assert engine.tokenize("hello") == tok.encode("hello", add_special_tokens=True)
        ids = engine.render_chat(MESSAGES, chat_template_kwargs={"enable_thinking": False})
        text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert engine.tokenize_rendered_chat(text) == ids
        with pytest.raises(InvalidRequestError):
            engine.check_messages([])
        with pytest.raises(InvalidRequestError):
            engine.chat_template_variables({"messages": []})
    finally:
        engine.shutdown()
