"""The executor toolkit's small parts: the failure latch, the call book, heartbeats, runner factories, and what the
core reads from an executor (model_info, model_capabilities) when an older one lacks them."""

from __future__ import annotations

import os
import pickle
import threading
import time

import pytest

from baton.config import BatonConfig
from baton.engine.executor_facts import executor_capabilities, executor_model_info
from baton.errors import ExecutorError, PluginError
from baton.executor.calls import CallBook
from baton.executor.heartbeat import Heartbeats
from baton.executor.latch import FailureLatch
from baton.interfaces import ModelRunner, RunnerFactory, Worker
from baton.protocol import ModelCapabilities
from baton.runner import KVShape, ModelRunnerHooks, StockRunner, load_worker
from baton.testing import FakeExecutor
from baton.testing.tiny_model import tiny_model


def test_latch_tells_each_callback_once_and_refuses_later_calls():
    latch = FailureLatch("demo")
    seen: list[tuple[str, BaseException]] = []
    latch.register(lambda e: seen.append(("early", e)))
    latch.check()
    first, second = ExecutorError("worker 1 died"), ExecutorError("a consequence")
    assert latch.fail(first) is True
    assert latch.fail(second) is False  # later failures are consequences: not told
    latch.register(lambda e: seen.append(("late", e)))  # registered after: told at once
    assert seen == [("early", first), ("late", first)]
    with pytest.raises(ExecutorError, match="demo executor failed earlier: worker 1 died") as info:
        latch.check()
    assert info.value.__cause__ is first


def test_a_raising_callback_does_not_keep_the_others_from_the_news(caplog):
    latch = FailureLatch("demo")
    told = []

    def broken(error: BaseException) -> None:
        raise RuntimeError("callback bug")

    latch.register(broken)
    latch.register(told.append)
    latch.fail(ExecutorError("x"))
    assert len(told) == 1
    assert "callback" in caplog.text and "callback bug" in caplog.text


def test_closed_latch_refuses_calls_and_ignores_failures():
    latch = FailureLatch("demo")
    told = []
    latch.register(told.append)
    assert latch.close() is True and latch.close() is False
    assert latch.fail(ExecutorError("after shutdown")) is False and not told
    with pytest.raises(ExecutorError, match="shut down"):
        latch.check()


def test_trip_latches_at_once_and_notify_tells_later():
    latch = FailureLatch("demo")
    told = threading.Event()
    latch.register(lambda e: told.set())
    callbacks = latch.trip(ExecutorError("x"))
    assert callbacks is not None and not told.is_set()
    with pytest.raises(ExecutorError):
        latch.check()  # refused before anyone was told
    latch.notify(ExecutorError("x"), callbacks)
    assert told.is_set()


def test_call_book_settles_each_call_once_in_rank_order():
    book = CallBook("demo", kind_names={1: "step"}, hangs="a worker hangs", serial_decode=True)
    book.start()
    try:
        every = book.new(1, [0, 1, 2], decode=lambda raw: raw * 10)
        one = book.new(1, [0, 1, 2], decode=int, reply_from=1)
        for rank in (2, 0):
            book.answer(every, rank, rank + 1)
        assert not every.future.done()
        book.answer(every, 1, 2)
        book.answer(every, 1, 99)  # a late duplicate is ignored
        assert every.future.result(1) == [10, 20, 30]
        book.answer(one, 1, "7")
        assert one.future.result(1) == 7
        # a rank's error fails that call alone; the book goes on
        failing = book.new(1, [0, 1], decode=int)
        book.fail_call(failing.id, ExecutorError("worker 1: ValueError: no"))
        book.answer(failing, 0, "1")  # after the failure: ignored
        with pytest.raises(ExecutorError, match="worker 1: ValueError: no"):
            failing.future.result(1)
        book.latch.check()
        # a chained call resolves on the completer thread
        chained = book.new(1, [0], decode=int, chained=True)
        where: list[str] = []
        called = threading.Event()
        chained.future.add_done_callback(
            lambda f: (where.append(threading.current_thread().name), called.set())
        )
        book.answer(chained, 0, "3")
        assert chained.future.result(1) == [3]
        assert called.wait(1) and where == ["baton-demo-done"]
    finally:
        assert book.close() is True
        assert book.close() is False
        book.stop()


def test_call_book_fails_the_group_on_an_unreadable_answer_a_late_call_and_a_timeout():
    book = CallBook("demo", kind_names={1: "step"}, hangs="a worker hangs (step_timeout)")
    book.start()
    failures: list[BaseException] = []
    book.latch.register(failures.append)
    waited = book.new(1, [0], decode=int)
    with pytest.raises(ExecutorError, match=r"demo: timed out after 0\.05 s waiting for a step"):
        book.wait(waited.future, 0.05, "a step")
    book.answer(waited, 0, "1")  # dropped: a late answer is ignored
    assert not waited.future.done() and not failures
    late = book.new(1, [0], decode=int, fail_after=0.01)
    assert book.check_deadlines(time.monotonic()) is False
    assert book.check_deadlines(time.monotonic() + 1.0) is True
    with pytest.raises(
        ExecutorError, match=r"a step call was not answered within 0\.01 s: a worker hangs"
    ):
        late.future.result(1)
    assert len(failures) == 1
    with pytest.raises(ExecutorError):  # later calls are refused
        book.new(1, [0], decode=int)
    book.close()
    book.stop()

    other = CallBook("demo", kind_names={}, hangs="")
    bad = other.new(1, [0], decode=int)
    other.answer(bad, 0, "not a number")
    with pytest.raises(
        ExecutorError, match="demo executor failed: worker 0 sent an unreadable answer"
    ):
        bad.future.result(1)
    other.close()
    other.stop()


def test_heartbeats_find_silent_workers():
    beats = Heartbeats(3)
    beats.beat(0)
    beats.beat(2)
    now = time.monotonic()
    assert beats.silent(now, 10.0) == []
    silent = beats.silent(now + 5.0, 4.0)  # worker 1 never started: not silent
    assert [r for r, _ in silent] == [0, 2] and all(s > 4.0 for _, s in silent)


class HalfHeads(ModelRunnerHooks):
    def loaded(self, model):
        return KVShape(num_layers=1, num_heads=1, num_kv_heads=1)


def test_stock_runner_factory_pickles_by_reference():
    factory = StockRunner(HalfHeads)
    assert isinstance(factory, RunnerFactory)
    again = pickle.loads(pickle.dumps(factory))
    assert again.hooks is HalfHeads


def test_stock_runner_refuses_what_is_not_hooks():
    with pytest.raises(PluginError, match="not-callable"):
        StockRunner("not-callable")  # type: ignore[arg-type]
    with pytest.raises(PluginError, match=r"not a baton\.runner\.ModelRunnerHooks"):
        StockRunner(dict)(None, None)  # type: ignore[arg-type]


class OldExecutor:
    """An executor written before model_info / model_capabilities were protocol members."""

    max_concurrent_batches = 1


def test_an_executor_without_the_members_still_runs_with_a_warning():
    with pytest.warns(DeprecationWarning, match="model_info"):
        assert executor_model_info(OldExecutor()) is None
    with pytest.warns(DeprecationWarning, match="model_capabilities"):
        assert executor_capabilities(OldExecutor()) is None


def test_tuple_capabilities_are_converted_with_a_warning_and_bad_types_refused():
    ex = OldExecutor()
    ex.model_capabilities = (False, True, "bidirectional")  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="ModelCapabilities"):
        caps = executor_capabilities(ex)
    assert caps == ModelCapabilities(
        supports_chunked_prefill=False, supports_prefix_caching=True, reason="bidirectional"
    )
    ex.model_capabilities = "all"  # type: ignore[attr-defined]
    with pytest.raises(ExecutorError, match=r"not a baton\.protocol\.ModelCapabilities"):
        executor_capabilities(ex)
    ex.model_info = {"vocab_size": 3}  # type: ignore[attr-defined]
    with pytest.raises(ExecutorError, match=r"not a baton\.protocol\.ModelInfo"):
        executor_model_info(ex)


def test_the_fake_executor_has_the_members():
    ex = FakeExecutor()
    assert ex.model_info is None and ex.model_capabilities is None


class CountingHooks(ModelRunnerHooks):
    """Counts the forward passes (a runner factory's hooks, as an executor plugin passes them)."""

    def __init__(self) -> None:
        self.forwards = 0

    def forward(self, run, num_tokens):
        self.forwards += 1
        return run()


def test_load_worker_gives_the_worker_contract_around_a_runner_factory():
    config = BatonConfig.load(
        model=str(tiny_model("llama")), device="cpu", num_threads=1, max_model_len=128
    )
    worker = load_worker(config, StockRunner(CountingHooks), rank=3)
    assert isinstance(worker, Worker) and isinstance(worker.model_runner, ModelRunner)
    assert worker.model_runner.hooks.forwards == 0  # made, not run yet
    assert worker.get_model_info().vocab_size > 0
    assert worker.get_kv_cache_spec().num_layers > 0
    memory = worker.memory_usage()
    assert (memory.rank, memory.kv_cache_bytes) == (3, 0) and memory.weights_bytes > 0
    assert memory.pid == os.getpid()
    assert not isinstance(object(), Worker)
