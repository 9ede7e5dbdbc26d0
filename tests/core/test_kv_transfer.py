"""The kernel's side of the KV-connector seam, through a real engine (the in-process executor,
a tiny random-weight llama) with the reference connector ``memory``
(baton.testing.kv_connector): admission with synchronous and asynchronous loads, a shortfall
recomputed, blocks held until the worker reports them saved, containment of each half, stats,
kv_transfer_params in and out, the namespace."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from baton import LLM, hookimpl
from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.kv.hashing import update_block_hashes
from baton.kv_transfer.connector import KVSchedulerContext, KVWorkerContext
from baton.kv_transfer.namespace import build_namespace, model_identity
from baton.metrics.logging_logger import KVTransferTally, LoggingStatLogger
from baton.protocol import (
    EngineCoreRequest,
    KVCacheSpec,
    KVTransferStats,
    SchedulerOutput,
    SchedulerStats,
)
from baton.request import Request, RequestStatus
from baton.sampling_params import SamplingParams
from baton.testing.conformance.kv_connector import Finished, run_requests
from baton.testing.kv_connector import (
    TIER,
    MemoryConnector,
    register_memory_connector,
    unregister_memory_connector,
)
from baton.testing.tiny_model import tiny_model

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16, the last 4 computed
BLOCK = 16


@pytest.fixture(autouse=True)
def _memory() -> Iterator[None]:
    register_memory_connector()
    TIER.clear()
    yield
    unregister_memory_connector()  # engines spawned by later tests must see the same plugins


def config(connector: str = "memory", **kv: Any) -> BatonConfig:
    section: dict[str, Any] = {"connector": connector}
    if kv:
        section[connector] = kv
    return BatonConfig.load(model=str(tiny_model("llama")), max_model_len=256, kv_transfer=section)


def engine(cfg: BatonConfig) -> tuple[EngineCore, list[SchedulerOutput]]:
    """An engine whose every SchedulerOutput sent to the executor is recorded."""
    core = EngineCore(cfg)
    sent: list[SchedulerOutput] = []
    execute = core.executor.execute_model

    def recording(so: SchedulerOutput, non_block: bool = False) -> Any:
        sent.append(so)
        return execute(so, non_block=non_block)

    core.executor.execute_model = recording  # type: ignore[method-assign]
    return core, sent


def add(core: EngineCore, rid: str, prompt: list[int], **params: Any) -> None:
    extra = {"kv_transfer_params": params} if params else None
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, extra_args=extra)
    core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp))


def drain(core: EngineCore, first: Any = None) -> dict[str, Finished]:
    """Step until the engine has no work (after ``first``, the outputs of a step taken
    already); what each request that finished ended with."""
    tokens: dict[str, list[int]] = {}
    done: dict[str, Finished] = {}
    outs = first
    for _ in range(2000):
        for o in outs.outputs if outs else ():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id] = Finished(
                    tokens[o.request_id], o.num_cached_tokens, o.error, o.kv_transfer_params
                )
        if not core.has_work():
            break
        outs, _ = core.step_fn()
    assert not core.has_work()
    return done


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """PROMPT's greedy tokens with no connector."""
    core = EngineCore(config("none"))
    try:
        return run_requests(core, {"ref": PROMPT})["ref"].tokens
    finally:
        core.shutdown()


def first_scheduling(sent: list[SchedulerOutput], rid: str) -> SchedulerOutput:
    return next(so for so in sent if any(r.req_id == rid for r in so.scheduled_new_reqs))


# --------------------------------------------------------------------------- the hook


def test_hook_register_kv_connectors(global_plugin, reference) -> None:
    """A connector registered through the hook gets its settings, both contexts (the engine's
    namespace, its pool, the worker's shard) and the runner's cache tensors; it serves a
    prompt the pool forgot, with the tokens of connector off."""
    seen: dict[str, Any] = {}

    class Settings(BaseModel):
        label: str = "unset"

    class Recording(MemoryConnector):
        def scheduler_side(self, context: KVSchedulerContext) -> Any:
            seen["scheduler"] = context
            return super().scheduler_side(context)

        def worker_side(self, context: KVWorkerContext) -> Any:
            seen["worker"] = context
            half = super().worker_side(context)
            register = half.register_kv_caches

            def recording(kv_caches: Any, spec: KVCacheSpec) -> None:
                seen["caches"], seen["spec"] = kv_caches, spec
                register(kv_caches, spec)

            half.register_kv_caches = recording  # type: ignore[method-assign]
            return half

    class Plugin:
        @hookimpl
        def register_kv_connectors(self, register: Any) -> None:
            def factory(config: BatonConfig, settings: Settings) -> Recording:
                seen["label"] = settings.label
                return Recording(None)

            register("recording", factory, Settings)

    global_plugin(Plugin(), "kv-hook-plugin")
    core = EngineCore(config("recording", label="set"))
    try:
        first = run_requests(core, {"a": PROMPT})["a"]
        assert core.reset_prefix_cache()
        again = run_requests(core, {"b": PROMPT})["b"]
        num_blocks = core.num_blocks
    finally:
        core.shutdown()
    assert seen["label"] == "set"
    sched, worker = seen["scheduler"], seen["worker"]
    assert sched.num_blocks == num_blocks and sched.role == "both"
    assert sched.namespace == worker.namespace and len(sched.namespace.key) == 32
    assert (worker.tp_rank, worker.pp_rank, worker.first_layer) == (0, 0, 0)
    spec = seen["spec"]
    assert len(seen["caches"]) == sched.namespace.num_layers == spec.num_layers
    shape = (2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size)
    assert all(tuple(c.shape) == shape for c in seen["caches"])
    assert first.tokens == again.tokens == reference
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 96)


# --------------------------------------------------------------------------- admission


def test_a_synchronous_load_is_computed_in_the_step_that_schedules_it(reference) -> None:
    core, sent = engine(config())
    try:
        run_requests(core, {"a": PROMPT})
        assert core.reset_prefix_cache()
        sent.clear()
        add(core, "b", PROMPT)
        first, _ = core.step_fn()
        so = sent[0]
        (new,) = so.scheduled_new_reqs
        assert new.num_computed_tokens == 96 and so.num_scheduled_tokens == {"b": 4}
        assert so.kv_connector_metadata is not None
        done = drain(core, first)
    finally:
        core.shutdown()
    assert done["b"].tokens == reference and done["b"].num_cached_tokens == 96


def test_an_asynchronous_load_waits_holding_its_blocks(reference) -> None:
    core, sent = engine(config(async_loads=True, load_delay_s=0.2))
    try:
        run_requests(core, {"a": PROMPT})
        assert core.reset_prefix_cache()
        sent.clear()
        add(core, "b", PROMPT)
        first, _ = core.step_fn()
        req = core.scheduler.requests["b"]
        assert "b" not in sent[0].num_scheduled_tokens  # parked: it computes nothing yet
        assert core.scheduler.kv.get_block_ids("b"), "it holds its blocks while it loads"
        assert req.status == RequestStatus.WAITING_FOR_KV
        assert core.has_work()
        done = drain(core, first)
        new = first_scheduling(sent, "b").scheduled_new_reqs[0]
    finally:
        core.shutdown()
    waiting = sent[: sent.index(first_scheduling(sent, "b"))]
    assert waiting and all(so.is_empty for so in waiting)  # steps without a forward meanwhile
    assert new.num_computed_tokens == 96
    assert done["b"].tokens == reference and done["b"].num_cached_tokens == 96


def test_a_shortfall_is_recomputed_never_served(reference) -> None:
    core, sent = engine(config(async_loads=True))
    try:
        run_requests(core, {"a": PROMPT})
        probe = Request("probe", list(PROMPT), SamplingParams())
        update_block_hashes(probe, BLOCK)
        lost = [k for k in TIER if k[3] == probe.block_hashes[3]]
        assert len(lost) == 1
        del TIER[lost[0]]  # the tier lost block 3: blocks 0-2 load, 3-6 are recomputed
        assert core.reset_prefix_cache()
        sent.clear()
        add(core, "b", PROMPT)
        done = drain(core)
        new = first_scheduling(sent, "b").scheduled_new_reqs[0]
    finally:
        core.shutdown()
    assert new.num_computed_tokens == 3 * BLOCK
    assert done["b"].tokens == reference and done["b"].num_cached_tokens == 3 * BLOCK


def test_loaded_blocks_enter_the_prefix_cache() -> None:
    core, _ = engine(config(async_loads=True))
    try:
        run_requests(core, {"a": PROMPT})
        assert core.reset_prefix_cache()
        run_requests(core, {"b": PROMPT})  # loaded from the tier
        TIER.clear()  # what follows can only come from the pool's own prefix cache
        done = run_requests(core, {"c": PROMPT})
    finally:
        core.shutdown()
    assert done["c"].num_cached_tokens == 96


# --------------------------------------------------------------------------- ends


@pytest.mark.parametrize("hold", [True, False])
def test_held_blocks_are_freed_when_a_worker_reports_them_saved(hold: bool) -> None:
    core, _ = engine(config(hold_blocks=hold))
    sched = core.scheduler
    try:
        add(core, "a", PROMPT)
        finished = False
        while not finished:
            outs, _ = core.step_fn()
            finished = any(o.finished for o in outs.outputs) if outs else False
        assert outs is not None
        assert ("a" in sched.kv_transfer.held) is hold  # type: ignore[union-attr]
        assert (sched.kv.num_free_blocks < sched.kv.num_total_blocks) is hold
        assert core.has_work() is hold  # the engine steps on until the report comes
        drain(core)
        assert not sched.kv_transfer.held  # type: ignore[union-attr]
        assert sched.kv.num_free_blocks == sched.kv.num_total_blocks
    finally:
        core.shutdown()


def test_an_aborted_request_keeps_its_blocks_until_its_load_is_reported() -> None:
    core, _ = engine(config(async_loads=True, hold_blocks=False, load_delay_s=0.5))
    sched = core.scheduler
    try:
        run_requests(core, {"a": PROMPT})
        assert core.reset_prefix_cache()
        add(core, "b", PROMPT)
        core.step_fn()
        assert sched.requests["b"].status == RequestStatus.WAITING_FOR_KV
        core.abort_requests(["b"])
        assert "b" in sched.kv_transfer.held  # type: ignore[union-attr]
        drain(core)
        assert sched.kv.num_free_blocks == sched.kv.num_total_blocks
    finally:
        core.shutdown()


# --------------------------------------------------------------------------- containment


@pytest.mark.parametrize(
    "call",
    [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "request_finished",
        "worker",
        "start_step",
        "finish_step",
    ],
)
def test_a_connector_fault_fails_its_request_and_the_engine_goes_on(call: str, reference) -> None:
    core, _ = engine(config())
    try:
        add(core, "boom", PROMPT, fail=call)
        boom = drain(core)["boom"]
        add(core, "after", PROMPT)
        after = drain(core)["after"]
    finally:
        core.shutdown()
    assert boom.error is not None and "'memory'" in boom.error, boom
    assert after.error is None and after.tokens == reference


def test_a_scheduler_half_fault_leaves_the_other_requests_of_the_step_alone(reference) -> None:
    core, _ = engine(config())
    try:
        add(core, "boom", PROMPT, fail="update_state_after_alloc")
        add(core, "other", list(reversed(PROMPT)))
        add(core, "same", PROMPT)
        done = drain(core)
    finally:
        core.shutdown()
    assert "update_state_after_alloc" in (done["boom"].error or "")
    assert done["same"].error is None and done["same"].tokens == reference
    assert done["other"].error is None and len(done["other"].tokens) == 8


# --------------------------------------------------------------------------- stats, params


def test_step_stats_carry_the_connectors_figures() -> None:
    core = EngineCore(config().replace(log_stats=True))
    tally = KVTransferTally()
    try:
        run_requests(core, {"a": PROMPT})
        assert core.reset_prefix_cache()
        add(core, "b", PROMPT)
        for _ in range(200):
            if not core.has_work():
                break
            outs, _ = core.step_fn()
            if outs is not None and outs.scheduler_stats is not None:
                kv = outs.scheduler_stats.kv_transfer
                assert isinstance(kv, KVTransferStats)
                tally.add(kv)
    finally:
        core.shutdown()
    assert tally.total.hit_tokens == {"CPU": 96}
    assert tally.total.tier_bytes["CPU"] > 0
    assert "served CPU 96 tokens" in tally.describe()


def test_the_logging_stat_logger_prints_the_connectors_line(caplog) -> None:
    logger = LoggingStatLogger(config())
    kv = KVTransferStats(hit_tokens={"CPU": 32}, load_bytes=2**20, tier_bytes={"CPU": 2**21})
    logger.record(SchedulerStats(kv_transfer=kv), None)
    logger.record(SchedulerStats(kv_transfer=kv), None)
    with caplog.at_level(logging.INFO, logger="baton.stats"):
        logger.log()
    (line,) = [r.getMessage() for r in caplog.records if "KV connector" in r.getMessage()]
    assert "served CPU 64 tokens" in line and "loaded 2.0 MiB" in line and "CPU 2.0 MiB" in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="baton.stats"):
        logger.log()  # a new interval with no connector figures: no line
    assert not [r for r in caplog.records if "KV connector" in r.getMessage()]


def test_kv_transfer_params_travel_in_through_extra_args_and_out_on_the_output() -> None:
    llm = LLM(
        model=str(tiny_model("llama")), max_model_len=256, kv_transfer={"connector": "memory"}
    )
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        (out,) = llm.generate({"prompt_token_ids": PROMPT}, params)
        assert out.kv_transfer_params == {"memory_blocks": 6}
        failing = params.clone(
            extra_args={"kv_transfer_params": {"fail": "get_num_new_matched_tokens"}}
        )
        (bad,) = llm.generate({"prompt_token_ids": PROMPT}, failing)
    finally:
        llm.shutdown()
    assert bad.error is not None and "get_num_new_matched_tokens" in bad.error


def test_extra_args_must_hold_a_dict_of_kv_transfer_params() -> None:
    from baton.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="kv_transfer_params"):
        SamplingParams(extra_args={"kv_transfer_params": ["not", "a", "dict"]})
    assert SamplingParams(extra_args={"other": 1}).kv_transfer_params is None


# --------------------------------------------------------------------------- namespace


def test_the_namespace_key_covers_the_model_and_the_layout(tmp_path: Path) -> None:
    spec = KVCacheSpec(block_size=16, num_layers=2, num_kv_heads=2, head_size=32, dtype="float32")
    base = build_namespace("m", [spec], 1, 1)
    assert len(base.key) == 32 and base == build_namespace("m", [spec], 1, 1)
    others = [
        build_namespace("other", [spec], 1, 1),
        build_namespace("m", [KVCacheSpec(**{**_fields(spec), "block_size": 32})], 1, 1),
        build_namespace("m", [KVCacheSpec(**{**_fields(spec), "dtype": "bfloat16"})], 1, 1),
        build_namespace("m", [spec, spec], 2, 1),
    ]
    assert len({base.key, *(o.key for o in others)}) == 5
    tp = others[-1]
    assert (tp.num_kv_heads, tp.tensor_parallel_size) == (4, 2)
    pp = build_namespace("m", [spec, spec], 1, 2)
    assert (pp.num_layers, pp.pipeline_parallel_size) == (4, 2)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    before = model_identity(tmp_path)
    assert before.startswith(str(tmp_path.resolve()) + "@")
    assert model_identity(tmp_path, "int8") != before
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert model_identity(tmp_path) != before


def _fields(spec: KVCacheSpec) -> dict[str, Any]:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


def test_the_worker_half_gets_the_new_cache_after_wake_up(reference) -> None:
    """sleep frees the KV cache; wake_up allocates new tensors, which the worker half must be
    handed again: the tier (kept across) is then loaded into the new cache."""
    core = EngineCore(config())
    try:
        run_requests(core, {"a": PROMPT})
        core.sleep(1)
        core.wake_up()
        again = run_requests(core, {"b": PROMPT})["b"]
        half = core.executor.worker.kv_connector.half  # type: ignore[attr-defined]
        runner = core.executor.worker.model_runner  # type: ignore[attr-defined]
        assert all(a is b for a, b in zip(half.caches, runner.kv_caches, strict=True))
    finally:
        core.shutdown()
    assert again.tokens == reference and again.num_cached_tokens == 96


def test_a_batch_queue_is_refused_with_a_connector() -> None:
    """Two batches in flight (the pipeline executor's queue) would send a batch before the
    load it reads landed: refused at start, naming the connector and the executor."""
    from baton.errors import ConfigError
    from baton.testing import FakeExecutor, FakeExecutorSettings

    fake = FakeExecutor(FakeExecutorSettings(max_concurrent_batches=2))
    with pytest.raises(ConfigError, match=r"kv_transfer.connector='memory'.*2 batches in flight"):
        EngineCore(config(), executor=fake)


def test_the_start_up_check_names_an_unknown_connector_and_bad_settings() -> None:
    from baton.errors import BatonError
    from baton.plugins.resolve import resolve_plugins

    unknown = BatonConfig.load(kv_transfer={"connector": "nope"})
    with pytest.raises(BatonError, match=r"KV connector 'nope'.*install the distribution"):
        resolve_plugins(unknown)
    bad = BatonConfig.load(kv_transfer={"connector": "memory", "memory": {"async_load": True}})
    with pytest.raises(BatonError, match=r"async_load"):
        resolve_plugins(bad)
    assert resolve_plugins(BatonConfig.load()).find("kv_connector") is None  # "none"


def test_an_idle_in_process_engine_settles_held_blocks_before_a_reset() -> None:
    """LLM's engine is stepped only while it serves: blocks a connector holds after the last
    request ended are reported saved (steps without a forward) before reset_prefix_cache."""
    llm = LLM(
        model=str(tiny_model("llama")),
        max_model_len=256,
        kv_transfer={"connector": "memory", "memory": {"hold_blocks": True}},
    )
    try:
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2))
        assert llm.engine.core.scheduler.kv_transfer.held  # type: ignore[attr-defined]
        assert llm.reset_prefix_cache()
        (again,) = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()
    assert again.num_cached_tokens == 96
