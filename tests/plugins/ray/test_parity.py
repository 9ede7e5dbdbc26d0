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

from baton import LLM, SamplingParams
from baton.testing.tiny_model import tiny_model
from tests.e2e.parity import PROMPTS, assert_parity
from tests.plugins.parallel_common import MAX_NEW, PARITY_BASE
from tests.plugins.ray.conftest import assert_nothing_left

_reference: dict[str, list[list[int]]] = {}


def generate(model_dir: Path, prompt_ids: list[list[int]], passes: int, **overrides: Any) -> Any:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    out = []
    with LLM(model=str(model_dir), **{**PARITY_BASE, **overrides}) as llm:
        for _ in range(passes):
            res = llm.generate(
                [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False
            )
            out.append([o.outputs[0].token_ids for o in res])
            cached = sum(o.num_cached_tokens for o in res)
        assert passes == 1 or cached > 0, "the second pass should start from cached prefixes"
    return out


def check_parity(model_dir: Path, tokenizer: Any, **parallel: Any) -> None:
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    key = str(model_dir)
    if key not in _reference:  # uniproc, once per model
        (_reference[key],) = generate(model_dir, prompt_ids, 1)
    for ours in generate(model_dir, prompt_ids, 2, executor="ray", **parallel):
        assert_parity(model_dir, prompt_ids, ours, _reference[key])
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
    # 9 query / 3 KV heads: 3 ranks of 3 query heads and 1 KV head each, on both nodes
    check_parity(default_model_dir, tokenizer, tensor_parallel_size=3)
