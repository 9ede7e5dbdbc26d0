"""Mixture-of-experts models, expert parallel over data-parallel engines, and the DP wave loop.

The DP=2 pair with expert parallel (engines on threads, inproc) is built once for the module;
the engine-death test starts its own pair of processes (zmq).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from baton import LLM, AsyncLLM, SamplingParams
from baton.engine.dp_client import Waves
from baton.errors import ConfigError, EngineDeadError
from baton.routing.types import EngineLoad, RouteRequest
from baton.testing.tiny_model import MOE_ARCHS, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 200, 300, 400, 500, 600, 700], [42]]
EP = {"expert_parallel": True, "dp_wave_check_steps": 4, "num_threads": 1}


@pytest.fixture(scope="module")
def mixtral() -> str:
    return str(tiny_model("mixtral"))


@pytest.fixture(scope="module")
def reference(mixtral: str) -> list[list[int]]:
    """Greedy tokens of one engine holding every expert."""
    llm = LLM(model=mixtral, max_model_len=128)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- MoE models on one engine


# mixtral and qwen2_moe (a shared expert beside the routed ones) in every run; the others slow
@pytest.mark.parametrize(
    "arch",
    [
        a if a in ("mixtral", "qwen2_moe") else pytest.param(a, marks=pytest.mark.slow)
        for a in MOE_ARCHS
    ],
)
def test_moe_models_match_transformers(arch):
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch)
    prompt = [1, 500, 1000, 1500, 2000]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 5:].tolist()
    llm = LLM(model=str(path), max_model_len=64)
    try:
        got = llm.generate({"prompt_token_ids": prompt}, GREEDY.clone(max_tokens=8))
    finally:
        llm.shutdown()
    assert list(got[0].outputs[0].token_ids) == want


def test_tensor_parallel_refuses_moe_models_naming_the_way_out(mixtral):
    from baton.config import BatonConfig
    from baton.parallel.sharding import check_shardable
    from baton.runner import model_config

    with pytest.raises(ConfigError, match="expert_parallel"):
        check_shardable(model_config(BatonConfig.load(model=mixtral)), 2)


def test_experts_that_do_not_split_over_the_engines_are_refused(mixtral):
    async def go() -> None:
        await AsyncLLM.create(model=mixtral, max_model_len=64, data_parallel_size=3, executor=EP)

    with pytest.raises(ConfigError, match=r"4 experts per layer do not split evenly over 3"):
        asyncio.run(go())


# ---------------------------------------------------------------- the frontend's wave books


def test_waves_ignore_stale_messages():
    w = Waves()
    assert w.start() == 0 and w.running
    assert not w.started_by_engine(0)  # the frontend started wave 0 already
    w.completed(0)
    assert (w.current, w.running) == (1, False)
    # a late notice of wave 0 (an engine's, sent before the wave ended) is stale
    assert not w.started_by_engine(0)
    assert w.started_by_engine(1) and w.running  # an idle engine got a request: start wave 1
    w.completed(0)  # stale: wave 1 runs on
    assert (w.current, w.running) == (1, True)
    w.completed(1)
    assert (w.current, w.running, w.completed_waves) == (2, False, 2)


# ---------------------------------------------------------------- DP=2, expert parallel


class PinRouter:
    """Requests named "e<N>-..." go to engine N; the others to the least loaded."""

    def route(self, request: RouteRequest, engines: list[EngineLoad]) -> int:
        rid = request.request_id
        if rid.startswith("e") and "-" in rid:
            return int(rid[1 : rid.index("-")])
        return min(engines, key=lambda e: (e.num_in_flight, e.engine_index)).engine_index

    def finished(self, request_id: str, engine_index: int) -> None:
        pass


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    pending = asyncio.all_tasks(loop)  # AsyncLLM's tasks, cancelled by its shutdown
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


@pytest.fixture(scope="module")
def pair(loop, mixtral):
    llm = loop.run_until_complete(
        AsyncLLM.create(model=mixtral, max_model_len=128, data_parallel_size=2, executor=EP)
    )
    llm.engine.router = PinRouter()  # type: ignore[attr-defined]
    yield llm
    llm.shutdown()


async def _tokens(llm: AsyncLLM, rid: str, prompt: list[int], params=GREEDY) -> list[int]:
    out = None
    async for o in llm.generate({"prompt_token_ids": prompt}, params, rid):
        out = o
    assert out is not None
    return list(out.outputs[0].token_ids)


async def _wave_over(llm: AsyncLLM, timeout: float = 10.0) -> None:
    waves = llm.engine.waves  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while waves.running:
        assert time.monotonic() < deadline, "the wave did not end"
        await asyncio.sleep(0.01)


def test_dp2_expert_parallel_matches_one_engine(loop, pair, reference):
    """Requests on both engines at once: each engine holds 2 of the 4 experts."""

    async def go() -> list[list[int]]:
        return await asyncio.gather(
            *(_tokens(pair, f"e{i % 2}-parity{i}", p) for i, p in enumerate(PROMPTS))
        )

    assert loop.run_until_complete(go()) == reference
    assert pair.engine.engine_loads()[0].num_in_flight == 0  # type: ignore[attr-defined]


def test_one_engine_idle_while_the_other_runs(loop, pair, reference):
    """Every request on engine 1: engine 0 runs dummy batches, its experts still serve them."""

    async def go() -> list[list[int]]:
        await _wave_over(pair)
        return await asyncio.gather(
            *(_tokens(pair, f"e1-idle{i}", p) for i, p in enumerate(PROMPTS))
        )

    assert loop.run_until_complete(go()) == reference


def test_a_request_after_the_wave_ended_starts_the_next(loop, pair, reference):
    waves = pair.engine.waves  # type: ignore[attr-defined]

    async def go() -> None:
        await _tokens(pair, "e0-first", PROMPTS[0])
        await _wave_over(pair)
        done = waves.completed_waves
        before = waves.current
        assert await _tokens(pair, "e0-next", PROMPTS[1]) == reference[1]
        await _wave_over(pair)
        assert waves.current == before + 1 and waves.completed_waves == done + 1

    loop.run_until_complete(go())


def test_an_abort_mid_wave(loop, pair, reference):
    """A long request on engine 0 is aborted while engine 1's runs: engine 1's tokens are
    unchanged, the wave ends, and the next request is served."""
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def go() -> None:
        started = asyncio.Event()

        async def doomed() -> int:
            n = 0
            async for o in pair.generate({"prompt_token_ids": [5, 6, 7]}, long, "e0-doomed"):
                n = len(o.outputs[0].token_ids)
                started.set()
            return n

        task = asyncio.create_task(doomed())
        other = asyncio.create_task(_tokens(pair, "e1-survivor", PROMPTS[2]))
        await started.wait()
        task.cancel()  # AsyncLLM aborts it in its engine
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await other == reference[2]
        await _wave_over(pair)
        assert await _tokens(pair, "e0-after-abort", PROMPTS[3]) == reference[3]

    loop.run_until_complete(go())


def test_killing_one_engine_fails_the_group_in_seconds(mixtral):
    """Engine processes (zmq): SIGKILL of engine 1 mid-wave fails the requests of both
    engines with EngineDeadError, whatever routing.on_engine_death says."""

    async def go() -> None:
        llm = await AsyncLLM.create(
            model=mixtral,
            max_model_len=400,
            data_parallel_size=2,
            transport="zmq",
            executor=EP,
            routing={"router": "round-robin", "on_engine_death": "fail-requests"},
        )
        try:
            params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
            first = asyncio.Event()

            async def one(rid: str) -> Any:
                async for _ in llm.generate({"prompt_token_ids": [1, 2, 3]}, params, rid):
                    first.set()

            a = asyncio.create_task(one("a"))  # engine 0
            b = asyncio.create_task(one("b"))  # engine 1
            await first.wait()
            t0 = time.monotonic()
            os.kill(llm.engine.resources.procs[1].pid, signal.SIGKILL)  # type: ignore[attr-defined]
            got = await asyncio.wait_for(asyncio.gather(a, b, return_exceptions=True), 20)
            assert time.monotonic() - t0 < 10
            assert all(isinstance(g, EngineDeadError) for g in got), got
            assert llm.errored
        finally:
            llm.shutdown()

    asyncio.run(go())
