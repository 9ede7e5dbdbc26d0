"""Data-parallel routing: the built-in routers, the router seam, and DP=2 through AsyncLLM."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from baton import AsyncLLM, SamplingParams, hookimpl
from baton.config import BatonConfig
from baton.errors import PluginError, PluginNotFoundError
from baton.plugins.registry import get_plugins
from baton.routing.prefix_aware import PrefixAwareRouter, PrefixAwareSettings, prefix_hashes
from baton.routing.routers import LeastLoadedRouter, RoundRobinRouter
from baton.routing.types import EngineLoad, RouteRequest
from baton.testing.conformance import RouterConformance
from baton.testing.tiny_model import tiny_model


class TestLeastLoaded(RouterConformance):
    name = "least-loaded"


class TestRoundRobin(RouterConformance):
    name = "round-robin"


class TestPrefixAware(RouterConformance):
    name = "prefix-aware"
    settings = {"prefix_blocks": 2, "balance_abs_threshold": 1}


def engines(*in_flight: int) -> list[EngineLoad]:
    return [EngineLoad(engine_index=i, num_in_flight=n) for i, n in enumerate(in_flight)]


def req(rid: str, tokens: list[int], salt: str | None = None) -> RouteRequest:
    return RouteRequest(request_id=rid, prompt_token_ids=tokens, cache_salt=salt, block_size=4)


P1, P2 = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 8, 8, 8, 8]


def test_least_loaded_takes_the_fewest_in_flight_lowest_index_on_ties():
    r = LeastLoadedRouter()
    assert r.route(req("a", P1), engines(3, 1, 2)) == 1
    assert r.route(req("b", P1), engines(2, 2, 2)) == 0


def test_round_robin_takes_turns_whatever_the_load():
    r = RoundRobinRouter()
    assert [r.route(req(str(i), P1), engines(9, 0, 0)) for i in range(5)] == [0, 1, 2, 0, 1]


def test_prefix_aware_keeps_a_prefix_on_its_engine():
    r = PrefixAwareRouter(PrefixAwareSettings(balance_abs_threshold=2))
    assert r.route(req("a", [*P1, 100]), engines(0, 0)) == 0
    assert r.route(req("b", [*P2, 101]), engines(1, 0)) == 1  # new prefix: fewest prefix blocks
    assert r.route(req("c", [*P1, 102]), engines(1, 1)) == 0
    assert r.route(req("d", [*P2, 103]), engines(2, 1)) == 1
    # a longer shared prefix wins over a shorter one: [P1 block 0, P2 block 1] matches P1's first
    # block only; P1's owner takes it
    assert r.route(req("e", [*P1[:4], *P2[4:], 1]), engines(2, 2)) == 0


def test_prefix_aware_splits_new_prefixes_by_the_prefix_blocks_each_engine_holds():
    """Four tenants' first requests while engine 0 is always the less loaded: each engine takes
    two (least-loaded would put all four on engine 0, more prefixes than one cache may hold),
    then each tenant stays; an engine over the load cap takes no new prefix."""
    r = PrefixAwareRouter(PrefixAwareSettings(balance_abs_threshold=2))
    tenants = [[t] * 8 for t in range(10, 14)]
    assert [r.route(req(str(t), p), engines(0, 1)) for t, p in enumerate(tenants)] == [0, 1, 0, 1]
    assert [r.route(req(f"again{t}", p), engines(1, 1)) for t, p in enumerate(tenants)] == [
        0,
        1,
        0,
        1,
    ]
    assert r.route(req("new", [99] * 8), engines(0, 3)) == 0  # 3 > 0 + 2: not engine 1


def test_prefix_aware_counts_a_moved_prefix_for_its_new_engine_only():
    r = PrefixAwareRouter(PrefixAwareSettings(balance_abs_threshold=2))
    a, b, c, d = ([t] * 8 for t in (1, 2, 3, 4))
    assert r.route(req("a", a), engines(0, 0)) == 0
    assert r.route(req("b", b), engines(0, 0)) == 1
    assert r.route(req("c", c), engines(1, 0)) == 1  # as many blocks each: the less loaded
    assert r.route(req("b2", b), engines(0, 3)) == 0  # spilled: engine 0 holds a and b now
    assert r.route(req("d", d), engines(0, 0)) == 1  # engine 1 holds c alone


def test_prefix_aware_spills_an_overloaded_prefix_to_the_least_loaded_engine():
    r = PrefixAwareRouter(PrefixAwareSettings(balance_abs_threshold=2))
    assert r.route(req("a", P1), engines(0, 0)) == 0
    assert r.route(req("b", P1), engines(2, 0)) == 0  # 2 <= 0 + 2: stays
    assert r.route(req("c", P1), engines(3, 0)) == 1  # over the cap: the least loaded takes it
    assert r.route(req("d", P1), engines(3, 1)) == 1  # and now owns the prefix


def test_prefix_aware_needs_a_full_block_and_the_same_salt():
    r = PrefixAwareRouter()
    assert r.route(req("a", P1), engines(0, 0)) == 0
    assert r.route(req("b", P1, salt="other"), engines(1, 0)) == 1  # salted: no shared KV
    assert r.route(req("c", P1[:3]), engines(1, 0)) == 1  # under one block: least loaded
    assert prefix_hashes(req("x", P1[:3]), 8) == []
    assert len(prefix_hashes(req("x", P1 * 10), 8)) == 8


def test_prefix_aware_forgets_the_least_recently_used_prefixes():
    r = PrefixAwareRouter(PrefixAwareSettings(max_prefixes=2, prefix_blocks=1))
    r.route(req("a", P1), engines(0, 0))
    r.route(req("b", P2), engines(1, 0))
    r.route(req("c", [7, 7, 7, 7]), engines(1, 1))
    assert r.route(req("d", P1), engines(0, 1)) == 0  # forgotten: least loaded, not engine 0's
    assert r.route(req("e", P1), engines(1, 0)) == 0  # learnt again


def run_dp(router: str, prompts: list[list[int]], **kw: Any) -> tuple[list[int], list[EngineLoad]]:
    """Two waves on DP=2 (the first prompt of each prefix, then the rest, all at once): the
    prefix-cache hits of every engine, and their loads after."""

    async def go() -> tuple[list[int], list[EngineLoad]]:
        llm = await AsyncLLM.create(
            model=str(tiny_model("llama")),
            max_model_len=128,
            data_parallel_size=2,
            routing={"router": router},
            **kw,
        )
        try:
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

            async def one(i: int, p: list[int]) -> None:
                async for _ in llm.generate({"prompt_token_ids": p}, params, f"q{i}"):
                    pass

            await asyncio.gather(one(0, prompts[0]), one(1, prompts[1]))
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts[2:], 2)))
            engine_loads = llm.engine.engine_loads()  # type: ignore[attr-defined]
            return [e.prefix_cache_hits for e in engine_loads], engine_loads
        finally:
            llm.shutdown()

    return asyncio.run(go())


def test_dp2_prefix_aware_finds_the_prefixes_its_engines_cached():
    """Tenant A's and B's 64-token prefixes: first one request each (one per engine), then
    three of A and three of B at once, A's first. prefix-aware sends each tenant to the engine
    that has its prefix: all six hit; least-loaded sends them wherever there is room."""
    a, b = list(range(100, 164)), list(range(200, 264))
    prompts = [
        [*a, 1],
        [*b, 2],
        *[[*a, 10 + i] for i in range(3)],
        *[[*b, 20 + i] for i in range(3)],
    ]
    hits, after = run_dp("prefix-aware", prompts)
    assert sum(hits) == 6 * 64 and all(h > 0 for h in hits)
    assert [e.num_in_flight for e in after] == [0, 0]
    ll_hits, _ = run_dp("least-loaded", prompts)
    assert sum(ll_hits) < sum(hits)


class Broken:
    BATON_PLUGIN_API = 1

    class Router:
        def route(self, request: RouteRequest, engines: list[EngineLoad]) -> int:
            return 7

        def finished(self, request_id: str, engine_index: int) -> None:
            pass

    @hookimpl
    def register_routers(self, register: Any) -> None:
        register("broken", lambda config, settings: Broken.Router())


def test_a_router_returning_no_engine_fails_the_request_naming_it():
    get_plugins().register(Broken(), "broken-router", "baton-contrib-broken", "0.1")
    try:

        async def go() -> None:
            llm = await AsyncLLM.create(
                model=str(tiny_model("llama")),
                max_model_len=128,
                data_parallel_size=2,
                routing={"router": "broken"},
            )
            try:
                with pytest.raises(PluginError, match=r"router 'broken' returned engine 7"):
                    async for _ in llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams()):
                        pass
                assert not llm.errored  # one request failed; the engines serve on
                assert [e.num_in_flight for e in llm.engine.engine_loads()] == [0, 0]  # type: ignore[attr-defined]
            finally:
                llm.shutdown()

        asyncio.run(go())
    finally:
        get_plugins().unregister("broken-router")


def test_an_unknown_router_is_refused_before_the_model_loads():
    with pytest.raises(PluginNotFoundError, match=r"router 'nope' is not installed"):
        asyncio.run(AsyncLLM.create(model="/nonexistent", data_parallel_size=2, router="nope"))


def test_config_and_cli_name_the_router_and_dp():
    from baton.cli.main import build_parser, engine_overrides

    args = build_parser().parse_args(
        ["generate", "--dp", "2", "--set", "routing.router=prefix-aware", "hi"]
    )
    cfg = BatonConfig.load(**engine_overrides(args))
    assert cfg.executor.data_parallel_size == 2 and cfg.routing.router == "prefix-aware"


def test_the_synchronous_llm_refuses_data_parallel():
    from baton import LLM
    from baton.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"data_parallel_size = 2 needs the asyncio"):
        LLM(model=str(tiny_model("llama")), max_model_len=64, data_parallel_size=2)


@pytest.mark.parametrize("policy", ["fail-requests", "fail-server"])
def test_one_engine_dying(policy):
    """Engine processes over zmq; engine 1 is killed mid-generation. fail-requests: its request
    fails, engine 0's finishes and new requests go to engine 0; fail-server: everything fails."""
    import os
    import signal

    from baton.errors import EngineDeadError

    async def go() -> None:
        llm = await AsyncLLM.create(
            model=str(tiny_model("llama")),
            max_model_len=400,
            data_parallel_size=2,
            transport="zmq",
            routing={"router": "round-robin", "on_engine_death": policy},
        )
        try:
            params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
            first_token = asyncio.Event()

            async def one(rid: str) -> int:
                n = 0
                async for o in llm.generate({"prompt_token_ids": [1, 2, 3]}, params, rid):
                    n = len(o.outputs[0].token_ids)
                    first_token.set()
                return n

            a = asyncio.create_task(one("a"))  # round-robin: engine 0
            b = asyncio.create_task(one("b"))  # engine 1
            await first_token.wait()
            procs = llm.engine.resources.procs  # type: ignore[attr-defined]
            # fail-server: engine 0 is held (SIGSTOP) so that "a" is surely unfinished when
            # engine 1 dies; 300 tokens of the tiny model can outrun the death notice
            held = policy == "fail-server"
            if held:
                os.kill(procs[0].pid, signal.SIGSTOP)
            try:
                os.kill(procs[1].pid, signal.SIGKILL)
                got_a, got_b = await asyncio.gather(a, b, return_exceptions=True)
            finally:
                if held:
                    os.kill(procs[0].pid, signal.SIGCONT)
            assert isinstance(got_b, EngineDeadError), got_b
            if policy == "fail-requests":
                assert "engine 1" in str(got_b)
                assert got_a == 300 and not llm.errored
                loads = llm.engine.engine_loads()  # type: ignore[attr-defined]
                assert [e.engine_index for e in loads] == [0] and loads[0].num_in_flight == 0
                assert await one("c") == 300  # the live engine serves on
            else:
                assert isinstance(got_a, EngineDeadError) and llm.errored
        finally:
            llm.shutdown()

    asyncio.run(go())


class LastEngine:
    """A third party's router: every request to the highest engine index."""

    BATON_PLUGIN_API = 1

    class Router:
        def route(self, request: RouteRequest, engines: list[EngineLoad]) -> int:
            return max(e.engine_index for e in engines)

        def finished(self, request_id: str, engine_index: int) -> None:
            pass

    @hookimpl
    def register_routers(self, register: Any) -> None:
        register("last-engine", lambda config, settings: LastEngine.Router())


def test_hook_register_routers():
    get_plugins().register(LastEngine(), "last-engine-router", "baton-contrib-last", "0.1")
    try:
        prompts = [list(range(100, 140)), list(range(200, 240)), *[list(range(100, 140))] * 4]
        _, loads = run_dp("last-engine", prompts)
        assert loads[0].prefix_cache_queries == 0 and loads[1].prefix_cache_queries > 0
    finally:
        get_plugins().unregister("last-engine-router")
