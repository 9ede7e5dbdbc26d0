"""logit_bias, allowed_token_ids and bad words through the engine (greedy, tiny model), their
checks, and bad_words' tokenization (vLLM's rule)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoTokenizer

from baton import LLM, SamplingParams
from baton.errors import InvalidRequestError
from baton.frontend.bad_words import bad_words_token_ids
from baton.testing.tiny_model import tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(tiny_model("llama")), max_model_len=128, block_size=4)


PROMPT = torch.randint(3, 1000, (9,), generator=torch.Generator().manual_seed(0)).tolist()


def tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    """Greedy tokens of PROMPT under each params, all in one batch."""
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def greedy(max_tokens: int = 6, **fields: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **fields)  # type: ignore[arg-type]


def test_each_constraint_changes_only_its_own_row(llm: LLM) -> None:
    [base] = tokens(llm, [greedy()])
    a, b = base[0], base[1]
    other = next(t for t in range(5, 100) if t not in base)
    got = tokens(
        llm,
        [
            greedy(),
            greedy(allowed_token_ids=[other, other + 1]),
            greedy(logit_bias={other: 100.0}),
            greedy(logit_bias={a: -100.0}),
            greedy(bad_words_token_ids=[[a]]),
            greedy(bad_words_token_ids=[[a, b]]),  # a stays; b is banned right after it
            greedy(bad_words_token_ids=[[other, b]]),  # prefix never generated: no effect
        ],
    )
    assert got[0] == base  # the unconstrained row in the same batch is untouched
    assert set(got[1]) <= {other, other + 1}
    assert got[2] == [other] * 6
    assert got[3][0] != a and a not in got[3]
    assert a not in got[4]
    assert got[5][0] == a and got[5][1] != b
    assert got[6] == base


def test_sampled_rows_with_constraints_stay_in_the_allowed_set(llm: LLM) -> None:
    [out] = tokens(llm, [SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[11, 12, 13])])
    assert out and set(out) <= {11, 12, 13}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"bad_words": ["ok", "  "]}, "bad_words"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
    ],
)
def test_bad_values_name_their_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert e.value.param == param and param in str(e.value)


def test_token_ids_past_the_vocabulary_are_refused(llm: LLM) -> None:
    vocab = llm.input_processor.info.vocab_size
    for fields, param in (
        ({"logit_bias": {vocab: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [vocab]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[1, vocab]]}, "bad_words"),
    ):
        with pytest.raises(InvalidRequestError, match=str(vocab)) as e:
            llm.generate([{"prompt_token_ids": PROMPT}], greedy(**fields), use_tqdm=False)
        assert e.value.param == param


def test_bad_words_are_banned_at_the_start_and_after_a_space() -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model("llama"))
    ids = bad_words_token_ids(tok, ["hello", " world"])
    assert tok.encode("hello", add_special_tokens=False) in ids
    assert tok.encode(" hello", add_special_tokens=False) in ids
    assert tok.encode("world", add_special_tokens=False) in ids  # leading spaces stripped first
    assert all(w for w in ids)


def test_bad_words_reach_the_engine_tokenized(llm: LLM) -> None:
    [base] = tokens(llm, [greedy()])
    word = llm.tokenizer.decode([base[0]])
    assert [base[0]] in bad_words_token_ids(llm.tokenizer, [word])  # it is one token
    [got] = tokens(llm, [greedy(bad_words=[word])])
    assert got[0] != base[0]
