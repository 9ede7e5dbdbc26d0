"""Greedy parity of tensor parallel with the uniproc executor on the 16-prompt parity set.

Chunked prefill (a small token budget) and prefix caching (a second pass over
the same prompts) are on. TP sums the row-parallel partial products in another
order than one process does, so tokens may differ at a near-tie after 32
tokens (tests/e2e/parity.py's rule); anything else fails.
"""

from __future__ import annotations

import pytest

from baton.testing.tiny_model import tiny_model
from tests.plugins.parallel_common import (
    check_cache_dtype_parity,
    check_parity,
    check_prompt_logprobs,
)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases are sharded too
def test_tp2_matches_uniproc(arch, tokenizer):
    check_parity(tiny_model(arch), tokenizer, executor="cuda-tp", tensor_parallel_size=2)


def test_tp2_with_a_bfloat16_cache_matches_uniproc(tokenizer):
    check_cache_dtype_parity(
        tiny_model("llama"), tokenizer, "bfloat16", executor="cuda-tp", tensor_parallel_size=2
    )


def test_tp2_prompt_logprobs_and_token_constraints_match_uniproc(tokenizer):
    check_prompt_logprobs(
        tiny_model("llama"), tokenizer, executor="cuda-tp", tensor_parallel_size=2
    )


@pytest.mark.slow
def test_tp3_smollm2_matches_uniproc(default_model_dir, tokenizer):
    # 9 query / 3 KV heads: 3 ranks of 3 query heads and 1 KV head each (2 does not divide
    # them); one pass (the tiny models' TP tests cover the prefix-cache pass; 3 ranks share 2
    # cores here)
    check_parity(default_model_dir, tokenizer, passes=1, executor="cuda-tp", tensor_parallel_size=3)
