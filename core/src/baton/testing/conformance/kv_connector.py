"""Conformance suite for KV connectors: subclass ``KVConnectorConformance``.

    from baton.testing.conformance import KVConnectorConformance

    class TestMyConnector(KVConnectorConformance):
        name = "mine"                  # looked up in the plugin registry
        settings = {"cpu_memory": "64MiB"}   # the [kv_transfer.mine] sub-table (optional)

The checks: its factory makes a ``KVConnector`` whose halves implement
``KVConnectorScheduler`` and ``KVConnectorWorker`` and answer within the protocol's rules
(block-multiple token counts that never reach a request's last token, bytes for the workers,
an idempotent ``shutdown``); and through a real engine (the in-process executor, a tiny
random-weight model): greedy tokens equal to connector off, a prompt served from the connector
(``num_cached_tokens`` > 0, the same tokens) after the engine's own pool was emptied
(``reset_prefix_cache``), and a scheduler-half call that raises for one request fails that
request alone (finish reason ``error``, the message naming the connector) while the others
finish with the tokens of connector off.

Class attributes: ``role`` (the engine's ``kv_transfer.role``; the served-from-the-connector
check needs ``both``), ``serves_after_reset`` (False for a connector that does not keep what
this engine computed, e.g. a consumer of another engine's KV).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec
import pytest

from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.kv_transfer.connector import (
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVSchedulerContext,
    KVStep,
    KVTransferStats,
    KVWorkerContext,
)
from baton.kv_transfer.types import KVNamespace
from baton.plugins.hookspecs import hookimpl
from baton.plugins.registry import get_plugins, get_registry
from baton.protocol import EngineCoreRequest
from baton.request import Request
from baton.sampling_params import SamplingParams
from baton.testing.tiny_model import tiny_model

#: Prompts (token ids of the SmolLM2 vocabulary) of several full blocks each.
PROMPTS: dict[str, list[int]] = {
    "a": list(range(1000, 1100)),
    "b": [510, 1230, 314, 2500, 28] * 14,
    "c": list(range(2000, 2040)),
}
#: The name the suite's fault-injecting wrapper registers under.
FAULTY = "conformance-faulty"


class Finished(msgspec.Struct):
    """What one request ended with."""

    tokens: list[int]
    num_cached_tokens: int
    error: str | None
    kv_transfer_params: dict[str, Any] | None


def run_requests(
    core: EngineCore, prompts: dict[str, list[int]], max_tokens: int = 8
) -> dict[str, Finished]:
    """Run ``prompts`` (request id -> token ids) to completion, greedy, and step on until the
    connector's transfers are reported too (``has_work``); what each request ended with."""
    for rid, prompt in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(
            EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params)
        )
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    done: dict[str, Finished] = {}
    for _ in range(10_000):
        if not core.has_work():
            break
        outs, _ = core.step_fn()
        for o in outs.outputs if outs else ():
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                done[o.request_id] = Finished(
                    tokens[o.request_id], o.num_cached_tokens, o.error, o.kv_transfer_params
                )
    assert not core.has_work(), "the engine did not finish the requests and their transfers"
    assert set(done) == set(prompts), f"unfinished: {set(prompts) - set(done)}"
    return done


class _Faulty:
    """A connector whose scheduler half raises in one call for requests whose id starts with
    ``boom``; everything else is the wrapped connector's."""

    def __init__(self, inner: KVConnector, call: str) -> None:
        self.inner, self.call = inner, call

    def scheduler_side(self, context: KVSchedulerContext) -> KVConnectorScheduler:
        return _FaultyScheduler(self.inner.scheduler_side(context), self.call)  # type: ignore[return-value]

    def worker_side(self, context: KVWorkerContext) -> KVConnectorWorker:
        return self.inner.worker_side(context)


class _FaultyScheduler:
    def __init__(self, inner: KVConnectorScheduler, call: str) -> None:
        self.inner, self.call = inner, call

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if name != self.call:
            return method

        def raising(request: Request, *args: Any) -> Any:
            if request.request_id.startswith("boom"):
                raise RuntimeError(f"conformance: {name} fails for {request.request_id}")
            return method(request, *args)

        return raising


class _FaultyPlugin:
    BATON_PLUGIN_API = 1

    def __init__(self, inner: str, call: str) -> None:
        self.inner, self.call = inner, call

    @hookimpl
    def register_kv_connectors(self, register: Any) -> None:
        def factory(config: BatonConfig, settings: Any) -> _Faulty:
            entry = get_registry().get("kv_connector", self.inner)
            inner_config = config.replace(**{"kv_transfer.connector": self.inner})
            return _Faulty(entry.create(inner_config, entry.settings(inner_config)), self.call)

        register(FAULTY, factory)


class KVConnectorConformance:
    """Behaviour every KV connector must show. Set ``name`` (and ``settings``)."""

    pytestmark = [pytest.mark.timeout(300)]

    #: The registered connector name.
    name: ClassVar[str | None] = None
    #: Its ``[kv_transfer.<name>]`` settings for every test.
    settings: ClassVar[dict[str, Any]] = {}
    #: The engine's kv_transfer.role.
    role: ClassVar[str] = "both"
    #: A prompt this engine computed is served by the connector once the pool forgot it.
    serves_after_reset: ClassVar[bool] = True

    def config(self, connector: str | None = None, **overrides: Any) -> BatonConfig:
        if self.name is None:
            raise NotImplementedError("set name = '<registered KV connector>'")
        kv: dict[str, Any] = {"connector": connector or self.name, "role": self.role}
        if self.settings:
            kv[self.name] = dict(self.settings)
        overrides.setdefault("max_model_len", 256)
        return BatonConfig.load(model=str(tiny_model("llama")), kv_transfer=kv, **overrides)

    def make_connector(self, config: BatonConfig) -> KVConnector:
        entry = get_registry().get("kv_connector", config.kv_transfer.connector)
        connector: KVConnector = entry.create(config, entry.settings(config))
        return connector

    def namespace(self) -> KVNamespace:
        return KVNamespace(
            model="conformance", kv_dtype="float32", block_size=16, num_layers=2,
            num_kv_heads=2, head_size=16, key="conformance",
        )  # fmt: skip

    # ------------------------------------------------------------------ the protocol

    def test_makes_both_halves(self) -> None:
        connector = self.make_connector(self.config())
        assert isinstance(connector, KVConnector)
        ns = self.namespace()
        role: Any = self.role
        sched = connector.scheduler_side(KVSchedulerContext(role=role, namespace=ns, num_blocks=64))
        worker = connector.worker_side(KVWorkerContext(role=role, namespace=ns))
        assert isinstance(sched, KVConnectorScheduler)
        assert isinstance(worker, KVConnectorWorker)
        sched.shutdown()
        sched.shutdown()  # idempotent
        worker.shutdown()
        worker.shutdown()

    def test_scheduler_half_answers_within_the_rules(self) -> None:
        connector = self.make_connector(self.config())
        ns = self.namespace()
        sched = connector.scheduler_side(
            KVSchedulerContext(role=self.role, namespace=ns, num_blocks=64)  # type: ignore[arg-type]
        )
        try:
            for rid, prompt in PROMPTS.items():
                req = Request(rid, list(prompt), SamplingParams(max_tokens=4))
                n, is_async = sched.get_num_new_matched_tokens(req, 0)
                assert isinstance(n, int) and isinstance(is_async, bool), (n, is_async)
                assert n % ns.block_size == 0 and 0 <= n < len(prompt), n
            meta = sched.build_connector_meta(KVStep(step_id=1))
            assert isinstance(meta, bytes)
            req = Request("r", list(PROMPTS["a"]), SamplingParams(max_tokens=4))
            hold, params = sched.request_finished(req, [])
            assert isinstance(hold, bool) and (params is None or isinstance(params, dict))
            stats = sched.take_stats()
            assert stats is None or isinstance(stats, KVTransferStats)
            assert isinstance(sched.take_events(), list)
        finally:
            sched.shutdown()

    # ------------------------------------------------------------------ through the engine

    def _run(self, config: BatonConfig, prompts: Sequence[dict[str, list[int]]]) -> list[Any]:
        core = EngineCore(config)
        try:
            results = []
            for batch in prompts:
                results.append(run_requests(core, batch))
                assert core.reset_prefix_cache(), "blocks still held after every request ended"
            return results
        finally:
            core.shutdown()

    def _off(self) -> dict[str, Finished]:
        (off,) = self._run(self.config().replace(**{"kv_transfer.connector": "none"}), [PROMPTS])
        return off

    def test_greedy_tokens_equal_connector_off(self) -> None:
        off = self._off()
        (on,) = self._run(self.config(), [PROMPTS])
        assert {r: f.tokens for r, f in on.items()} == {r: f.tokens for r, f in off.items()}
        assert all(f.error is None for f in on.values()), on

    def test_a_prompt_is_served_from_the_connector_after_the_pool_forgot_it(self) -> None:
        if self.role != "both" or not self.serves_after_reset:
            pytest.skip(f"role {self.role!r}: this engine does not read back what it saved")
        off = self._off()
        first, again = self._run(self.config(), [PROMPTS, {"again": PROMPTS["a"]}])
        assert first["a"].tokens == off["a"].tokens
        assert again["again"].error is None, again["again"].error
        assert again["again"].tokens == off["a"].tokens
        assert again["again"].num_cached_tokens > 0, "the connector served none of the prompt"

    @pytest.mark.parametrize(
        "call", ["get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"]
    )
    def test_a_call_that_raises_fails_its_request_alone(self, call: str) -> None:
        off = self._off()
        plugin = _FaultyPlugin(self.name or "", call)
        get_plugins().register(plugin, FAULTY, "baton-conformance", "0")
        try:
            prompts = {**PROMPTS, "boom": PROMPTS["a"]}
            (on,) = self._run(self.config(connector=FAULTY), [prompts])
        finally:
            get_plugins().unregister(FAULTY)
        boom = on.pop("boom")
        assert boom.error is not None and FAULTY in boom.error and call in boom.error, boom
        assert {r: f.tokens for r, f in on.items()} == {r: f.tokens for r, f in off.items()}
        assert all(f.error is None for f in on.values()), on
