"""Speculative decoding with the pipeline executor (PP=2, a batch queue): refused with a
ConfigError that names the setting, raised by the engine core and seen by the LLM's caller."""

from __future__ import annotations

import pytest

from baton import LLM
from baton.errors import ConfigError
from baton.testing.tiny_model import tiny_model


def test_pp2_refuses_speculation_through_llm(no_leaks):
    with pytest.raises(ConfigError, match=r"speculative\.method='ngram'.*batches in flight"):
        LLM(
            model=str(tiny_model("llama")),
            executor="pipeline",
            pipeline_parallel_size=2,
            device="cpu",
            num_threads=1,
            max_model_len=256,
            speculative={"method": "ngram"},
        )
