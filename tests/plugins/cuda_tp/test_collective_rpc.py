"""collective_rpc through the multiprocess executor: one result per rank, in rank order."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from baton import AsyncLLM
from baton.errors import InvalidRequestError
from baton.protocol import WorkerMemory
from baton.testing.tiny_model import tiny_model
from tests.core.test_collective_rpc import make_llm, still_serves


def test_every_rank_answers_and_an_unknown_name_leaves_the_engine_up():
    with make_llm(executor="cuda-tp", tensor_parallel_size=2) as llm:
        mems = [msgspec.convert(m, WorkerMemory) for m in llm.collective_rpc("memory_usage")]
        assert [m.rank for m in mems] == [0, 1] and len({m.pid for m in mems}) == 2
        specs = llm.collective_rpc("get_kv_cache_spec")
        assert [s[2] for s in specs] == [1, 1]  # num_kv_heads: the tiny model's 2, split in two
        with pytest.raises(InvalidRequestError, match="'shutdown' is neither"):
            llm.collective_rpc("shutdown")
        still_serves(llm)


def test_async_llm_collective_rpc():
    async def main() -> list:
        llm = await AsyncLLM.create(
            model=str(tiny_model("llama")),
            executor="cuda-tp",
            tensor_parallel_size=2,
            device="cpu",
            num_threads=1,
            max_model_len=512,
            kv_cache_memory=4 << 20,
        )
        try:
            return await llm.collective_rpc("get_model_info")
        finally:
            llm.shutdown()

    infos = asyncio.run(main())
    assert len(infos) == 2 and infos[0] == infos[1]
