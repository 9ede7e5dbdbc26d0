"""Greedy parity of the ``ray`` executor with uniproc on the 16-prompt parity set.

The ranks are Ray actors on a 2-node local cluster and run the local executors'
runner (sharded, cut into stages); chunked prefill and prefix caching on (a
second pass over the same prompts starts from cached prefixes), as for
tests/plugins/cuda_tp/test_parity.py and tests/plugins/pipeline/test_parity.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from baton.testing.tiny_model import tiny_model
from tests.plugins import parallel_common
from tests.plugins.ray.conftest import assert_nothing_left


def check_parity(model_dir: Path, tokenizer: Any, passes: int = 2, **parallel: Any) -> None:
    """parallel_common's parity check on the ``ray`` executor; no actor or group left after."""
    parallel_common.check_parity(model_dir, tokenizer, passes, executor="ray", **parallel)
    assert_nothing_left()


def test_tp2xpp2_matches_uniproc(tokenizer, ray_cluster):
    # 4 actors over both nodes: two stages of two tensor-parallel ranks, two batches in flight
    check_parity(tiny_model("llama"), tokenizer, tensor_parallel_size=2, pipeline_parallel_size=2)


# each layout alone: slow only for the seconds its actors take to start on 2 cores (the
# composed layout above runs both code paths; test_conformance.py runs TP=2 and PP=2 ranks)
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_one_kind_of_parallelism_matches_uniproc(tp, pp, tokenizer, ray_cluster):
    check_parity(tiny_model("llama"), tokenizer, tensor_parallel_size=tp, pipeline_parallel_size=pp)


@pytest.mark.slow
def test_tp3_smollm2_matches_uniproc(default_model_dir, tokenizer, ray_cluster):
    # 9 query / 3 KV heads: 3 ranks of 3 query heads and 1 KV head each, on both nodes; one
    # pass (the tiny models' tests cover the prefix-cache pass; 3 ranks share 2 cores here)
    check_parity(default_model_dir, tokenizer, passes=1, tensor_parallel_size=3)
