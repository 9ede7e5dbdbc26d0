"""Greedy parity of pipeline parallel with the uniproc executor on the 16-prompt parity set.

Chunked prefill and prefix caching on, as for tensor parallel
(tests/plugins/cuda_tp/test_parity.py); stages compute exactly what one process
does, but the batch queue changes which requests share a batch.
"""

from __future__ import annotations

import pytest

from baton.testing.tiny_model import tiny_model
from tests.plugins.parallel_common import ParallelParity, check_parity


class TestPP2Parity(ParallelParity):
    executor = "pipeline"
    parallel = {"pipeline_parallel_size": 2}


@pytest.mark.slow
def test_pp2_tp2_composed_matches_uniproc(tokenizer):
    # 4 workers: two stages of two tensor-parallel ranks each
    check_parity(
        tiny_model("llama"),
        tokenizer,
        executor="pipeline",
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
    )


@pytest.mark.slow
def test_pp2_smollm2_matches_uniproc(default_model_dir, tokenizer):
    check_parity(default_model_dir, tokenizer, executor="pipeline", pipeline_parallel_size=2)
