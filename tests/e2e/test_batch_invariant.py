"""executor.batch_invariant through the whole engine: vLLM-style needle tests.

A greedy needle request with logprobs=5 (and a seeded sampled one) gives bitwise-equal tokens
and logprobs alone and in random batches of 8-64 other prompts of other lengths, in another
order, under other max_num_batched_tokens (other prefill chunk boundaries) and with ngram
speculation verifying drafts. The tiny model runs in CI; the default model is @slow.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from baton import LLM, SamplingParams
from baton.pooling_params import PoolingParams
from baton.testing.tiny_model import tiny_model

from ..core.test_pooling import ATOL, LONG, want

NEEDLE = (
    "The needle is in the haystack. The needle is in the haystack. Where is the needle? "
    "Say where the needle is, and say it again:"
)
MAX_NEW = 48
BASE: dict[str, Any] = dict(
    block_size=8, max_model_len=512, enable_chunked_prefill=True, batch_invariant=True
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, logprobs=5)


def needle_outputs(
    model: str, others: list[list[int]], at: int, drafts: bool = False, **overrides
) -> list[Any]:
    """The needles' (greedy, seeded) completions when run with ``others`` (token-id prompts,
    each greedy with 1-40 new tokens), the needles placed at index ``at``. ``drafts``: check
    that the engine verified draft tokens (speculation on)."""
    rng = random.Random(len(others) * 31 + at)
    prompts: list[Any] = [{"prompt_token_ids": p} for p in others]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True)
        for _ in others
    ]
    prompts[at:at] = [NEEDLE, NEEDLE]
    params[at:at] = [GREEDY, SEEDED]
    with LLM(model=model, **{**BASE, **overrides}) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if drafts:
            stats = llm.get_stats()
            assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    return [outs[at].outputs[0], outs[at + 1].outputs[0]]


def random_prompts(n: int, seed: int, longest: int = 400) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.randint(3, longest))] for _ in range(n)]


def needle_case(
    n: int, order: str, budget: int, speculation: str | None, max_num_seqs: int
) -> tuple[list[list[int]], int, dict[str, Any]]:
    """A needle case's ``n`` other prompts (random or reversed), the needle's place among them
    and the engine overrides (the budget, speculation without its adaptive switches)."""
    others = random_prompts(n, seed=n)
    if order == "reversed":
        others.reverse()
    at = random.Random(n).randint(0, n)
    overrides: dict[str, Any] = {"max_num_batched_tokens": budget, "max_num_seqs": max_num_seqs}
    if speculation:
        overrides.update(
            {
                "speculative.method": speculation,
                "speculative.disable_by_batch_size": None,
                "speculative.adaptive": False,
            }
        )
    return others, at, overrides


def assert_same(got: list[Any], want: list[Any], case: str) -> None:
    for g, w, which in zip(got, want, ("greedy", "seeded"), strict=True):
        assert g.token_ids == w.token_ids, f"{case}: the {which} needle's tokens differ"
        assert g.logprobs == w.logprobs, f"{case}: the {which} needle's logprobs differ"


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def alone(tiny: str) -> list[Any]:
    return needle_outputs(tiny, [], 0, max_num_batched_tokens=512)


@pytest.mark.parametrize(
    ("n", "order", "budget", "speculation"),
    [
        (8, "random", 512, None),
        (32, "reversed", 96, None),
        (64, "random", 61, None),  # chunks end mid-block
        (12, "random", 128, "ngram"),
    ],
)
def test_needle_is_bitwise_the_same_in_any_batch(tiny, alone, n, order, budget, speculation):
    others, at, overrides = needle_case(n, order, budget, speculation, max_num_seqs=64)
    got = needle_outputs(tiny, others, at, drafts=speculation is not None, **overrides)
    assert_same(got, alone, f"{n} others ({order}), budget {budget}, speculation {speculation}")


def test_pooled_vectors_are_bitwise_the_same_in_any_batch(tiny):
    """Pooling requests take their hidden states from the invariant stack: a prompt's mean-pooled
    vector is the same bits alone and among others under a budget that chunks it, and
    transformers' up to float noise."""
    params = PoolingParams(pooling_type="mean", normalize=False)
    others = random_prompts(9, seed=4, longest=60)
    with LLM(model=tiny, **{**BASE, "max_num_batched_tokens": 256}) as llm:
        [alone] = llm.embed([LONG], params, use_tqdm=False)
    with LLM(model=tiny, **{**BASE, "max_num_batched_tokens": 16}) as llm:
        outs = llm.embed([*others[:4], LONG, *others[4:]], params, use_tqdm=False)
    assert torch.equal(outs[4].outputs.data, alone.outputs.data)
    torch.testing.assert_close(
        alone.outputs.data, want(tiny, LONG, "mean", normalize=False), atol=ATOL, rtol=0
    )


@pytest.mark.slow
def test_needle_on_the_default_model():
    """SmolLM2-135M (float32): alone, among 24 others under a budget of 96 in reversed order,
    and with ngram speculation."""
    want = needle_outputs("smollm2-135m-instruct", [], 0, max_num_batched_tokens=512)
    others = random_prompts(24, seed=3, longest=300)
    got = needle_outputs(
        "smollm2-135m-instruct", others[::-1], 10, max_num_batched_tokens=96, max_num_seqs=32
    )
    assert_same(got, want, "24 others, budget 96")
    got = needle_outputs(
        "smollm2-135m-instruct",
        others[:6],
        3,
        drafts=True,
        max_num_batched_tokens=256,
        **{"speculative.method": "ngram", "speculative.disable_by_batch_size": None},
    )
    assert_same(got, want, "6 others, ngram")
