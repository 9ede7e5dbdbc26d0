"""The engine core in its own process behind each transport: parity, death, shutdown, bad frames."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import threading
import time

import pytest

from baton import LLM, AsyncLLM, SamplingParams
from baton.errors import EngineDeadError
from baton.plugins.registry import reset_plugins
from baton.protocol import EngineCoreRequest, FinishReason
from baton.testing.faults import kill_on_first_output

from .conftest import assert_a_death_fails_every_call, greedy_reference

TRANSPORTS = ["inproc", "zmq", "shm"]
MP_TRANSPORTS = ["zmq", "shm"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello", "The weather today is", "1 2 3 4", "A much longer prompt " * 6]


@pytest.fixture(scope="module")
def reference(model_dir):
    return greedy_reference(model_dir, PROMPTS, GREEDY)


@pytest.mark.parametrize("transport", MP_TRANSPORTS)
def test_same_greedy_tokens_over_every_transport(transport, model_dir, reference, no_leaks):
    with LLM(model=model_dir, max_model_len=256, transport=transport) as llm:
        assert [
            o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        ] == reference
        assert llm.get_stats().num_total_blocks > 0  # a utility call through the transport


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_async_streaming_over_every_transport(transport, model_dir, reference, no_leaks):
    llm = await AsyncLLM.create(model=model_dir, max_model_len=256, transport=transport)
    try:

        async def run(prompt):
            last = None
            async for out in llm.generate(prompt, GREEDY):
                last = out
            return last.outputs[0].token_ids

        assert await asyncio.gather(*map(run, PROMPTS)) == reference
    finally:
        llm.shutdown()


def _engine_pid(llm) -> int:
    return llm.engine.resources.procs[0].pid


@pytest.mark.parametrize("transport", MP_TRANSPORTS)
def test_sigkill_mid_generation_raises_engine_dead_in_sync_client(transport, model_dir, no_leaks):
    llm = LLM(model=model_dir, max_model_len=256, transport=transport)
    try:
        killed_at = kill_on_first_output(llm.engine, _engine_pid(llm))
        assert_a_death_fails_every_call(llm, killed_at, EngineDeadError, max_tokens=200)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("transport", MP_TRANSPORTS)
async def test_sigkill_raises_engine_dead_in_async_client(transport, model_dir, no_leaks):
    llm = await AsyncLLM.create(model=model_dir, max_model_len=256, transport=transport)
    try:
        params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
        first = asyncio.Event()

        async def consume():
            async for _ in llm.generate("streaming", params):
                first.set()
                await asyncio.sleep(0.005)

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(first.wait(), timeout=60)  # kill mid-stream, not after a timer
        os.kill(_engine_pid(llm), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, timeout=5)
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate("later", GREEDY):
                pass
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["drain", "abort"])
async def test_sigterm_drains_or_aborts(mode, model_dir, no_leaks):
    # drain: requests in flight finish (however slow the machine); abort: they end with reason abort
    timeout = 600.0 if mode == "drain" else 0.0
    llm = await AsyncLLM.create(
        model=model_dir, max_model_len=256, transport="zmq", **{"server.shutdown_timeout": timeout}
    )
    try:
        # 200 tokens: far more than the steps between the first output and SIGTERM's arrival
        params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
        started = asyncio.Event()

        async def run(prompt):
            last = None
            async for out in llm.generate(prompt, params):
                started.set()
                last = out
            return last.outputs[0]

        tasks = [asyncio.ensure_future(run(f"a b c {i}")) for i in range(3)]
        await started.wait()
        os.kill(_engine_pid(llm), signal.SIGTERM)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        if mode == "drain":
            assert [o.finish_reason for o in outs] == ["length"] * 3
            assert all(len(o.token_ids) == 200 for o in outs)
        else:
            assert [o.finish_reason for o in outs] == ["abort"] * 3
            assert all(len(o.token_ids) < 200 for o in outs)
    finally:
        llm.shutdown()


def test_new_requests_are_refused_while_draining(model_dir, no_leaks):
    from baton.errors import EngineShuttingDownError

    llm = LLM(
        model=model_dir, max_model_len=2048, transport="zmq", **{"server.shutdown_timeout": 600.0}
    )
    try:
        # long enough to be still draining when SIGTERM has arrived (240 tokens could finish first)
        params = SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0)
        done: list = []
        t = threading.Thread(
            target=lambda: done.append(llm.generate("long one", params, use_tqdm=False))
        )
        t.start()
        while not llm.engine.call_utility("list_requests"):
            time.sleep(0.01)
        os.kill(_engine_pid(llm), signal.SIGTERM)
        # the signal is read between steps: refused from then on, while the request drains
        deadline = time.monotonic() + 10
        with pytest.raises(EngineShuttingDownError):
            while time.monotonic() < deadline:
                llm.engine.call_utility("get_stats")
                time.sleep(0.01)
        assert not done, "the request finished before new calls were refused"
        t.join(timeout=120)
        assert done and done[0][0].outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("transport", MP_TRANSPORTS)
def test_garbage_frames_are_dropped_and_the_engine_keeps_serving(
    transport, model_dir, reference, caplog, no_leaks
):
    with LLM(model=model_dir, max_model_len=256, transport=transport) as llm:
        channel = llm.engine.resources.channel
        for junk in (
            [b"\xff\xfe garbage"],
            [b"\x00", b"\xc1\xc1\xc1"],
            [b"\x02", b"\x93\x01"],
            [b""],
        ):
            channel.send(junk, 0)
        assert [
            o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        ] == reference


@pytest.mark.parametrize("transport", MP_TRANSPORTS)
def test_a_request_that_does_not_decode_is_answered_with_its_error(
    transport, model_dir, reference, no_leaks
):
    """An EngineCoreRequest sent without a frontend, its SamplingParams out of bounds."""
    with LLM(model=model_dir, max_model_len=256, transport=transport) as llm:
        params = SamplingParams(max_tokens=2)
        params.top_k = 2**40  # no validation on assignment: the engine's decode refuses it
        llm.engine.add_request(
            EngineCoreRequest(
                request_id="raw-1", prompt_token_ids=[1, 2, 3], sampling_params=params
            )
        )
        answers: list = []

        def wait() -> None:
            while not answers:
                answers.extend(
                    o for o in llm.engine.get_output().outputs if o.request_id == "raw-1"
                )

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        t.join(timeout=60)
        assert answers, "the engine never answered the undecodable request"
        assert answers[0].finish_reason == FinishReason.ERROR
        assert answers[0].error.startswith("InvalidRequestError: SamplingParams.top_k must be")
        assert [
            o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        ] == reference


FAILING_PLUGIN = """
from baton import hookimpl
from baton.testing.fake_executor import FakeExecutor, FakeExecutorSettings

def make(config, settings):
    return FakeExecutor(settings, block_size=config.cache.block_size)

@hookimpl
def register_executors(register):
    register("failing", make, FakeExecutorSettings)
"""


@pytest.fixture
def failing_executor_plugin(tmp_path, monkeypatch):
    from tests.core.plugin_fixtures import make_dist

    site = make_dist(
        tmp_path / "site",
        "baton-test-failing",
        "baton_test_failing",
        textwrap.dedent(FAILING_PLUGIN),
    )
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(site))
    reset_plugins()
    yield
    reset_plugins()
    sys.modules.pop("baton_test_failing", None)


@pytest.mark.parametrize("transport", MP_TRANSPORTS)
def test_executor_failure_mid_step_is_engine_dead_with_the_cause(
    transport, model_dir, failing_executor_plugin, no_leaks
):
    with (
        LLM(
            model=model_dir,
            max_model_len=256,
            transport=transport,
            executor="failing",
            **{"executor.failing": {"fail_at_step": 5, "fail_mode": "die"}},
        ) as llm,
        pytest.raises(EngineDeadError, match="ExecutorError"),
    ):
        llm.generate("boom", SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)


def test_engine_that_fails_to_start_reports_why(model_dir, no_leaks):
    with pytest.raises(EngineDeadError, match="failed to start"):
        LLM(model=model_dir, max_model_len=256, transport="zmq", kv_cache_memory="1KiB")
