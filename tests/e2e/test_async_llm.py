"""AsyncLLM behaviours the server relies on: unique live ids, aborts in the stats, death noticed while idle."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from baton import AsyncLLM, SamplingParams
from baton.errors import EngineDeadError, EngineShuttingDownError, InvalidRequestError

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
LONGER = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)


class Recorder:
    def __init__(self) -> None:
        self.finished: list[str] = []
        self.last_running: int | None = None

    def record(self, scheduler_stats, iteration_stats, engine_index=0) -> None:
        if iteration_stats is not None:
            self.finished += [f.finish_reason for f in iteration_stats.finished_requests]
        if scheduler_stats is not None:
            self.last_running = scheduler_stats.num_running_reqs

    def log(self) -> None:
        pass


async def test_a_live_request_id_cannot_be_reused(model_dir):
    llm = await AsyncLLM.create(model=model_dir, max_model_len=512)
    try:
        first = llm.generate(
            "hello", SamplingParams(max_tokens=30, ignore_eos=True), request_id="same"
        )
        out = await anext(first)
        with pytest.raises(InvalidRequestError, match="already in flight"):
            await anext(llm.generate("again", SamplingParams(max_tokens=3), request_id="same"))
        outs = [o async for o in first]
        out = outs[-1] if outs else out
        assert out.finished and len(out.outputs[0].token_ids) == 30  # the first one is unharmed
        outs = [
            o async for o in llm.generate("reuse", SamplingParams(max_tokens=2), request_id="same")
        ]
        assert outs[-1].finished  # and the id is free again once it finished
    finally:
        llm.shutdown()


async def test_cancelled_consumer_is_counted_as_abort_and_engine_goes_idle(model_dir):
    llm = await AsyncLLM.create(model=model_dir, max_model_len=2048, transport="zmq")
    rec = Recorder()
    llm.stat_loggers.loggers.append(rec)
    try:

        async def consume():
            # 2000 tokens: still running well after the stats say so (polled every 10 ms)
            async for _ in llm.generate("story", LONGER):
                pass

        task = asyncio.ensure_future(consume())
        while rec.last_running != 1:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rec.finished == ["abort"]
        for _ in range(500):  # the engine reports once more when it goes idle
            if rec.last_running == 0:
                break
            await asyncio.sleep(0.01)
        assert rec.last_running == 0
        stats = await llm.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()


async def test_death_is_noticed_while_idle(model_dir):
    llm = await AsyncLLM.create(model=model_dir, max_model_len=512, transport="zmq")
    try:
        os.kill(llm.engine.resources.procs[0].pid, signal.SIGKILL)
        err = await asyncio.wait_for(llm.wait_until_dead(), 10)
        assert isinstance(err, EngineDeadError) and llm.errored
        with pytest.raises(EngineDeadError):
            await anext(llm.generate("x", SamplingParams(max_tokens=2)))
    finally:
        llm.shutdown()


async def test_shutdown_ends_waiting_requests(model_dir):
    llm = await AsyncLLM.create(model=model_dir, max_model_len=512)
    gen = llm.generate("story", LONG)
    await anext(gen)
    llm.shutdown()
    with pytest.raises(EngineShuttingDownError):
        async for _ in gen:
            pass


async def test_pooled_vectors_cross_the_zmq_transport_unchanged(model_dir):
    """A pooling request in an engine process: the vector that comes back is the in-process one
    (a batch of other work may round differently: equal to float32 precision)."""
    from baton import LLM, PoolingParams

    prompts = [list(range(100, 140)), [7, 8]]
    params = PoolingParams(pooling_type="mean")
    with LLM(model=model_dir, max_model_len=512) as local:
        want = [o.outputs.data for o in local.embed(prompts, params, use_tqdm=False)]
    llm = await AsyncLLM.create(model=model_dir, max_model_len=512, transport="zmq")
    try:
        outs = await asyncio.gather(
            *(anext(llm.encode({"prompt_token_ids": p}, params)) for p in prompts),
            anext(llm.generate("hello", SamplingParams(max_tokens=4))),
        )
    finally:
        llm.shutdown()
    for out, vec in zip(outs[:2], want, strict=True):
        assert out.finished
        torch.testing.assert_close(out.outputs.data, vec, atol=1e-5, rtol=0)
