"""sleep(level) / wake_up(): the KV cache (and at level 2 the weights) freed and brought back.

Real engines on the tiny model: the memory is measured in the worker (the storages of the live
KV-cache and weight tensors, and the process's RSS), the greedy tokens after waking are those
before, requests are refused while asleep and sleep is refused while requests are in flight.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.errors import EngineSleepingError, ExecutorError, InvalidRequestError
from baton.protocol import EngineCoreRequest
from baton.testing.tiny_model import tiny_model
from tests.core.test_engine_core import make_core

KV_BYTES = 32 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
#: 3 layers x K and V x 2 KV heads x head dim 16 x float32: what one token writes in the cache
KV_BYTES_PER_TOKEN = 3 * 2 * 2 * 16 * 4


def prompts(n: int = 6, length: int = 300) -> list[dict]:
    return [{"prompt_token_ids": [100 + 7 * i + j for j in range(length)]} for i in range(n)]


def tokens(llm: LLM, batch: list[dict]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, GREEDY, use_tqdm=False)]


def make_llm(**overrides) -> LLM:
    return LLM(
        model=str(tiny_model("llama")),
        device="cpu",
        num_threads=1,
        max_model_len=1024,
        kv_cache_memory=KV_BYTES,
        **overrides,
    )


def test_level_1_frees_the_kv_cache_keeps_the_weights_and_wakes_with_the_same_tokens():
    with make_llm() as llm:
        batch = prompts()
        before = tokens(llm, batch)
        (mem,) = llm.get_memory_usage()
        runner = llm.engine.core.executor.worker.model_runner
        assert mem.kv_cache_bytes == runner.num_blocks * runner.get_kv_cache_spec().page_size_bytes
        assert mem.kv_cache_bytes >= 0.9 * KV_BYTES and mem.weights_bytes > 0
        cache = weakref.ref(runner.kv_caches[0]._base)  # the one allocation every layer views

        llm.sleep(1)
        gc.collect()
        assert llm.is_sleeping()
        assert cache() is None, "something still holds the KV cache's storage"
        (asleep,) = llm.get_memory_usage()
        assert asleep.kv_cache_bytes == 0
        assert asleep.weights_bytes == mem.weights_bytes and asleep.weights_device == "cpu"
        with pytest.raises(EngineSleepingError, match="wake_up"):
            llm.generate("refused", GREEDY, use_tqdm=False)
        llm.sleep(1)  # again at the same level: nothing to do

        llm.wake_up()
        assert not llm.is_sleeping()
        (awake,) = llm.get_memory_usage()
        assert awake.kv_cache_bytes == mem.kv_cache_bytes
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        # the prefix cache was forgotten with the blocks: nothing is reused after waking
        assert sum(o.num_cached_tokens for o in outs) == 0
        assert [list(o.outputs[0].token_ids) for o in outs] == before
        llm.wake_up()  # awake: a no-op


def test_level_2_drops_the_weights_and_the_engine_process_rss_falls():
    """The engine in its own process (zmq): its RSS falls by at least the weights and the KV
    blocks written, and the weights come back from the model folder."""
    with make_llm(transport="zmq") as llm:
        batch = prompts()
        before = tokens(llm, batch)
        (mem,) = llm.get_memory_usage()
        llm.sleep(2)
        (asleep,) = llm.get_memory_usage()
        assert (asleep.kv_cache_bytes, asleep.weights_bytes, asleep.weights_device) == (0, 0, "")
        assert asleep.pid == mem.pid
        written = sum(len(p["prompt_token_ids"]) + GREEDY.max_tokens for p in batch)
        freed = mem.rss_bytes - asleep.rss_bytes
        assert freed >= 0.8 * (mem.weights_bytes + written * KV_BYTES_PER_TOKEN), (
            f"RSS fell by {freed} bytes only"
        )
        with pytest.raises(EngineSleepingError):
            llm.generate("refused", GREEDY, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="already asleep at level 2"):
            llm.sleep(1)
        llm.wake_up()
        (awake,) = llm.get_memory_usage()
        assert (awake.kv_cache_bytes, awake.weights_bytes) == (
            mem.kv_cache_bytes,
            mem.weights_bytes,
        )
        assert tokens(llm, batch) == before


def test_sleep_is_refused_while_requests_are_in_flight_and_for_a_bad_level():
    config = BatonConfig.load(
        model=str(tiny_model("llama")),
        device="cpu",
        num_threads=1,
        max_model_len=1024,
        kv_cache_memory=4 << 20,
    )
    core = EngineCore(config)
    try:
        core.add_request(
            EngineCoreRequest(
                request_id="busy",
                prompt_token_ids=list(range(10, 40)),
                sampling_params=SamplingParams(temperature=0, max_tokens=50),
                eos_token_id=2,
            )
        )
        core.step_fn()
        with pytest.raises(InvalidRequestError, match="1 request\\(s\\) in flight"):
            core.sleep(1)
        assert not core.is_sleeping()
        core.abort_requests(["busy"])
        for level in (0, 3):
            with pytest.raises(InvalidRequestError, match=f"sleep level {level}") as e:
                core.sleep(level)
            assert e.value.param == "level"
        core.sleep(1)
        assert core.is_sleeping() and core.get_memory_usage()[0].kv_cache_bytes == 0
        core.step_fn()  # the abort's news reaches the sleeping runner: no KV cache needed
        core.wake_up()
        assert not core.is_sleeping()
    finally:
        core.shutdown()


def test_an_executor_without_sleep_is_refused_by_name():
    core = make_core()  # the fake executor has no sleep()/wake_up()
    with pytest.raises(ExecutorError, match="executor FakeExecutor has no sleep"):
        core.sleep(1)
    assert not core.is_sleeping()


def test_data_parallel_refuses_the_calls_that_would_reach_one_engine():
    import asyncio

    from baton import AsyncLLM

    async def main() -> None:
        llm = await AsyncLLM.create(
            model=str(tiny_model("llama")),
            device="cpu",
            num_threads=1,
            max_model_len=512,
            kv_cache_memory=4 << 20,
            data_parallel_size=2,
        )
        try:
            for call in (llm.sleep(1), llm.wake_up(), llm.start_profile(), llm.stop_profile()):
                with pytest.raises(InvalidRequestError, match="data_parallel_size = 2"):
                    await call
            with pytest.raises(InvalidRequestError, match="one engine of 2"):
                await llm.collective_rpc("memory_usage")
            assert not await llm.is_sleeping()
        finally:
            llm.shutdown()

    asyncio.run(main())
