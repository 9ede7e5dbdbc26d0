"""Greedy parity of tensor parallel with the uniproc executor on the 16-prompt parity set.

Chunked prefill (a small token budget) and prefix caching (a second pass over
the same prompts) are on. TP sums the row-parallel partial products in another
order than one process does, so tokens may differ at a near-tie after 32
tokens (tests/e2e/parity.py's rule); anything else fails.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.plugins.parallel_common import ParallelParity, check_parity


class TestTP2Parity(ParallelParity):
    executor = "cuda-tp"
    parallel = {"tensor_parallel_size": 2}

    @pytest.fixture(params=["llama", "qwen2"])  # qwen2: q/k/v biases are sharded too
    def arch(self, request: Any) -> str:
        return str(request.param)


@pytest.mark.slow
def test_tp3_smollm2_matches_uniproc(default_model_dir, tokenizer):
    # 9 query / 3 KV heads: 3 ranks of 3 query heads and 1 KV head each (2 does not divide
    # them); one pass (the tiny models' TP tests cover the prefix-cache pass; 3 ranks share 2
    # cores here)
    check_parity(default_model_dir, tokenizer, passes=1, executor="cuda-tp", tensor_parallel_size=3)
