"""EngineCore: the inner loop. Schedule -> execute the model -> update requests -> emit outputs.

The core owns the executor, the scheduler (mechanism + policy plugin) and the
structured-output manager. Start-up: build the executor -> ask it for KV specs
and available memory -> size the KV cache -> initialise the executor with it
-> build the scheduler. With ``[kv_events]`` on, the core publishes the scheduler's KV cache
events once per step that produced any (and after a prefix-cache reset), through the publisher
the section selects (``baton.kv.event_publisher``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import msgspec

from baton.config import BatonConfig
from baton.engine.executor_facts import executor_capabilities, executor_model_info
from baton.engine.kv_capacity import fit_max_model_len
from baton.engine.kv_connector import settle_kv_transfers, start_kv_connector
from baton.engine.sharded_state import check_sharded_folder, save_sharded_state
from baton.engine.step_target import effective_step_target
from baton.engine.utility_methods import check_sleep_level
from baton.errors import (
    ConfigError,
    EngineSleepingError,
    ExecutorError,
    InvalidRequestError,
    worker_error,
)
from baton.interfaces import Executor
from baton.kv.event_publisher import KVEventPublisher, make_kv_event_publisher
from baton.lora.registry import EngineLoras
from baton.model.tokenizer import load_tokenizer
from baton.model_info import ModelInfo, model_info
from baton.plugins.registry import Registry
from baton.plugins.resolve import ResolvedPlugins, resolve_plugins
from baton.pooling_params import check_generation, pooled_request
from baton.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    KVCacheConfig,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    WorkerMemory,
)
from baton.request import Request, RequestStatus
from baton.rpc import run_worker_rpc
from baton.sched.scheduler import Scheduler
from baton.speculative.drafting import Drafts
from baton.structured.manager import StructuredOutputManager
from baton.validation import check_engine_request

log = logging.getLogger(__name__)

#: How long the batch-queue loop yields the CPU when it scheduled nothing but requests are pending.
IDLE_YIELD_S = 0.001


class EngineCore:
    """One engine: requests in, EngineCoreOutputs out. Not thread-safe; one thread drives it."""

    def __init__(
        self,
        config: BatonConfig,
        *,
        registry: Registry | None = None,
        plugins: ResolvedPlugins | None = None,
        executor: Executor | None = None,
        info: ModelInfo | None = None,
        engine_index: int = 0,
    ) -> None:
        self.config = config
        self.engine_index = engine_index
        #: The config's plugins, resolved once (by the caller, or here: the start-up check).
        self.plugins = plugins or resolve_plugins(
            config, registry, skip=frozenset({"executor"}) if executor else frozenset()
        )
        if executor is None and config.model.load_format == "sharded_state":
            # a wrong layout named here, not inside an executor
            check_sharded_folder(config.model, config.executor)
        if executor is None:
            executor = self.plugins.one("executor").create(config)
        self.executor: Executor = executor
        #: Where the scheduler's KV cache events go; None: kv_events off.
        self.kv_event_publisher: KVEventPublisher | None = None
        try:
            loaded = executor_model_info(executor)
            self.info: ModelInfo = info or loaded or model_info(config.model)
            if loaded is not None and loaded.dtype:  # what only the loaded model knows
                self.info = msgspec.structs.replace(
                    self.info, dtype=loaded.dtype, dtype_native=loaded.dtype_native
                )
            self.config = config = self._apply_model_capabilities(config)
            self.num_blocks = self._initialize_kv_cache()
            policy = self.plugins.one("scheduler_policy").create(config)
            self.batch_queue_size = max(1, int(executor.max_concurrent_batches))
            scheduler_section = effective_step_target(
                config.scheduler, config.executor.device, self.info, self.batch_queue_size
            )
            if self.batch_queue_size > 1 and scheduler_section.decode_steps > 1:
                # each batch in flight needs the tokens of the one before, a step at a time
                scheduler_section = scheduler_section.model_copy(update={"decode_steps": 1})
            self.config = config = config.model_copy(update={"scheduler": scheduler_section})
            # with a batch queue, cap each batch so that the running requests fill every batch in flight
            per_batch = (
                -(-config.scheduler.max_num_seqs // self.batch_queue_size)
                if self.batch_queue_size > 1
                else None
            )
            self.scheduler = Scheduler(
                config.scheduler,
                config.cache,
                policy,
                self.num_blocks,
                max_model_len=self.info.max_model_len,
                max_num_seqs_per_batch=per_batch,
                drafts=self._drafts(config),
                max_loras=config.lora.max_loras if config.lora.enable_lora else None,
                enable_kv_cache_events=config.kv_events.enable_kv_cache_events,
            )
            self.kv_event_publisher = make_kv_event_publisher(
                config.kv_events,
                config.executor.data_parallel_rank,
                config.cache.enable_prefix_caching,
            )
            self.structured_output = self._structured_output(config)
            #: What the KV connector keys blocks with (``[kv_transfer]``); None: no connector.
            self.kv_namespace = start_kv_connector(self)
        except BaseException:
            if self.kv_event_publisher is not None:
                self.kv_event_publisher.shutdown()
            self.executor.shutdown()
            raise
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] = deque()
        self.step_fn = self.step if self.batch_queue_size == 1 else self.step_with_batch_queue
        #: Seconds, for the step times fed to the scheduler (a test may replace it).
        self.step_clock = time.perf_counter
        self.aborts_to_report: list[EngineCoreOutput] = []
        #: 0 while awake; the level of the last ``sleep`` until ``wake_up``.
        self.sleep_level = 0
        #: Whether the workers' torch profilers run (start_profile .. stop_profile).
        self.profiling = False
        self.loras = EngineLoras(config.lora, self.executor, self.scheduler)

    # ------------------------------------------------------------------ start-up

    def _drafts(self, config: BatonConfig) -> Drafts | None:
        """Speculative decoding's bookkeeping with the selected speculator; None when off."""
        method = config.speculative.method
        if method == "none":
            return None
        if self.batch_queue_size > 1:
            raise ConfigError(
                f"speculative.method={method!r} with executor {config.executor.backend!r}, "
                f"which keeps {self.batch_queue_size} batches in flight: drafts need the previous "
                "step's tokens before the next is scheduled. Set speculative.method='none' or "
                "use an executor without a batch queue"
            )
        return Drafts(self.plugins.one("speculator").create(config), config.speculative)

    def _structured_output(self, config: BatonConfig) -> StructuredOutputManager:
        """The manager with the chosen backend's factory (the plugin contract: it takes the
        config) and a tokenizer loader bound; it keeps only its own section."""
        chosen = self.plugins.find("structured_output")
        return StructuredOutputManager(
            config.structured_output,
            backend_name=chosen.name if chosen is not None else None,
            create_backend=functools.partial(chosen.create, config) if chosen is not None else None,
            load_tokenizer=functools.partial(load_tokenizer, config.model, self.info),
            vocab_size=self.info.vocab_size,
            max_num_seqs=config.scheduler.max_num_seqs,
        )

    def _apply_model_capabilities(self, config: BatonConfig) -> BatonConfig:
        caps = executor_capabilities(self.executor)
        if caps is None:
            return config
        changes: dict[str, Any] = {}
        if not caps.supports_chunked_prefill and config.scheduler.enable_chunked_prefill:
            changes["enable_chunked_prefill"] = False
        if not caps.supports_prefix_caching and config.cache.enable_prefix_caching:
            changes["enable_prefix_caching"] = False
        if changes:
            log.warning("disabling %s: %s", ", ".join(changes), caps.reason)
            config = config.replace(**changes)
        if not caps.supports_decode_steps and config.scheduler.decode_steps > 1:
            log.debug("scheduler.decode_steps = 1: the runner's forward involves other ranks")
            config = config.replace(**{"scheduler.decode_steps": 1})
        return config

    def _initialize_kv_cache(self) -> int:
        specs = self.executor.get_kv_cache_specs()
        available = self.executor.determine_available_memory()
        num_blocks = min(
            mem // spec.page_size_bytes for spec, mem in zip(specs, available, strict=True)
        )
        block_size = self.config.cache.block_size
        max_model_len = fit_max_model_len(
            num_blocks,
            block_size,
            self.info.max_model_len,
            explicit=self.config.model.max_model_len is not None,
        )
        if max_model_len != self.info.max_model_len:
            self.info = msgspec.structs.replace(self.info, max_model_len=max_model_len)
        self.executor.initialize_kv_cache(
            KVCacheConfig(num_blocks=num_blocks, block_size=block_size)
        )
        per_worker = ", ".join(f"{num_blocks * s.page_size_bytes / 2**20:.0f} MiB" for s in specs)
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%s per worker)",
            num_blocks,
            block_size,
            num_blocks * block_size,
            per_worker,
        )
        return num_blocks

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admit a request. Raises InvalidRequestError; the engine keeps serving the others."""
        rid = request.request_id
        if self.sleep_level:
            raise EngineSleepingError(
                f"the engine is asleep (level {self.sleep_level}, its KV cache freed) and refuses "
                f"request {rid!r}: call wake_up() (POST /wake_up on the server) first"
            )
        if rid in self.scheduler.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use; ids must be unique")
        # the frontend's check again: a client may send EngineCoreRequests without a frontend
        check_engine_request(request, self.info)
        if request.pooling_params is not None:
            request = pooled_request(request, self.config.model, self.info)
        else:
            check_generation(self.info)
        lora_key = None
        if request.lora_request is not None:
            lora_key = self.loras.use(request.lora_request)  # read now if it is new
        req = Request.from_engine_core_request(request, max_model_len=self.info.max_model_len)
        if lora_key is not None:
            req.lora_key = lora_key
        if req.use_structured_output:
            self.structured_output.add_request(req)  # -> WAITING_FOR_FSM, compiles off the hot path
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort in any state; unknown or finished ids are no-ops."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def abort_all(self) -> list[EngineCoreOutput]:
        """Abort everything in flight and report each with finish reason abort (shutdown in abort mode)."""
        finished = self.scheduler.finish_requests(
            list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED
        )
        return [
            EngineCoreOutput(
                request_id=r.request_id, new_token_ids=[], finish_reason=r.finish_reason
            )
            for r in finished
        ]

    def has_work(self) -> bool:
        """Requests, batches in flight, or KV-connector transfers a worker has yet to report."""
        scheduler = self.scheduler
        return (
            scheduler.has_unfinished_requests()
            or bool(self.batch_queue)
            or scheduler.has_kv_transfers()
        )

    # ------------------------------------------------------------------ the step

    def step(self) -> tuple[EngineCoreOutputs | None, bool]:
        """One step. Returns (outputs or None, whether the model ran)."""
        start = self.step_clock()
        errors = self._finish_failed_grammars()
        scheduler = self.scheduler
        # KV-connector transfers in flight: steps (without a forward) collect the reports
        pending = scheduler.has_unfinished_requests() or scheduler.has_kv_transfers()
        if not pending and not scheduler.has_runner_news():
            return self._outputs(errors), False
        # without pending work this step only tells the runner of finished (aborted) requests
        scheduler_output = scheduler.schedule()
        if scheduler_output.is_empty and pending:
            time.sleep(IDLE_YIELD_S)  # e.g. only grammars compiling: don't spin
        future = self.executor.execute_model(scheduler_output, non_block=True)
        grammar_output = self.structured_output.grammar_bitmask(
            self.scheduler, scheduler_output
        )  # overlaps
        errors += self._finish_failed_grammars()  # a matcher that raised: before its token counts
        model_output = future.result()
        if model_output is None:
            model_output = self.executor.sample_tokens(grammar_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        ran = scheduler_output.total_num_scheduled_tokens > 0
        # the latency-aware budget learns from one step's time (a no-op when target_step_ms is
        # off); several decode steps in one are not one step's
        if ran and scheduler_output.decode_steps == 1:
            scheduler.observe_step_time(scheduler_output.step_id, self.step_clock() - start)
        return self._outputs(errors + outputs), ran

    def step_with_batch_queue(self) -> tuple[EngineCoreOutputs | None, bool]:
        """The pipeline-parallel step: keep up to max_concurrent_batches batches in flight.

        Schedule and submit a new batch while the queue has room; block on the
        oldest batch only when the queue is full or nothing new can be
        scheduled; never schedule a request that is still in flight (the
        scheduler skips those).
        """
        errors = self._finish_failed_grammars()
        queue = self.batch_queue
        scheduled = False
        if len(queue) < self.batch_queue_size and (
            self.scheduler.has_requests_to_schedule() or self.scheduler.has_runner_news()
        ):
            so = self.scheduler.schedule()
            if not so.is_empty or so.finished_req_ids or so.preempted_req_ids:
                # an empty output with news still goes: the runner drops those requests
                future = self.executor.execute_model(so, non_block=True)
                if so.structured_output_req_ids:
                    grammar_output = self.structured_output.grammar_bitmask(self.scheduler, so)
                    errors += self._finish_failed_grammars()
                    future = _then(future, lambda _out: self.executor.sample_tokens(grammar_output))
                queue.appendleft((future, so))
                scheduled = True
                if len(queue) < self.batch_queue_size and not queue[-1][0].done():
                    return self._outputs(
                        errors
                    ), True  # room for another batch: fill the queue first
        if not queue:
            if not scheduled and self.scheduler.has_unfinished_requests():
                time.sleep(
                    IDLE_YIELD_S
                )  # pending but unschedulable (e.g. grammars compiling): don't spin
            return self._outputs(errors), False
        in_flight = len(queue)  # including the batch about to complete
        future, so = queue.pop()
        outputs = self.scheduler.update_from_output(so, future.result())
        return self._outputs(errors + outputs, in_flight), True

    def _finish_failed_grammars(self) -> list[EngineCoreOutput]:
        """Finish with an error the requests whose grammar failed (to compile, or to fill its bitmask).

        A request in flight is finished at once: its sampled token, if any, is dropped.
        """
        failed = self.structured_output.take_failed()
        if not failed:
            return []
        outs = []
        for req, message in failed:
            if self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR):
                outs.append(
                    EngineCoreOutput(
                        request_id=req.request_id,
                        new_token_ids=[],
                        finish_reason=req.finish_reason,
                        error=message,
                    )
                )
        return outs

    def _outputs(
        self, outputs: list[EngineCoreOutput], in_flight: int = 0
    ) -> EngineCoreOutputs | None:
        if self.kv_event_publisher is not None:
            self._publish_kv_events()
        if self.aborts_to_report:
            outputs = self.aborts_to_report + outputs
            self.aborts_to_report = []
        stats = self.scheduler.make_stats() if self.config.observability.log_stats else None
        if not outputs and stats is None:
            return None
        if stats is not None:
            stats.num_batches_in_flight = in_flight
        return EngineCoreOutputs(
            engine_index=self.engine_index,
            outputs=outputs,
            scheduler_stats=stats,
            timestamp=time.monotonic(),
        )

    def _publish_kv_events(self) -> None:
        """The scheduler's KV cache events since the last call, as one batch (none: nothing)."""
        assert self.kv_event_publisher is not None
        events = self.scheduler.take_kv_events()
        if events:
            self.kv_event_publisher.publish(events)

    # ------------------------------------------------------------------ utilities (callable remotely)

    def reset_prefix_cache(self, reset_running: bool = False) -> bool:
        """Forget the prefix cache; see Scheduler.reset_prefix_cache (``reset_running`` preempts)."""
        settle_kv_transfers(self)
        done = self.scheduler.reset_prefix_cache(reset_running)
        if self.kv_event_publisher is not None:
            self._publish_kv_events()  # AllBlocksCleared now: an idle engine has no next step
        return done

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1: the weights stay in host memory) or the weights too
        (level 2: reloaded from the model folder by ``wake_up``); refused while requests are
        in flight. The prefix cache is forgotten (its blocks are gone); until ``wake_up``,
        new requests are refused with EngineSleepingError. Sleeping again at the same level
        does nothing."""
        check_sleep_level(level)
        if self.sleep_level:
            if level == self.sleep_level:
                return
            raise InvalidRequestError(
                f"the engine is already asleep at level {self.sleep_level}; call wake_up() "
                f"before sleeping at level {level}",
                param="level",
            )
        settle_kv_transfers(self)
        if self.has_work():
            n = self.scheduler.get_num_unfinished_requests()
            raise InvalidRequestError(
                f"cannot sleep with {n} request(s) in flight: wait for them to finish or abort "
                "them, then call sleep() again"
            )
        if self.scheduler.forks.retained:
            n = len(self.scheduler.forks.retained)
            raise InvalidRequestError(
                f"cannot sleep while {n} finished request(s) keep their KV for forks (a beam "
                "search in progress): abort them or let the search finish, then call sleep() again"
            )
        sleep = getattr(self.executor, "sleep", None)
        if not callable(sleep) or not callable(getattr(self.executor, "wake_up", None)):
            raise ExecutorError(
                f"executor {type(self.executor).__name__} has no sleep()/wake_up() "
                "(baton.interfaces.Sleepable): it cannot free its memory; use uniproc, cuda-tp "
                "or pipeline"
            )
        if not self.reset_prefix_cache():
            raise ExecutorError("the prefix cache could not be reset with no request in flight")
        sleep(level)
        self.sleep_level = level

    def wake_up(self) -> None:
        """Undo ``sleep``: weights back and the KV cache allocated again (empty); a no-op awake."""
        if not self.sleep_level:
            return
        self.executor.wake_up()  # type: ignore[attr-defined]
        self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def get_memory_usage(self) -> list[WorkerMemory]:
        """Each worker's memory, measured there: RSS, KV-cache and weight storages."""
        return list(self.executor.collective_rpc("memory_usage"))

    def start_profile(self) -> None:
        """Start the torch profiler in every worker; traces go to ``observability.profile_dir``."""
        from baton.worker.profiler import profile_dir  # torch: the frontend's import stays light

        profile_dir(self.config.observability.profile_dir)  # unset: refused here, by name
        if self.profiling:
            raise InvalidRequestError("the engine is already profiling: call stop_profile() first")
        self.executor.collective_rpc("start_profile")
        self.profiling = True

    def stop_profile(self) -> list[str]:
        """Stop profiling; each worker's chrome trace (a JSON file), one path per worker."""
        if not self.profiling:
            raise InvalidRequestError("the engine is not profiling: call start_profile() first")
        self.profiling = False
        return list(self.executor.collective_rpc("stop_profile"))

    def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        """Every worker writes its already sharded weights into ``path``; the model folder's
        config and tokenizer files and a marker of the layout follow (``baton.model.sharded_state``).
        Load it back with ``model.load_format = "sharded_state"`` at the same TP size."""
        c = self.config
        save_sharded_state(
            c.model,
            c.executor,
            c.lora.enable_lora,
            self.executor,
            self.sleep_level,
            path,
            pattern,
            max_size,
        )

    def collective_rpc(
        self,
        method: str,
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call ``method`` on every worker (``baton.rpc``: the Worker allow-list or a registered
        name); one result per worker, in rank order, as msgpack builtins (a struct becomes the
        list of its fields), the same whichever transport carries them. A target that raises
        fails this call with its error and rank; the engine goes on."""
        if not isinstance(method, str):
            raise InvalidRequestError(
                f"collective_rpc method {method!r}: give a name (a str)", param="method"
            )
        outcomes = self.executor.collective_rpc(
            run_worker_rpc, (method, tuple(args or ()), dict(kwargs or {})), timeout=timeout
        )
        for rank, (ok, value) in enumerate(outcomes):
            if not ok:
                raise worker_error(rank, str(value))
        try:
            return [msgspec.to_builtins(value) for _, value in outcomes]
        except TypeError as e:
            raise InvalidRequestError(
                f"collective_rpc {method!r} returned a value that cannot reach the client ({e}): "
                "return numbers, strings, lists, dicts or msgspec structs",
                param="method",
            ) from None

    # ------------------------------------------------------------------ LoRA adapters

    def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter into every worker (read and checked against the model); False if
        it is loaded already. Requests naming it load it too; this only does it ahead."""
        return self.loras.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Drop a LoRA adapter from every worker; False if it was not loaded. Refused while an
        unfinished request uses it."""
        return self.loras.remove(lora_id)

    def list_loras(self) -> list[int]:
        """The ids of the loaded LoRA adapters."""
        return self.loras.ids()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter loaded: never dropped to make room for another."""
        return self.loras.pin(lora_id)

    def get_stats(self) -> SchedulerStats:
        """A snapshot: counters (prefix-cache queries/hits, preemptions) are totals since start."""
        return self.scheduler.make_stats(delta=False)

    def check_health(self) -> None:
        self.executor.check_health()

    def get_model_info(self) -> ModelInfo:
        return self.info

    def get_num_blocks(self) -> int:
        return self.num_blocks

    def list_requests(self) -> list[str]:
        return list(self.scheduler.requests)

    def shutdown(self) -> None:
        publisher = self.kv_event_publisher
        if publisher is not None:
            self._publish_kv_events()  # recorded after the last step's batch (an abort's)
            self.kv_event_publisher = None
            publisher.shutdown()
        self.structured_output.shutdown()
        if self.scheduler.kv_transfer is not None:
            self.scheduler.kv_transfer.shutdown()
        self.executor.shutdown()


def _then(future: Future[Any], fn: Any) -> Future[Any]:
    """A future of fn(future.result()), run when the first completes."""
    out: Future[Any] = Future()

    def done(f: Future[Any]) -> None:
        try:
            result = fn(f.result())
            if isinstance(result, Future):
                result = result.result()
            out.set_result(result)
        except BaseException as e:  # delivered to whoever waits on the future
            out.set_exception(e)

    future.add_done_callback(done)
    return out
