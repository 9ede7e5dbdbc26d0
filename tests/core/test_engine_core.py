"""EngineCore with the fake executor: the step loop, the batch queue, aborts, utilities, failures."""

from __future__ import annotations

import pytest

from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.engine.core_proc import EngineCoreProc
from baton.errors import ConfigError, ExecutorError, InvalidRequestError
from baton.protocol import EngineCoreRequest, FinishReason, ModelInfo, RequestType
from baton.sampling_params import SamplingParams
from baton.testing import FakeExecutor

INFO = ModelInfo(
    path="fake", architecture="Fake", vocab_size=32000, max_model_len=512, eos_token_ids=[0]
)


def make_core(max_concurrent_batches: int = 1, **overrides) -> EngineCore:
    config = BatonConfig.load(max_model_len=512, **overrides)
    fake = FakeExecutor(
        block_size=config.cache.block_size,
        max_concurrent_batches=max_concurrent_batches,
        latency_s=0.002 if max_concurrent_batches > 1 else 0.0,
    )
    return EngineCore(config, executor=fake, info=INFO)


def req(rid: str, n_prompt: int = 20, max_tokens: int = 8, **params) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=[(7 * i + len(rid)) % 30000 + 1 for i in range(n_prompt)],
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, **params),
        eos_token_id=0,
    )


def run_to_completion(core: EngineCore, max_steps: int = 1000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    for _ in range(max_steps):
        if not core.has_work():
            break
        outs, _ = core.step_fn()
        for o in outs.outputs if outs else ():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason
    assert not core.has_work()
    return {k: v for k, v in tokens.items() if k in finished}


def test_requests_run_to_their_length():
    core = make_core()
    for i in range(5):
        core.add_request(req(f"r{i}", n_prompt=10 + 30 * i, max_tokens=4 + i))
    out = run_to_completion(core)
    assert {k: len(v) for k, v in out.items()} == {f"r{i}": 4 + i for i in range(5)}


def test_batch_queue_gives_the_same_tokens_and_overlaps():
    plain = make_core()
    queued = make_core(max_concurrent_batches=2, max_num_seqs=8, max_num_batched_tokens=32)
    assert queued.step_fn == queued.step_with_batch_queue
    for core in (plain, queued):
        for i in range(10):
            core.add_request(req(f"r{i}", n_prompt=5 + 13 * i, max_tokens=6))
    max_in_flight = 0
    tokens: dict[str, list[int]] = {}
    while queued.has_work():
        outs, _ = queued.step_fn()
        if outs is not None and outs.scheduler_stats is not None:
            max_in_flight = max(max_in_flight, outs.scheduler_stats.num_batches_in_flight)
        for o in outs.outputs if outs else ():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert max_in_flight == 2
    assert tokens == run_to_completion(plain)


def test_abort_in_any_state_is_idempotent():
    core = make_core(max_num_seqs=1)
    core.add_request(req("running", max_tokens=50))
    core.add_request(req("waiting", max_tokens=50))
    core.step_fn()
    core.abort_requests(["running", "waiting", "never-seen"])
    core.abort_requests(["running"])
    assert not core.has_work()
    assert core.get_stats().num_free_blocks == core.num_blocks - 1  # block 0 is the null block


@pytest.mark.parametrize("batches", [1, 2])
def test_abort_on_an_idle_engine_reaches_the_runner_in_the_next_step(batches):
    core = make_core(max_concurrent_batches=batches)
    core.add_request(req("a", max_tokens=50))
    while "a" not in core.executor.reqs or core.batch_queue:
        core.step_fn()
    core.abort_requests(["a"])
    assert not core.scheduler.has_unfinished_requests()
    for _ in range(10):  # the batch queue returns before its batch completes
        core.step_fn()
        if not core.has_work():
            break
    assert "a" not in core.executor.reqs and not core.has_work()


@pytest.mark.parametrize("batches", [1, 2])
def test_inproc_client_abort_on_an_idle_engine_reaches_the_runner_at_once(batches):
    from baton.engine.client import InprocClient

    config = BatonConfig.load(max_model_len=512)
    fake = FakeExecutor(
        block_size=config.cache.block_size, max_concurrent_batches=batches, latency_s=0.0
    )
    client = InprocClient(config, executor=fake, info=INFO)
    client.add_request(req("a", max_tokens=50))
    client.add_request(req("b", max_tokens=50))
    while not {"a", "b"} <= set(fake.reqs) or client.core.batch_queue:
        client.get_output()
    client.abort_requests(["a"])  # b still runs: its next step tells the runner
    assert "a" in fake.reqs
    client.abort_requests(["b"])  # now idle: nothing else would step the engine
    assert not fake.reqs and not client.core.has_work()
    client.get_output()  # a stashed output, if any, then empty steps


def test_bad_requests_raise_and_the_engine_keeps_serving():
    core = make_core()
    core.add_request(req("ok"))
    with pytest.raises(InvalidRequestError, match="already in use"):
        core.add_request(req("ok"))
    with pytest.raises(InvalidRequestError, match="prompt has 600 tokens"):
        core.add_request(req("long", n_prompt=600))
    bad = req("vocab")
    bad.prompt_token_ids[3] = 99999
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        core.add_request(bad)
    assert list(run_to_completion(core)) == ["ok"]


def test_abort_all_reports_abort():
    core = make_core()
    core.add_request(req("a", max_tokens=100))
    core.step_fn()
    outs = core.abort_all()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", FinishReason.ABORT)]


@pytest.mark.parametrize("drain", [False, True])
def test_shutdown_answers_requests_queued_before_it_and_refuses_later_ones(drain):
    """A request the engine process had queued when it first sees SIGTERM was sent before it: in
    abort mode it ends with reason abort (not dropped unanswered, which a client reads as the
    engine's death), in drain mode it runs; one queued after that gets EngineShuttingDownError."""
    core = make_core(**{"server.shutdown_timeout": 600.0 if drain else 0.0})
    proc = EngineCoreProc(core, channel=None)  # type: ignore[arg-type]  # no IO threads run
    core.add_request(req("running", max_tokens=100))
    core.step_fn()
    proc.input_queue.put((RequestType.ADD, req("queued", max_tokens=3)))
    proc.shutdown_requested.set()
    assert proc._shutdown_step() is not drain
    proc.input_queue.put((RequestType.ADD, req("late")))
    proc._drain_input(block=False)
    outs = [o for item in list(proc.output_queue.queue) for o in item.outputs]
    if drain:
        assert core.has_work() and {"running", "queued"} <= set(core.scheduler.requests)
    else:
        assert {o.request_id: o.finish_reason for o in outs if o.request_id != "late"} == {
            "running": FinishReason.ABORT,
            "queued": FinishReason.ABORT,
        }
    (late,) = [o for o in outs if o.request_id == "late"]
    assert late.finish_reason == FinishReason.ERROR
    assert late.error is not None and late.error.startswith("EngineShuttingDownError")


def test_utilities():
    core = make_core()
    core.add_request(req("a"))
    assert core.list_requests() == ["a"]
    run_to_completion(core)
    assert core.reset_prefix_cache() is True
    assert core.get_stats().num_running_reqs == 0
    core.check_health()


def test_reset_prefix_cache_with_reset_running_mid_run_keeps_the_tokens():
    plain, reset = make_core(), make_core()
    for core in (plain, reset):
        for i in range(3):
            core.add_request(req(f"r{i}", n_prompt=40 + 10 * i, max_tokens=10))
    early: dict[str, list[int]] = {}
    for _ in range(3):
        outs, _ = reset.step_fn()
        for o in outs.outputs if outs else ():
            early.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert early and reset.reset_prefix_cache() is False
    assert reset.reset_prefix_cache(True) is True
    assert reset.get_stats().num_free_blocks == reset.num_blocks - 1
    late = run_to_completion(reset)
    assert {k: early.get(k, []) + v for k, v in late.items()} == run_to_completion(plain)


def test_executor_failure_surfaces_from_step():
    config = BatonConfig.load(max_model_len=512)
    core = EngineCore(config, executor=FakeExecutor(fail_at_step=2), info=INFO)
    core.add_request(req("a", max_tokens=20))
    core.step_fn()
    core.step_fn()
    with pytest.raises(ExecutorError):
        core.step_fn()


def test_kv_cache_too_small_for_one_sequence_is_a_config_error():
    config = BatonConfig.load(max_model_len=512, block_size=16)
    with pytest.raises(ConfigError, match=r"raise cache\.kv_cache_memory"):
        EngineCore(config, executor=FakeExecutor(num_blocks=8), info=INFO)


def test_kv_capacity_check_leaves_out_the_null_block():
    # 32 blocks of 16 are 512 slots, but block 0 is the null block: 496 usable tokens
    config = BatonConfig.load(max_model_len=512, block_size=16)
    with pytest.raises(ConfigError, match=r"model\.max_model_len <= 496 \(the largest that fits\)"):
        EngineCore(config, executor=FakeExecutor(num_blocks=32), info=INFO)
    core = EngineCore(config, executor=FakeExecutor(num_blocks=33), info=INFO)
    core.add_request(req("full", n_prompt=500, max_tokens=12))  # exactly max_model_len
    assert len(run_to_completion(core)["full"]) == 12


def test_max_model_len_left_unset_is_the_models_capped_by_the_kv_cache(caplog):
    config = BatonConfig.load(block_size=16)
    assert config.model.max_model_len is None
    with caplog.at_level("INFO", logger="baton.engine.kv_capacity"):
        core = EngineCore(config, executor=FakeExecutor(num_blocks=17), info=INFO)
    assert core.info.max_model_len == 256 and "max_model_len = 256" in caplog.text
    assert core.scheduler.max_model_len == 256
    with pytest.raises(InvalidRequestError, match="max_model_len is 256"):
        core.add_request(req("long", n_prompt=300))
    core.add_request(req("fits", n_prompt=250, max_tokens=6))
    assert len(run_to_completion(core)["fits"]) == 6
    roomy = EngineCore(config, executor=FakeExecutor(num_blocks=64), info=INFO)
    assert roomy.info.max_model_len == 512  # the model's own limit


def test_kv_capacity_lowers_a_limit_taken_from_the_model(caplog):
    from baton.engine.kv_capacity import fit_max_model_len

    assert fit_max_model_len(33, 16, 512, explicit=True) == 512
    with caplog.at_level("INFO", logger="baton.engine.kv_capacity"):
        assert fit_max_model_len(32, 16, 8192, explicit=False) == 496
    assert "max_model_len = 496" in caplog.text
    with pytest.raises(ConfigError, match=r"raise cache\.kv_cache_memory"):
        fit_max_model_len(1, 16, 8192, explicit=False)


def test_structured_output_without_backend_names_the_plugin():
    from baton.sampling_params import StructuredOutputSpec

    core = make_core(structured_output="none")
    with pytest.raises(Exception, match="pip install baton-plugin-xgrammar"):
        core.add_request(req("j", structured_outputs=StructuredOutputSpec(regex="[ab]+")))
    assert not core.has_work()


def test_batch_queue_yields_the_cpu_when_requests_wait_but_nothing_can_be_scheduled(monkeypatch):
    import time
    from types import SimpleNamespace

    from baton.engine import core as core_module
    from baton.protocol import SchedulerOutput

    core = make_core(max_concurrent_batches=2)
    core.add_request(req("r0"))
    # e.g. the only request waits for its grammar: schedule() finds nothing to run
    monkeypatch.setattr(core.scheduler, "schedule", lambda: SchedulerOutput(step_id=1))
    sleeps: list[float] = []
    monkeypatch.setattr(
        core_module, "time", SimpleNamespace(sleep=sleeps.append, monotonic=time.monotonic)
    )
    for _ in range(3):
        _, ran = core.step_fn()
        assert not ran
    assert sleeps == [core_module.IDLE_YIELD_S] * 3
    core.shutdown()
