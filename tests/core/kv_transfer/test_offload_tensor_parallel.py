"""``offload`` over two tensor-parallel worker processes (cuda-tp on CPU): each rank keeps its
shard of every block in its RAM tier and its own disk files; a prompt the pool forgot comes
back from RAM, then from disk in a new engine, with the tokens of connector off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from baton import LLM, SamplingParams
from baton.testing.tiny_model import tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = {"prompt_token_ids": list(range(1000, 1100))}  # 6 full blocks, the last 4 computed
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def two_ranks(kv: dict[str, Any]) -> LLM:
    return LLM(
        model=str(tiny_model("llama")),
        executor="cuda-tp",
        tensor_parallel_size=2,
        device="cpu",
        num_threads=1,
        max_model_len=256,
        kv_cache_memory=4 << 20,
        kv_transfer=kv,
    )


def twice(llm: LLM) -> list[tuple[list[int], int]]:
    runs = []
    for _ in range(2):
        (r,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
        assert r.error is None, r.error
        runs.append((list(r.outputs[0].token_ids), r.num_cached_tokens))
        assert llm.reset_prefix_cache()
    return runs


def test_offload_over_two_tensor_parallel_ranks(tmp_path: Path) -> None:
    pytest.importorskip("baton_cuda_tp")
    with two_ranks({"connector": "none"}) as llm:
        (off, _), _ = twice(llm)
    tier = {"cpu_memory": "64MiB", "disk_path": str(tmp_path)}
    with two_ranks({"connector": "offload", "offload": tier}) as llm:
        first, second = twice(llm)
    assert first == (off, 0) and second == (off, 96)
    shards = sorted(p.name.rsplit("-", 2)[1] for p in tmp_path.iterdir())
    assert shards == ["tp0", "tp1"]  # each rank wrote its own shard's files
    restarted = {"connector": "offload", "offload": {**tier, "cpu_memory": 0}}
    with two_ranks(restarted) as llm:
        from_disk, _ = twice(llm)
    assert from_disk == (off, 96)
