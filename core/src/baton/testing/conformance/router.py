"""Conformance suite for data-parallel routers: subclass ``RouterConformance``.

    from baton.testing.conformance import RouterConformance

    class TestMyRouter(RouterConformance):
        name = "mine"               # looked up in the plugin registry
        settings = {"depth": 2}     # the [routing.mine] sub-table (optional)

or override ``make_router(self, config)``. The checks: it implements
``baton.interfaces.Router``; for one to five engines under any load, for prompts
from empty to thousands of tokens, salted or not, it returns the engine_index of
one of the engines it was given; ``finished`` takes every routed request, and a
request id it never routed; it leaves the engines' loads as they were; and through
real engines (two engine cores on threads behind ``AsyncLLM``, a tiny random-weight
model) greedy outputs are exactly those of one engine.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, ClassVar

import pytest

from baton import AsyncLLM, SamplingParams
from baton.config import BatonConfig
from baton.interfaces import Router
from baton.plugins.registry import get_registry
from baton.routing.types import EngineLoad, RouteRequest
from baton.testing.tiny_model import tiny_model


def loads(n: int, rng: random.Random) -> list[EngineLoad]:
    return [
        EngineLoad(
            engine_index=i,
            num_in_flight=rng.choice([0, 1, 3, 50]),
            num_running=rng.randint(0, 8),
            num_waiting=rng.randint(0, 8),
            kv_cache_usage=rng.random(),
            prefix_cache_queries=1000,
            prefix_cache_hits=rng.randint(0, 1000),
        )
        for i in range(n)
    ]


class RouterConformance:
    """Behaviour every router must show. Set ``name`` or override ``make_router``."""

    pytestmark = [pytest.mark.timeout(300)]

    #: The registered router name.
    name: ClassVar[str | None] = None
    #: Its ``[routing.<name>]`` settings for every test.
    settings: ClassVar[dict[str, Any]] = {}

    def config(self, **overrides: Any) -> BatonConfig:
        if self.name is None:
            raise NotImplementedError("set name = '<registered router>' or override config")
        routing: dict[str, Any] = {"router": self.name}
        if self.settings:
            routing[self.name] = dict(self.settings)
        return BatonConfig.load(routing=routing, **overrides)

    def make_router(self, config: BatonConfig) -> Router:
        entry = get_registry().get("router", config.routing.router)
        router: Router = entry.create(config, entry.settings(config))
        return router

    # ------------------------------------------------------------------ the protocol

    def test_is_a_router(self) -> None:
        assert isinstance(self.make_router(self.config()), Router)

    @pytest.mark.parametrize("num_engines", [1, 2, 3, 5])
    def test_routes_every_request_to_an_engine_it_was_given(self, num_engines: int) -> None:
        router = self.make_router(self.config())
        rng = random.Random(num_engines)
        shared = [rng.randrange(49000) for _ in range(64)]
        prompts = [
            [],
            [5],
            [*shared, 1, 2],
            [*shared, 3],
            [rng.randrange(49000) for _ in range(3000)],
            shared[:15],
        ]
        routed = []
        for i in range(60):
            prompt = prompts[i % len(prompts)]
            req = RouteRequest(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                cache_salt=None if i % 3 else f"tenant{i % 2}",
                user=f"u{i % 4}",
                priority=i % 2,
                block_size=16,
            )
            engines = loads(num_engines, rng)
            before = list(engines)
            idx = router.route(req, engines)
            assert type(idx) is int and idx in {e.engine_index for e in engines}, idx
            assert engines == before
            routed.append((req.request_id, idx))
            if i % 4 == 3:  # some finish along the way
                router.finished(*routed.pop(0))
        for rid, idx in routed:
            router.finished(rid, idx)
        router.finished("never-routed", 0)

    # ------------------------------------------------------------------ through real engines

    def test_outputs_through_two_engines_equal_one_engines(self) -> None:
        model = str(tiny_model("llama"))
        prefix = list(range(100, 148))
        prompts = [[*prefix, i, i + 1] for i in range(6)] + [[7, 8, 9], list(range(300, 340))]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

        async def run(**kw: Any) -> tuple[list[list[int]], list[EngineLoad] | None]:
            routing: dict[str, Any] = {"router": self.name or "least-loaded"}
            if self.settings and self.name:
                routing[self.name] = dict(self.settings)
            llm = await AsyncLLM.create(model=model, max_model_len=128, routing=routing, **kw)
            try:

                async def one(i: int, p: list[int]) -> list[int]:
                    out: list[int] = []
                    async for o in llm.generate({"prompt_token_ids": p}, params, f"q{i}"):
                        out = list(o.outputs[0].token_ids)
                    return out

                outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
                engine_loads = getattr(llm.engine, "engine_loads", None)
                return list(outs), engine_loads() if engine_loads else None
            finally:
                llm.shutdown()

        one_engine, _ = asyncio.run(run())
        two, after = asyncio.run(run(data_parallel_size=2))
        assert two == one_engine
        assert after is not None and [e.num_in_flight for e in after] == [0, 0]
