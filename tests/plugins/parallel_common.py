"""Shared checks for the multiprocess executors (cuda-tp, pipeline): parity, worker death, leaks."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from baton import LLM, SamplingParams
from baton.errors import EngineDeadError, ExecutorError
from baton.processes import is_helper
from baton.testing.conformance.executor import ExecutorConformance
from baton.testing.faults import kill_on_first_output
from baton.testing.tiny_model import tiny_model
from tests.e2e.conftest import _children, assert_a_death_fails_every_call
from tests.e2e.parity import PROMPTS, assert_parity, engine_greedy

MAX_NEW = 40
#: executors whose workers are processes of this machine started by the engine (ray's are actors)
LOCAL_EXECUTORS = ("cuda-tp", "pipeline")
#: chunked prefill with a small token budget, prompts across blocks (as tests/e2e/test_parity.py)
PARITY_BASE = dict(
    block_size=8,
    max_num_batched_tokens=96,
    enable_chunked_prefill=True,
    enable_prefix_caching=True,
    max_model_len=512,
    device="cpu",
    num_threads=1,
)


def generate(
    model_dir: Path, prompt_ids: list[list[int]], passes: int = 1, **overrides: Any
) -> list[list[list[int]]]:
    """Greedy tokens of ``passes`` runs of the prompts in one engine (later passes hit the prefix
    cache); a local executor's workers must be children of this process."""

    def started(_: LLM) -> None:
        if overrides.get("executor") in LOCAL_EXECUTORS:  # inproc: their workers are our children
            want = overrides.get("tensor_parallel_size", 1) * overrides.get(
                "pipeline_parallel_size", 1
            )
            assert len(_children()) >= want, (
                f"expected {want} worker processes, found {_children()}"
            )

    return engine_greedy(
        model_dir,
        prompt_ids,
        MAX_NEW,
        passes=passes,
        started=started,
        **{**PARITY_BASE, **overrides},
    )


#: uniproc's answers in this process: the TP, PP and composed parity tests of one model compare
#: against the same reference (the default model's run takes ~10 s on 2 cores).
_reference: dict[str, list[list[int]]] = {}


def uniproc_reference(
    model_dir: Path, prompt_ids: list[list[int]], **overrides: Any
) -> list[list[int]]:
    """``generate``'s one pass on the uniproc executor, computed once per process per arguments."""
    key = repr((str(model_dir), prompt_ids, sorted(overrides.items())))
    if key not in _reference:
        (_reference[key],) = generate(model_dir, prompt_ids, **overrides)
    return _reference[key]


def check_parity(model_dir: Path, tokenizer: Any, passes: int = 2, **parallel: Any) -> None:
    """The parallel executor's tokens equal uniproc's (near-tie rule), fresh and (``passes`` 2)
    from the prefix cache."""
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    ref = uniproc_reference(model_dir, prompt_ids)
    for ours in generate(model_dir, prompt_ids, passes=passes, **parallel):
        assert_parity(model_dir, prompt_ids, ours, ref)


def check_cache_dtype_parity(model_dir: Path, tokenizer: Any, dtype: str, **parallel: Any) -> None:
    """With cache.dtype = ``dtype`` (the shared cache allocation path) the parallel executor gives
    uniproc's tokens with the same cache, fresh and from the prefix cache: at least 95% of them
    (a low-precision cache is not exact, so no near-tie rule against float32; measured: all)."""
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    ref = uniproc_reference(model_dir, prompt_ids, **{"cache.dtype": dtype})
    total = sum(len(r) for r in ref)
    for ours in generate(model_dir, prompt_ids, passes=2, **parallel, **{"cache.dtype": dtype}):
        same = sum(
            a == b for o, r in zip(ours, ref, strict=True) for a, b in zip(o, r, strict=True)
        )
        assert same >= 0.95 * total, f"{same} of {total} tokens equal with cache.dtype={dtype}"


def sigkill_worker_is_engine_dead(model_dir: str, transport: str, **parallel: Any) -> None:
    """SIGKILL one worker mid-generation: EngineDeadError within 5 s, every later call too.

    With the inproc transport the core runs in the caller's thread (InprocClient), which
    surfaces the executor's own ExecutorError instead, as it does for the uniproc executor.
    """
    dead = EngineDeadError if transport != "inproc" else ExecutorError
    import psutil

    llm = LLM(
        model=model_dir,
        max_model_len=2048,
        transport=transport,
        device="cpu",
        num_threads=1,
        **parallel,
    )
    try:
        engine = (
            psutil.Process(llm.engine.resources.procs[0].pid)
            if transport != "inproc"
            else psutil.Process()
        )
        workers = [p for p in engine.children(recursive=True) if not is_helper(p)]
        assert len(workers) >= 2, workers
        killed_at = kill_on_first_output(llm.engine, workers[-1].pid)
        assert_a_death_fails_every_call(llm, killed_at, dead)
    finally:
        llm.shutdown()


class ParallelConformance(ExecutorConformance):
    """The executor suite for a multiprocess executor on a tiny model; subclasses set ``overrides``."""

    rpc_method = "check_health"
    overrides: dict[str, Any] = {}

    def engine_config(self):
        return (
            super()
            .engine_config()
            .replace(
                model=str(tiny_model("llama")),
                kv_cache_memory="64MiB",
                num_threads=1,
                **self.overrides,
            )
        )

    @pytest.fixture
    def executor(self, config):
        from baton.plugins.registry import get_registry

        entry = get_registry().get("executor", config.executor.backend)
        ex = entry.create(
            config, config.plugin_settings("executor", entry.name, entry.settings_model)
        )
        yield ex
        ex.shutdown()
        assert all(not p.is_alive() for p in ex.procs), "a worker outlived shutdown"

    def test_unknown_rpc_method_is_refused_and_the_executor_stays_healthy(self, executor):
        with pytest.raises(ExecutorError, match="no method 'no_such_method'"):
            executor.collective_rpc("no_such_method")
        executor.check_health()
        assert len(executor.collective_rpc("check_health")) == executor.world_size

    def inject_failure(self, executor) -> bool:
        os.kill(executor.worker_pids()[-1], signal.SIGKILL)  # a real death, not a simulated one
        return True


def tiny_executor(name: str, settings: dict[str, Any] | None = None, **parallel: Any) -> Any:
    """Executor plugin ``name`` over the tiny model on the CPU, one thread per worker, built as
    the engine builds it (registry entry, ``[executor.<name>]`` settings)."""
    from baton.config import BatonConfig
    from baton.plugins.registry import get_registry

    cfg = BatonConfig.load(
        model=str(tiny_model("llama")),
        executor=name,
        device="cpu",
        num_threads=1,
        kv_cache_memory="16MiB",
        **parallel,
        **({f"executor.{name}": settings} if settings else {}),
    )
    entry = get_registry().get("executor", name)
    return entry.create(cfg, cfg.plugin_settings("executor", name, entry.settings_model))


def check_hang_is_detected(executor: Any) -> None:
    """A stopped (SIGSTOP) worker leaves a real step unanswered: the failure callback runs after step_timeout."""
    from baton.protocol import KVCacheConfig
    from baton.request import Request
    from baton.sampling_params import SamplingParams
    from baton.sched.policies import FCFSPolicy
    from baton.sched.scheduler import Scheduler

    cfg = executor.config
    fit = min(
        m // s.page_size_bytes
        for s, m in zip(
            executor.get_kv_cache_specs(), executor.determine_available_memory(), strict=True
        )
    )
    blocks = min(fit, 64)
    executor.initialize_kv_cache(KVCacheConfig(num_blocks=blocks, block_size=cfg.cache.block_size))
    sched = Scheduler(
        cfg.scheduler, cfg.cache, FCFSPolicy(), blocks, max_model_len=cfg.model.max_model_len
    )
    sched.add_request(
        Request(
            "h",
            list(range(3, 40)),
            SamplingParams(max_tokens=4, temperature=0.0),
            eos_token_id=None,
        )
    )
    failed = threading.Event()
    executor.register_failure_callback(lambda e: failed.set())
    victim = executor.worker_pids()[
        0 if executor.driver else 1
    ]  # not the driver: it waits for the victim
    os.kill(victim, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        future = executor.execute_model(sched.schedule(), non_block=True)
        assert failed.wait(executor.settings.step_timeout + 5.0), "the hang was not detected"
        assert time.monotonic() - t0 >= executor.settings.step_timeout * 0.9
        with pytest.raises(ExecutorError, match="step_timeout"):
            future.result(timeout=5)
    finally:
        os.kill(victim, signal.SIGCONT)


def check_stopped_worker_is_detected(executor) -> None:
    """A worker stopped (SIGSTOP) while the executor is idle misses its heartbeats: failure < 5 s."""
    failed = threading.Event()
    errors: list[BaseException] = []
    executor.register_failure_callback(lambda e: (errors.append(e), failed.set()))
    victim = executor.worker_pids()[-1]
    os.kill(victim, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert failed.wait(10.0), "the stopped worker was not detected"
        assert time.monotonic() - t0 < 5.0
        assert "heartbeat" in str(errors[0]), errors
        with pytest.raises(ExecutorError, match="heartbeat"):
            executor.check_health()
    finally:
        os.kill(victim, signal.SIGCONT)


def check_prompt_logprobs(model_dir: Path, tokenizer: Any, **parallel: Any) -> None:
    """prompt_logprobs (scored in chunks on the rank that samples) and allowed_token_ids (the
    driver's sampler) give what uniproc gives."""
    prompt_ids = sorted((tokenizer.encode(p) for p in PROMPTS), key=len)[-3:]  # 146 tokens: chunks
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[11, 12]),
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0, logit_bias={13: 100.0}),
    ]

    def run(**overrides: Any) -> list[Any]:
        with LLM(model=str(model_dir), **{**PARITY_BASE, **overrides}) as llm:
            return llm.generate(
                [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False
            )

    ref, ours = run(), run(**parallel)
    for o in ours:  # a request that failed would lose its prompt logprobs: say why first
        assert o.outputs[0].finish_reason == "length", (o.request_id, o.outputs[0])
    for i in (0, 2):  # scored on the rank that samples, every prompt token but the first
        assert ours[i].prompt_logprobs is not None, (ours[i].request_id, ours[i].num_cached_tokens)
        assert len(ours[i].prompt_logprobs) == len(prompt_ids[i]) > 1
    for r, o in zip(ref, ours, strict=True):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert (o.prompt_logprobs is None) == (r.prompt_logprobs is None)
        for a, b in zip(o.prompt_logprobs or (), r.prompt_logprobs or (), strict=True):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert len(a) == len(b)  # (near-ties may swap which ids are in the top k)
                got = sorted(lp.logprob for lp in a.values())
                want = sorted(lp.logprob for lp in b.values())
                assert got == pytest.approx(want, abs=1e-4)
    assert set(ours[1].outputs[0].token_ids) <= {11, 12}
    assert ours[2].outputs[0].token_ids == [13] * 4


class ParallelFailures:
    """A worker killed, hung or stopped: the executor fails fast, the engine reports
    EngineDeadError, nothing is left. Subclasses set ``executor`` and ``parallel`` (the layout)
    and override the ``transport`` fixture with the transports to run the engine over."""

    executor: str = ""
    parallel: dict[str, Any] = {}

    @pytest.fixture(params=["inproc"])
    def transport(self, request: Any) -> str:
        return str(request.param)

    def test_sigkill_of_a_worker_is_engine_dead_within_5_s(self, transport, no_leaks):
        sigkill_worker_is_engine_dead(
            str(tiny_model("llama")), transport, executor=self.executor, **self.parallel
        )

    def test_a_hung_worker_fails_the_executor_after_step_timeout(self, no_leaks):
        ex = tiny_executor(self.executor, {"step_timeout": 2.0}, **self.parallel)
        try:
            check_hang_is_detected(ex)
        finally:
            ex.shutdown()

    def test_a_stopped_worker_is_detected_by_its_heartbeat_within_5_s(self, no_leaks):
        ex = tiny_executor(self.executor, **self.parallel)  # default step_timeout: 120 s
        try:
            check_stopped_worker_is_detected(ex)
        finally:
            ex.shutdown()


class ParallelParity:
    """Greedy parity with the uniproc executor on the 16-prompt parity set (chunked prefill and
    prefix caching on), a bfloat16 cache's, and prompt logprobs with token constraints.
    Subclasses set ``executor`` and ``parallel``; the ``arch`` fixture names the tiny models."""

    executor: str = ""
    parallel: dict[str, Any] = {}

    @pytest.fixture(params=["llama"])
    def arch(self, request: Any) -> str:
        return str(request.param)

    def test_matches_uniproc(self, arch, tokenizer):
        check_parity(tiny_model(arch), tokenizer, executor=self.executor, **self.parallel)

    def test_with_a_bfloat16_cache_matches_uniproc(self, tokenizer):
        check_cache_dtype_parity(
            tiny_model("llama"), tokenizer, "bfloat16", executor=self.executor, **self.parallel
        )

    def test_prompt_logprobs_and_token_constraints_match_uniproc(self, tokenizer):
        check_prompt_logprobs(
            tiny_model("llama"), tokenizer, executor=self.executor, **self.parallel
        )
