"""Data-parallel engine cores as Ray actors (``executor.data_parallel_backend = "ray"``).

Two engine actors on the package's 2-node cluster, the frontend (AsyncLLM) in this
process, zmq over tcp on 127.0.0.1: greedy tokens as one engine's and as two local
engine processes'; ``ray.kill`` of an engine actor seen as a dead engine
(fail-requests: its requests fail, the other engine's go on; fail-server: every
request fails) within 5 s, and so is an engine actor that stops answering its
pings (SIGSTOP: what a node gone without a word looks like); no actor left after
shutdown; refusals of what cannot work.
Each engine actor imports torch (~30 s here), so the tests share as few as they can.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from baton import LLM, AsyncLLM, SamplingParams
from baton.errors import ConfigError, EngineDeadError
from baton.testing.tiny_model import tiny_model
from tests.plugins.ray.conftest import ray

PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11], [42] * 9, [5, 100, 200, 300]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BASE: dict[str, Any] = {"max_model_len": 2048, "device": "cpu", "num_threads": 1}
#: a request long enough (~1 s of the tiny model) to be unfinished when its engine is killed
#: (``ray.kill`` and node removal take some hundreds of ms)
LONG = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
TCP = {"transport": "zmq", "transport.zmq": {"protocol": "tcp", "host": "127.0.0.1"}}


def engine_actors() -> list[dict[str, str]]:
    """The engine-core actors alive in the cluster (named baton-engine-<launcher id>-<index>)."""
    return [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("baton-engine-")
    ]


def assert_no_engine_actor_left(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine_actors() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine_actors(), f"engine actors left behind: {engine_actors()}"


def kill_engine_actor(index: int) -> float:
    (victim,) = [a for a in engine_actors() if a["name"].endswith(f"-{index}")]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]))
    return time.monotonic()


async def start(backend: str, **overrides: Any) -> AsyncLLM:
    return await AsyncLLM.create(
        model=str(tiny_model("llama")),
        data_parallel_size=2,
        data_parallel_backend=backend,
        **{**BASE, **TCP, **overrides},
    )


async def greedy(llm: AsyncLLM) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for o in llm.generate({"prompt_token_ids": prompt}, GREEDY, f"p{i}"):
            tokens = list(o.outputs[0].token_ids)
        return tokens

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


async def kill_mid_generation(llm: AsyncLLM, hold_a: bool = False) -> tuple[Any, Any, float]:
    """Requests "a" (engine 0) and "b" (engine 1, round-robin); engine 1's actor is killed
    once both have a token. What each ended with, and when the kill was answered (s).

    ``hold_a`` stops engine 0's process (SIGSTOP) before the kill and resumes it after, so
    that "a" is surely still running when engine 1 dies."""
    started = {"a": asyncio.Event(), "b": asyncio.Event()}
    ended: dict[str, float] = {}

    async def one(rid: str) -> int:
        n = 0
        try:
            async for o in llm.generate({"prompt_token_ids": [1, 2, 3]}, LONG, rid):
                n = len(o.outputs[0].token_ids)
                started[rid].set()
        finally:
            ended[rid] = time.monotonic()
        return n

    a, b = asyncio.create_task(one("a")), asyncio.create_task(one("b"))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 120)
    held = llm.engine.resources.procs[0].pid if hold_a else None  # type: ignore[attr-defined]
    if held is not None:
        os.kill(held, signal.SIGSTOP)
    try:
        killed_at = await asyncio.get_running_loop().run_in_executor(None, kill_engine_actor, 1)
        got_a, got_b = await asyncio.gather(a, b, return_exceptions=True)
    finally:
        if held is not None:
            os.kill(held, signal.SIGCONT)
    return got_a, got_b, ended["b"] - killed_at


def test_ray_engines_match_one_engine_and_local_processes_and_fail_requests_alone(ray_cluster):
    with LLM(model=str(tiny_model("llama")), **BASE) as llm:
        one_engine = [
            o.outputs[0].token_ids
            for o in llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False
            )
        ]

    async def go() -> None:
        local = await start("mp")
        try:
            assert await greedy(local) == one_engine
        finally:
            local.shutdown()

        llm = await start(
            "ray",
            routing={"router": "round-robin", "on_engine_death": "fail-requests"},
            **{"executor.ray": {"engine_heartbeat_timeout": 2.0}},
        )
        try:
            assert len(engine_actors()) == 2
            assert await greedy(llm) == one_engine
            got_a, got_b, noticed_s = await kill_mid_generation(llm)
            assert isinstance(got_b, EngineDeadError), got_b
            assert "engine 1" in str(got_b)
            assert noticed_s < 5.0, f"the dead engine was noticed after {noticed_s:.1f} s"
            assert got_a == LONG.max_tokens and not llm.errored
            assert [e.engine_index for e in llm.engine.engine_loads()] == [0]  # type: ignore[attr-defined]
            assert await greedy(llm) == one_engine  # engine 0 serves on
            # the last engine stops answering (its process stopped, its pid alive): dead once
            # its ping is 2 s overdue, and with it the frontend
            os.kill(llm.engine.resources.procs[0].pid, signal.SIGSTOP)  # type: ignore[attr-defined]
            stopped_at = time.monotonic()
            with pytest.raises(EngineDeadError, match="ping went unanswered for 2 s"):
                await greedy(llm)
            assert time.monotonic() - stopped_at < 5.0
            assert llm.errored
        finally:
            llm.shutdown()
        assert_no_engine_actor_left()

    asyncio.run(go())


def test_a_killed_ray_engine_fails_the_server_within_5_s(ray_cluster):
    async def go() -> None:
        llm = await start(
            "ray", routing={"router": "round-robin", "on_engine_death": "fail-server"}
        )
        try:
            got_a, got_b, noticed_s = await kill_mid_generation(llm, hold_a=True)
            assert isinstance(got_a, EngineDeadError) and isinstance(got_b, EngineDeadError)
            assert noticed_s < 5.0, f"the dead engine was noticed after {noticed_s:.1f} s"
            assert llm.errored
        finally:
            llm.shutdown()
        assert_no_engine_actor_left()

    asyncio.run(go())


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"transport": "shm"}, r"transport.name='shm' works within one machine"),
        ({"transport": "inproc"}, r"transport.name='inproc' keeps them in it"),
        ({"expert_parallel": True}, r"expert_parallel: expert-parallel engines meet"),
    ],
    ids=["shm", "inproc", "expert-parallel"],
)
def test_what_cannot_cross_hosts_is_refused(ray_cluster, overrides, fragment):
    async def go() -> None:
        with pytest.raises(ConfigError, match=fragment):
            await start("ray", **overrides)

    asyncio.run(go())
    assert_no_engine_actor_left(timeout=0)


def test_endpoints_only_this_machine_reaches_are_named():
    """What refuses an engine placed on another machine (not run here: one machine)."""
    from baton_ray.launcher import single_host_endpoint
    from baton_zmq.transport import ZmqAddress

    def address(endpoint: str) -> ZmqAddress:
        return ZmqAddress(input=endpoint, output=endpoint, frontend_pid=1, num_engines=2)

    assert "unix socket" in single_host_endpoint(address("ipc:///tmp/baton_zmq_1/in"))
    assert "loopback" in single_host_endpoint(address("tcp://127.0.0.1:5555"))
    assert "loopback" in single_host_endpoint(address("tcp://[::1]:5555"))
    assert single_host_endpoint(address("tcp://10.0.0.1:5555")) is None


@pytest.mark.slow
def test_the_death_of_the_engines_node_is_engine_dead_within_5_s(ray_cluster):
    # a third node that only these engine actors may use (its custom resource)
    node = ray_cluster.add_node(num_cpus=2, resources={"baton_dp_victim": 2})

    async def go() -> None:
        llm = await start("ray", **{"executor.ray": {"engine_resources": {"baton_dp_victim": 1}}})
        try:
            first = asyncio.Event()

            async def one(rid: str) -> None:
                async for _ in llm.generate({"prompt_token_ids": [1, 2, 3]}, LONG, rid):
                    first.set()

            task = asyncio.create_task(one("a"))
            await asyncio.wait_for(first.wait(), 120)
            t0 = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: ray_cluster.remove_node(node, allow_graceful=False)
            )
            with pytest.raises(EngineDeadError):
                await task
            assert time.monotonic() - t0 < 5.0
            assert llm.errored
        finally:
            llm.shutdown()
        assert_no_engine_actor_left()

    asyncio.run(go())


def test_the_executor_and_the_launcher_share_the_ray_sub_table():
    """[executor.ray] is read by both (one settings model): a bad key is one problem, once."""
    from baton.config import BatonConfig
    from baton.plugins.check import check_config_plugins
    from baton.plugins.registry import get_registry

    def check(**overrides: Any) -> Any:
        return check_config_plugins(BatonConfig.load(**overrides), get_registry())

    selected = check(data_parallel_backend="ray", **{"executor.ray": {"engine_num_cpus": 2}})
    (launcher,) = [s for s in selected if s.kind == "engine_launcher"]
    assert launcher.name == "ray" and launcher.settings["engine_num_cpus"] == 2
    with pytest.raises(ConfigError) as err:
        check(data_parallel_backend="ray", **{"executor.ray": {"engine_cpus": 2}})
    assert str(err.value).count("executor.ray.engine_cpus: unknown setting") == 1
