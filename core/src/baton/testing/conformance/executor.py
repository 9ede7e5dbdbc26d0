"""Conformance suite for executors: subclass ``ExecutorConformance``.

    from baton.testing.conformance.executor import ExecutorConformance

    class TestMyExecutor(ExecutorConformance):
        @pytest.fixture
        def executor(self, config):          # built from the suite's config, KV cache not yet sized
            ex = MyExecutor(config)
            yield ex
            ex.shutdown()

The suite sizes the KV cache itself (``initialize_kv_cache``) and drives the
executor with the real ``Scheduler``: blocking and ``non_block`` (Future)
steps, the ``None`` + ``sample_tokens`` path of structured output (a bitmask
that allows one token), finished and preempted request ids (a tight cache and
aborts), ``collective_rpc`` (a target that raises fails that call alone;
``memory_usage`` answers with a WorkerMemory per worker), failure callbacks,
``check_health`` and an idempotent ``shutdown``. Override ``inject_failure`` to let the suite check
that a failure reaches the callbacks; set ``exact_tokens = False`` if your
executor's greedy tokens may change with batch composition.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, ClassVar

import pytest

from baton.config import BatonConfig
from baton.errors import BatonError, ExecutorError
from baton.interfaces import Executor, Sleepable
from baton.protocol import (
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    SchedulerOutput,
    WorkerMemory,
)
from baton.request import Request, RequestStatus
from baton.sampling_params import SamplingParams
from baton.sched.policies import FCFSPolicy
from baton.sched.scheduler import Scheduler

#: Generous: only catches hangs on a slow, shared machine.
STEP_TIMEOUT = 60.0


class OnlyToken:
    """A stand-in grammar matcher that allows exactly one token, forever."""

    def __init__(self, token: int) -> None:
        self.token = token

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return all(t == self.token for t in token_ids)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, self.token // 32] = 1 << (self.token % 32)

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        pass


def prompt(seed: int, n: int, vocab: int = 30000) -> list[int]:
    return [(1103 * seed + 7919 * i) % (vocab - 3) + 3 for i in range(n)]


class ExecutorConformance:
    """Behaviour every executor must show. Provide an ``executor`` fixture."""

    pytestmark = [pytest.mark.timeout(300)]

    #: Greedy tokens are identical whatever the batch (checked across preemption and step modes).
    exact_tokens: ClassVar[bool] = True
    #: A worker method ``collective_rpc`` can call by name with no arguments (None: skip that check).
    rpc_method: ClassVar[str | None] = None
    #: Blocks given to the KV cache (fewer if the executor has less memory).
    num_blocks: ClassVar[int] = 96
    #: The token the structured-output test allows.
    grammar_token: ClassVar[int] = 7
    #: Each worker answers ``collective_rpc("memory_usage")`` with a WorkerMemory (the engine's
    #: ``get_memory_usage``; ``baton.interfaces.Worker``).
    worker_memory: ClassVar[bool] = True

    def engine_config(self) -> BatonConfig:
        return BatonConfig.load(
            block_size=16,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=512,
            enable_prefix_caching=False,
            enable_chunked_prefill=True,
            device="cpu",
        )

    @pytest.fixture
    def config(self) -> BatonConfig:
        return self.engine_config()

    @pytest.fixture
    def executor(self, config: BatonConfig) -> Executor:
        raise NotImplementedError("subclass ExecutorConformance and provide an `executor` fixture")

    def inject_failure(self, executor: Any) -> bool:
        """Make ``executor`` fail as a dead worker would; False: this executor cannot (skip)."""
        return False

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def empty_output(step_id: int = 0) -> SchedulerOutput:
        """A SchedulerOutput that schedules nothing (handy for failure injection)."""
        return SchedulerOutput(step_id=step_id)

    def vocab_size(self, executor: Any) -> int:
        info = getattr(executor, "model_info", None)
        if info is not None:
            return int(info.vocab_size)
        return int(getattr(getattr(executor, "settings", None), "vocab_size", 32000))

    def init_cache(self, executor: Any, config: BatonConfig, num_blocks: int | None = None) -> int:
        specs = executor.get_kv_cache_specs()
        memory = executor.determine_available_memory()
        fit = min(m // s.page_size_bytes for s, m in zip(specs, memory, strict=True))
        n = min(fit, num_blocks or self.num_blocks)
        executor.initialize_kv_cache(
            KVCacheConfig(num_blocks=n, block_size=config.cache.block_size)
        )
        return n

    def scheduler(
        self, executor: Any, config: BatonConfig, num_blocks: int | None = None
    ) -> Scheduler:
        n = self.init_cache(executor, config, num_blocks)
        return Scheduler(
            config.scheduler,
            config.cache,
            FCFSPolicy(),
            n,
            max_model_len=config.model.max_model_len,
        )

    def requests(self, tag: str, lens: list[tuple[int, int]]) -> list[Request]:
        return [
            Request(
                f"{tag}{i}",
                prompt(i + 1, p),
                SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True),
                eos_token_id=None,
            )
            for i, (p, m) in enumerate(lens)
        ]

    def run(
        self,
        executor: Any,
        sched: Scheduler,
        reqs: list[Request],
        non_block: bool = False,
        abort: dict[int, list[str]] | None = None,
    ) -> dict[str, list[int]]:
        """Serve ``reqs`` to the end; ``abort`` maps a step number to request ids aborted before it."""
        for r in reqs:
            sched.add_request(r)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        for step in range(10_000):
            if not sched.has_unfinished_requests():
                return tokens
            if abort and step in abort:
                sched.finish_requests(abort[step], RequestStatus.FINISHED_ABORTED)
                continue
            so = sched.schedule()
            assert so.num_scheduled_tokens, "the scheduler found nothing to run"
            out = self._result(executor.execute_model(so, non_block=non_block), non_block)
            if so.structured_output_req_ids:
                assert out is None, (
                    "execute_model must return None when structured_output_req_ids is set"
                )
                grammar = self._grammar(executor, sched, so)
                out = self._result(executor.sample_tokens(grammar, non_block=non_block), non_block)
            assert out is not None, "execute_model returned None without structured-output requests"
            vocab = self.vocab_size(executor)
            for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
                assert rid in so.num_scheduled_tokens and all(0 <= t < vocab for t in toks), (
                    rid,
                    toks,
                )
            for o in sched.update_from_output(so, out):
                assert o.error is None, o.error
                tokens[o.request_id].extend(o.new_token_ids)
        raise AssertionError("requests did not finish in 10000 steps")

    @staticmethod
    def _result(value: Any, non_block: bool) -> Any:
        if non_block:
            assert isinstance(value, Future), (
                f"non_block=True must return a Future, got {type(value).__name__}"
            )
            return value.result(timeout=STEP_TIMEOUT)
        assert not isinstance(value, Future), "non_block=False must not return a Future"
        return value

    def _grammar(self, executor: Any, sched: Scheduler, so: SchedulerOutput) -> GrammarOutput:
        import torch

        vocab = self.vocab_size(executor)
        bitmask = torch.full(
            (len(so.structured_output_req_ids), (vocab + 31) // 32), -1, dtype=torch.int32
        )
        for i, rid in enumerate(so.structured_output_req_ids):
            sched.requests[rid].grammar.fill_bitmask(bitmask, i)
        return GrammarOutput(req_ids=list(so.structured_output_req_ids), bitmask=bitmask)

    # ------------------------------------------------------------------ tests

    def test_kv_specs_and_memory(self, executor: Any) -> None:
        assert isinstance(executor, Executor)
        specs = executor.get_kv_cache_specs()
        memory = executor.determine_available_memory()
        assert specs and all(isinstance(s, KVCacheSpec) for s in specs)
        assert len(memory) == len(specs), "one memory figure per KV spec (per worker)"
        for s, m in zip(specs, memory, strict=True):
            assert (
                s.page_size_bytes > 0
                and s.num_layers > 0
                and s.num_kv_heads > 0
                and s.head_size > 0
            )
            assert isinstance(m, int) and m >= s.page_size_bytes, (
                f"{m} bytes cannot hold one block of {s}"
            )
        assert (
            isinstance(executor.max_concurrent_batches, int)
            and executor.max_concurrent_batches >= 1
        )

    def test_execute_blocking_and_non_block_agree(self, executor: Any, config: BatonConfig) -> None:
        sched = self.scheduler(executor, config)
        lens = [(5, 6), (40, 9), (1, 4), (90, 7), (17, 12)]
        blocking = self.run(executor, sched, self.requests("b", lens))
        future = self.run(executor, sched, self.requests("f", lens), non_block=True)
        assert [len(blocking[f"b{i}"]) for i in range(5)] == [m for _, m in lens]
        assert [len(future[f"f{i}"]) for i in range(5)] == [m for _, m in lens]
        if self.exact_tokens:
            assert [blocking[f"b{i}"] for i in range(5)] == [future[f"f{i}"] for i in range(5)]

    @pytest.mark.parametrize("non_block", [False, True])
    def test_structured_output_waits_for_sample_tokens(
        self, executor: Any, config: BatonConfig, non_block: bool
    ) -> None:
        sched = self.scheduler(executor, config)
        reqs = self.requests("g", [(12, 5), (30, 6), (3, 4)])
        reqs[0].grammar = OnlyToken(self.grammar_token)
        reqs[2].grammar = OnlyToken(self.grammar_token + 1)
        tokens = self.run(executor, sched, reqs, non_block=non_block)
        assert tokens["g0"] == [self.grammar_token] * 5
        assert tokens["g2"] == [self.grammar_token + 1] * 4
        assert len(tokens["g1"]) == 6

    def test_finished_and_preempted_requests(self, executor: Any, config: BatonConfig) -> None:
        # 15 usable blocks (240 tokens) for 8 requests of up to 133 tokens each
        sched = self.scheduler(executor, config, num_blocks=16)
        lens = [(30 + 9 * i, 40) for i in range(8)]
        alone: dict[str, list[int]] = {}
        for req in self.requests("x", lens):  # one at a time: no preemption
            alone.update(self.run(executor, sched, [req]))
        reqs = self.requests("y", lens)
        together = self.run(executor, sched, reqs, abort={12: ["y3"], 30: ["y6"]})
        assert sum(r.num_preemptions for r in reqs) > 0, "the tight cache should have preempted"
        for i in (0, 1, 2, 4, 5, 7):
            assert len(together[f"y{i}"]) == 40
            if self.exact_tokens:
                assert together[f"y{i}"] == alone[f"x{i}"], (
                    f"request {i}: tokens changed with preemption"
                )
        # the runner forgot finished and aborted requests: their ids are new again
        again = self.run(executor, sched, self.requests("y", lens[2:4]))
        assert [len(again["y0"]), len(again["y1"])] == [40, 40]

    def test_empty_step_is_accepted(self, executor: Any, config: BatonConfig) -> None:
        """The core runs a step when nothing is scheduled (e.g. only grammars compiling)."""
        sched = self.scheduler(executor, config)
        self.run(executor, sched, self.requests("e", [(8, 2)]))
        so = sched.schedule()
        assert not so.num_scheduled_tokens
        out = self._result(executor.execute_model(so), False)
        assert out is not None and not out.req_ids

    def test_collective_rpc(self, executor: Any) -> None:
        workers = len(executor.get_kv_cache_specs())
        assert executor.collective_rpc(_add, args=(40,), kwargs={"b": 2}) == [42] * workers
        if self.rpc_method is not None:
            assert len(executor.collective_rpc(self.rpc_method)) == workers

    def test_a_failing_collective_rpc_fails_that_call_alone(
        self, executor: Any, config: BatonConfig
    ) -> None:
        """A target that raises fails its call with a BatonError naming the worker; the
        executor stays healthy: later calls, ``sleep`` / ``wake_up`` and steps still work."""
        workers = len(executor.get_kv_cache_specs())
        sched = self.scheduler(executor, config)
        with pytest.raises(BatonError, match=r"worker \d+: on purpose"):
            executor.collective_rpc(_fail)
        executor.check_health()
        assert executor.collective_rpc(_add, args=(1,)) == [1] * workers
        if isinstance(executor, Sleepable):
            executor.sleep(1)
            executor.wake_up()
        tokens = self.run(executor, sched, self.requests("r", [(9, 3)]))
        assert len(tokens["r0"]) == 3
        executor.check_health()

    def test_memory_usage(self, executor: Any, config: BatonConfig) -> None:
        """``collective_rpc("memory_usage")`` (the engine's ``get_memory_usage``): one
        WorkerMemory per worker, in rank order, measured in the worker's process."""
        if not self.worker_memory:
            pytest.skip("this executor's workers do not measure their memory (worker_memory)")
        workers = len(executor.get_kv_cache_specs())
        self.init_cache(executor, config)
        memory = executor.collective_rpc("memory_usage")
        assert all(isinstance(m, WorkerMemory) for m in memory), memory
        assert [m.rank for m in memory] == list(range(workers))
        assert all(m.pid > 0 and m.rss_bytes > 0 for m in memory), memory

    def test_failure_callback_and_health(self, executor: Any, config: BatonConfig) -> None:
        calls: list[BaseException] = []
        done = threading.Event()

        def on_failure(error: BaseException) -> None:
            calls.append(error)
            done.set()

        executor.register_failure_callback(on_failure)
        executor.check_health()
        assert not calls, "the failure callback ran while the executor was healthy"
        if not self.inject_failure(executor):
            pytest.skip(
                "this executor does not support failure injection (override inject_failure)"
            )
        assert done.wait(10.0), "the failure callback did not run within 10 s of the failure"
        with pytest.raises(ExecutorError):
            executor.check_health()
        assert len(calls) == 1 and isinstance(calls[0], BaseException)

    def test_shutdown_is_idempotent(self, executor: Any) -> None:
        executor.check_health()
        executor.shutdown()
        executor.shutdown()


def _fail(worker: Any) -> None:
    """A collective_rpc target that raises."""
    raise ValueError("on purpose")


def _add(worker: Any, a: int, b: int = 0) -> int:
    """A collective_rpc target: ``method(worker, *args, **kwargs)`` on every worker."""
    assert worker is not None
    return a + b
