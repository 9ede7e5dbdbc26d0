"""executor.batch_invariant under tensor parallelism (cuda-tp ranks over gloo on CPU).

Within one tensor_parallel_size the needle's greedy and seeded tokens and logprobs are the same
bits alone, among other prompts in another order, under other max_num_batched_tokens and with
ngram speculation: every rank runs the invariant layer stack on its shards and the o_proj /
down_proj partial sums are added in rank order. Three ranks matter: two partial sums add the
same either way round, three do not (gloo's ring all-reduce, used in their place, fails the
8-others case). Across sizes the bits differ (the split of o_proj / down_proj's inputs changes
their sums): not asserted.
"""

from __future__ import annotations

from typing import Any

import pytest

from baton.testing.tiny_model import tiny_model
from tests.e2e.test_batch_invariant import (
    assert_same,
    needle_case,
    needle_outputs,
    random_prompts,
)

#: tensor_parallel_size -> the tiny model's heads (3 ranks need heads divisible by 3)
HEADS: dict[int, dict[str, int]] = {
    2: {},
    3: dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=192),
}


def _engine(tp: int) -> dict[str, Any]:
    return {"executor": "cuda-tp", "tensor_parallel_size": tp, "num_threads": 1}


@pytest.fixture(scope="module", params=sorted(HEADS))
def tp(request: Any) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def model(tp: int) -> str:
    return str(tiny_model("llama", **HEADS[tp]))


@pytest.fixture(scope="module")
def alone(model: str, tp: int) -> list[Any]:
    return needle_outputs(model, [], 0, max_num_batched_tokens=512, **_engine(tp))


@pytest.mark.parametrize(
    ("n", "order", "budget", "speculation"),
    [
        (8, "random", 61, None),  # chunks end mid-block
        (16, "reversed", 96, None),
        (6, "random", 128, "ngram"),
    ],
)
def test_needle_is_bitwise_the_same_in_any_batch(model, tp, alone, n, order, budget, speculation):
    others, at, overrides = needle_case(n, order, budget, speculation, max_num_seqs=32)
    got = needle_outputs(
        model, others, at, drafts=speculation is not None, **overrides, **_engine(tp)
    )
    assert_same(got, alone, f"TP={tp}: {n} others ({order}), budget {budget}, {speculation}")


@pytest.mark.slow
def test_needle_on_the_default_model_tp3():
    """SmolLM2-135M (9 query / 3 KV heads: 3 ranks) alone and among 12 others in reversed order
    under a budget of 96."""
    want = needle_outputs("smollm2-135m-instruct", [], 0, max_num_batched_tokens=512, **_engine(3))
    others = random_prompts(12, seed=3, longest=300)
    got = needle_outputs(
        "smollm2-135m-instruct",
        others[::-1],
        5,
        max_num_batched_tokens=96,
        max_num_seqs=16,
        **_engine(3),
    )
    assert_same(got, want, "TP=3: 12 others, budget 96")
