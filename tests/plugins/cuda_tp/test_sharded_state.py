"""save_sharded_state from a TP=2 engine, loaded back at TP=2 without resharding."""

from __future__ import annotations

import json

import pytest

from baton.errors import ConfigError
from baton.model.sharded_state import MARKER
from baton.testing.tiny_model import tiny_model
from tests.core.test_sharded_state import greedy, make_llm


def test_tp2_save_then_load_gives_the_same_tokens_and_other_sizes_are_refused(tmp_path):
    dest = tmp_path / "tp2"
    tp2 = {"executor": "cuda-tp", "tensor_parallel_size": 2}
    with make_llm(str(tiny_model("llama")), **tp2) as llm:
        want = greedy(llm)
        llm.save_sharded_state(str(dest))
    names = {p.name for p in dest.iterdir()}
    assert {"model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"} <= names
    assert json.loads((dest / MARKER).read_text())["tensor_parallel_size"] == 2
    with make_llm(str(dest), load_format="sharded_state", **tp2) as llm:
        assert greedy(llm) == want
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2.*tensor_parallel_size=1"):
        make_llm(str(dest), load_format="sharded_state")
