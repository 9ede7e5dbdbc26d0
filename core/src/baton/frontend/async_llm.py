"""AsyncLLM: the asyncio frontend. Streams RequestOutputs; a cancelled consumer aborts its request."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar

from baton.beam_search import BeamSearchOutput, BeamSearchParams
from baton.config import BatonConfig
from baton.engine.client import EngineCoreClient
from baton.engine.clients import make_client
from baton.engine.utility_methods import check_sleep_level
from baton.errors import (
    EngineDeadError,
    EngineShuttingDownError,
    InvalidRequestError,
    error_from_message,
)
from baton.frontend.beam_run import BeamRun
from baton.frontend.output_processor import OutputProcessor, split_request
from baton.frontend.pooling import check_pooling_prompt, pooling_engine_request
from baton.frontend.prompts import InputProcessor, PromptMethods, PromptType
from baton.frontend.request_meta import RequestMeta
from baton.frontend.stat_loggers import StatLoggers
from baton.lora.request import LoRARequest, check_lora_request
from baton.metrics.stats import IterationStats
from baton.metrics.tracing import RequestTracer, make_tracer
from baton.model.tokenizer import load_tokenizer
from baton.model_info import model_info
from baton.outputs import PoolingRequestOutput, RequestOutput
from baton.plugins.resolve import ResolvedPlugins, resolve_plugins
from baton.pooling_params import PoolingParams, check_generation
from baton.protocol import EngineCoreOutput, WorkerMemory
from baton.sampling_params import SamplingParams
from baton.scheduling_info import SchedulingInfo
from baton.validation import CheckedRequest

log = logging.getLogger(__name__)


class AsyncLLM(PromptMethods):
    """Serve many concurrent requests from one event loop.

    Build it with ``await AsyncLLM.create(model=..., config=..., **overrides)``
    (the engine starts off the event loop). ``generate`` is an async iterator.
    The output handler runs from the start, so a dead engine is noticed (``errored``,
    ``wait_until_dead``) even while no request is in flight.
    """

    def __init__(
        self,
        config: BatonConfig,
        engine: EngineCoreClient,
        tokenizer: Any,
        tracer: RequestTracer | None = None,
        *,
        plugins: ResolvedPlugins,
    ) -> None:
        self.config = config
        self.engine = engine
        self.info = engine.info
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(tokenizer, self.info)
        #: The request tracer (observability.tracing); None: tracing is off.
        self.tracer = (
            tracer
            if tracer is not None
            else make_tracer(config.observability, config.served_model_name)
        )
        self.output_processor = OutputProcessor(tokenizer, tracer=self.tracer)
        self.stat_loggers = StatLoggers(
            config.observability, plugins.factories("stat_logger", config)
        )
        self._ids = itertools.count()
        self._handler: asyncio.Task[None] | None = None
        #: Beam searches' engine requests -> where their raw outputs go (past the processor).
        self._raw_sinks: dict[str, Callable[[EngineCoreOutput | BaseException], None]] = {}
        self._logger_task: asyncio.Task[None] | None = None
        self.dead_error: BaseException | None = None
        self._dead = asyncio.Event()

    @classmethod
    async def create(
        cls,
        model: str | None = None,
        config: str | os.PathLike[str] | BatonConfig | None = None,
        **overrides: Any,
    ) -> AsyncLLM:
        cfg = (
            config
            if isinstance(config, BatonConfig)
            else BatonConfig.load(config, model=model, **overrides)
        )
        # a bad config is refused before the tokenizer and the weights load
        plugins = resolve_plugins(cfg)
        # tracing asked for without its packages: refused here too
        tracer = make_tracer(cfg.observability, cfg.served_model_name)
        loop = asyncio.get_running_loop()

        def start() -> tuple[EngineCoreClient, Any]:
            info = model_info(cfg.model)
            tokenizer = load_tokenizer(cfg.model, info)
            client = make_client(cfg, plugins, asyncio_mode=True, loop=loop, info=info)
            return client, tokenizer

        try:
            engine, tokenizer = await loop.run_in_executor(None, start)
        except BaseException:
            if tracer is not None:
                tracer.shutdown()
            raise
        llm = cls(cfg, engine, tokenizer, tracer, plugins=plugins)
        llm._ensure_handler()
        return llm

    # ------------------------------------------------------------------ requests

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    async def generate(
        self,
        prompt: PromptType | CheckedRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        user: str | None = None,
        scheduling: SchedulingInfo | Mapping[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (cumulative, delta or final only per params.output_kind).

        ``priority``, ``user`` and ``scheduling`` (a SchedulingInfo or a dict of its fields)
        are for the scheduler policy, as in ``LLM.generate``. Cancelling the consumer (or
        closing the generator) aborts the request in the engine. With
        ``observability.tracing``, the request's span is a child of the trace that
        ``trace_headers`` name (e.g. an HTTP request's headers: ``traceparent``,
        ``tracestate``), else of the caller's current span, if any.

        ``prompt`` may be a ``baton.validation.CheckedRequest`` (``checked_request``: a
        server that checked the request itself): it carries its parameters (give none of
        the others but ``request_id``, ``trace_headers`` and ``lora_request``) and is not
        checked again for this engine's model. ``lora_request`` (``lora.enable_lora``): the
        ``baton.lora.LoRARequest`` adapter the request runs with; None: the base model.
        """
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        check_generation(self.info)
        meta = self._meta(priority, user, scheduling, trace_headers, lora_request)
        checked = self._check(prompt, sampling_params, meta)
        rid = self._new_request_id(request_id, "req")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._ensure_handler()
        try:
            await self._submit(rid, checked, meta, queue.put_nowait)
            while True:
                item = _raised(queue.get_nowait() if not queue.empty() else await queue.get())
                yield item
                if item.finished:
                    return
        finally:
            # finished requests are already gone from the processor: this only aborts live ones
            await self._abort([rid])

    async def beam_search(
        self,
        prompt: PromptType,
        params: BeamSearchParams,
        *,
        lora_request: LoRARequest | None = None,
    ) -> BeamSearchOutput:
        """``LLM.beam_search`` for one prompt: its best ``params.beam_width`` beams, best first.

        Beams fork their parent's KV in the engine (docs/beam-search.md).
        Cancelling the call aborts its engine requests. One engine only (not with
        ``executor.data_parallel_size`` > 1: a beam's fork must reach its parent's engine).
        """
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        check_generation(self.info)
        self._one_engine("beam_search")
        lora = check_lora_request(lora_request, self.config.lora.enable_lora)
        _, ids = self.input_processor.tokenize(prompt)
        run = BeamRun(self.input_processor, [ids], params, self.tokenizer.eos_token_id, lora)
        queue: asyncio.Queue[EngineCoreOutput | BaseException] = asyncio.Queue()
        self._ensure_handler()
        try:
            while not run.search.done:
                for req in run.requests(lambda: f"beam-{next(self._ids)}"):
                    self._raw_sinks[req.request_id] = queue.put_nowait
                    await self.engine.add_request_async(req)
                # the new requests hold what they need of their parents' KV: the rest goes
                await self.engine.abort_requests_async(run.previous)
                for rid in run.previous:
                    del self._raw_sinks[rid]
                run.released()
                done: dict[str, EngineCoreOutput] = {}
                while len(done) < len(run.live):
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item.finished:
                        done[item.request_id] = item
                run.advance(done)
        finally:
            for rid in run.held:
                self._raw_sinks.pop(rid, None)
            if self.dead_error is None:
                await self.engine.abort_requests_async(run.held)
        return run.search.outputs(self.tokenizer.decode)[0]

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        user: str | None = None,
        scheduling: SchedulingInfo | Mapping[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Pool one prompt's final hidden states (vLLM's ``AsyncLLM.encode``): yields one
        PoolingRequestOutput, when the request finishes. It runs in the engine's steps with
        the generation requests; None fields of ``pooling_params`` take the config's
        ``model.pooling_type`` / ``model.pooling_normalize``. Cancelling aborts it;
        ``trace_headers`` and ``lora_request`` as in ``generate``."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        meta = self._meta(priority, user, scheduling, trace_headers, lora_request)
        text, ids = self.input_processor.tokenize(prompt)
        params, merged = check_pooling_prompt(
            self.input_processor, self.config.model, ids, pooling_params, meta
        )
        rid = self._new_request_id(request_id, "pool")
        queue: asyncio.Queue[PoolingRequestOutput | BaseException] = asyncio.Queue()
        self._ensure_handler()
        arrival = time.monotonic()
        try:
            self.output_processor.add_request(
                rid,
                text,
                ids,
                SamplingParams(),
                arrival,
                user=user,
                sink=queue.put_nowait,
                pooling=True,
                trace_headers=trace_headers,
            )
            await self.engine.add_request_async(
                pooling_engine_request(
                    self.input_processor, rid, ids, params, merged, arrival, meta
                )
            )
            yield _raised(await queue.get())
        finally:
            await self._abort([rid])

    def _meta(
        self,
        priority: int,
        user: str | None,
        scheduling: SchedulingInfo | Mapping[str, Any] | None,
        trace_headers: Mapping[str, str] | None,
        lora_request: LoRARequest | None,
    ) -> RequestMeta:
        """``generate``'s / ``encode``'s request metadata, its adapter checked."""
        lora = check_lora_request(lora_request, self.config.lora.enable_lora)
        return RequestMeta(
            priority=priority,
            user=user,
            scheduling=scheduling,
            trace_headers=trace_headers,
            lora_request=lora,
        )

    def _check(
        self, prompt: PromptType | CheckedRequest, params: SamplingParams | None, meta: RequestMeta
    ) -> CheckedRequest:
        """``generate``'s request, tokenized and checked against this engine's model."""
        if isinstance(prompt, CheckedRequest):
            return self._checked(prompt, params, meta)
        params = params or SamplingParams()
        text, ids = self.input_processor.tokenize(prompt)
        merged = self.input_processor.validate(
            ids, params, priority=meta.priority, user=meta.user, scheduling=meta.scheduling
        )
        return CheckedRequest(
            prompt_token_ids=ids,
            params=params,
            scheduling=merged,
            info=self.info,
            prompt=text,
            user=meta.user,
        )

    def _checked(
        self, checked: CheckedRequest, sampling_params: SamplingParams | None, meta: RequestMeta
    ) -> CheckedRequest:
        """A CheckedRequest as given, or checked again when it was checked for another model."""
        if sampling_params is not None or meta.schedules:
            raise InvalidRequestError(
                "a CheckedRequest carries its own sampling_params, priority, user and "
                "scheduling: give them to checked_request, not to generate",
                param="prompt",
            )
        if checked.info != self.info:  # checked against another model's limits
            self.input_processor.validate(
                checked.prompt_token_ids,
                checked.params,
                priority=checked.scheduling.priority,
                user=checked.user,
                cache_salt=checked.cache_salt,
                scheduling=checked.scheduling,
            )
        return checked

    def _new_request_id(self, request_id: str | None, prefix: str) -> str:
        """``request_id``, or a fresh ``prefix-N``; refused while a request under it is live."""
        rid = request_id or f"{prefix}-{next(self._ids)}"
        if self.output_processor.is_live(rid):
            # a second request under a live id would take over the first one's outputs
            raise InvalidRequestError(
                f"request id {rid!r} is already in flight; request ids must be unique"
            )
        return rid

    async def _submit(
        self,
        rid: str,
        checked: CheckedRequest,
        meta: RequestMeta,
        sink: Callable[[RequestOutput | BaseException], None],
    ) -> None:
        """Hand a checked request (its ``n`` samples: one engine request each) to the engine;
        its outputs go to ``sink``."""
        arrival = time.monotonic()
        ids, user = checked.prompt_token_ids, checked.user
        for child_id, index, p, parent in split_request(rid, checked.params):
            self.output_processor.add_request(
                child_id,
                checked.prompt,
                ids,
                p,
                arrival,
                index=index,
                parent=parent,
                user=user,
                sink=sink,
                trace_headers=meta.trace_headers,
            )
            # validated once, by _check (or by whoever built the CheckedRequest)
            req = self.input_processor.process(
                child_id,
                ids,
                p,
                scheduling=checked.scheduling,
                arrival_time=arrival,
                user=user,
                cache_salt=checked.cache_salt,
                lora_request=meta.lora_request,
            )
            await self.engine.add_request_async(req)

    async def abort(self, request_id: str) -> None:
        """Abort a request (and its n > 1 children); unknown or finished ids are no-ops."""
        await self._abort([request_id])

    async def _abort(self, request_ids: list[str]) -> None:
        stats = IterationStats(timestamp=time.monotonic()) if self.stat_loggers.loggers else None
        engine_ids = self.output_processor.abort_requests(request_ids, stats)
        if not engine_ids:
            return
        if stats is not None:
            self.stat_loggers.record(
                None, stats
            )  # client aborts count as finished with reason "abort"
        if self.dead_error is None:
            await self.engine.abort_requests_async(engine_ids)

    # ------------------------------------------------------------------ output handling

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(
                self._output_handler(), name="baton-output-handler"
            )
        if self._logger_task is None and self.stat_loggers.loggers:
            self._logger_task = asyncio.get_running_loop().create_task(
                self._log_loop(), name="baton-stat-logger"
            )

    async def _output_handler(self) -> None:
        try:
            while True:
                out = await self.engine.get_output_async()
                if self._raw_sinks:
                    for o in out.outputs:
                        sink = self._raw_sinks.get(o.request_id)
                        if sink is not None:
                            sink(o)
                stats = IterationStats(timestamp=time.monotonic())
                processed = self.output_processor.process_outputs(out.outputs, stats)
                if processed.reqs_to_abort:
                    await self.engine.abort_requests_async(processed.reqs_to_abort)
                self.stat_loggers.record(out.scheduler_stats, stats, out.engine_index)
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:  # a bug here must reach every waiting request, not vanish in a task
            log.exception("the output handler failed")
            self._fail_all(EngineDeadError(f"the output handler failed: {type(e).__name__}: {e}"))

    def _fail_all(self, error: BaseException, dead: bool = True) -> None:
        if dead:
            self.dead_error = error
            self._dead.set()
        for sink in list(self._raw_sinks.values()):
            sink(error)
        for state in self.output_processor.fail_unfinished(error):
            if state.sink is not None:
                state.sink(error)  # type: ignore[arg-type]

    async def wait_until_dead(self) -> BaseException:
        """Return the engine's fatal error once it has died (waits forever on a healthy engine)."""
        await self._dead.wait()
        assert self.dead_error is not None
        return self.dead_error

    async def _log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stat_loggers.interval)
            self.stat_loggers.log()

    # ------------------------------------------------------------------ utilities

    async def get_stats(self) -> Any:
        return await self.engine.call_utility_async("get_stats")

    async def reset_prefix_cache(self, reset_running: bool = False) -> bool:
        """As ``LLM.reset_prefix_cache``."""
        return await self.engine.call_utility_async("reset_prefix_cache", reset_running)

    def _one_engine(self, call: str) -> None:
        """Refuse a utility call that must reach every engine while the client has several
        (data parallel sends utility calls to one engine)."""
        n = self.config.executor.data_parallel_size
        if n > 1:
            raise InvalidRequestError(
                f"{call}() with executor.data_parallel_size = {n} would reach one engine of "
                f"{n}: not supported yet; run it with data_parallel_size = 1"
            )

    async def sleep(self, level: int = 1) -> None:
        """As ``LLM.sleep``: free the KV cache (level 1) or the weights too (level 2)."""
        check_sleep_level(level)
        self._one_engine("sleep")
        await self.engine.call_utility_async("sleep", level)

    async def wake_up(self) -> None:
        """As ``LLM.wake_up``."""
        self._one_engine("wake_up")
        await self.engine.call_utility_async("wake_up")

    async def is_sleeping(self) -> bool:
        return bool(await self.engine.call_utility_async("is_sleeping"))

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """As ``LLM.collective_rpc``."""
        self._one_engine("collective_rpc")
        return list(
            await self.engine.call_utility_async(
                "collective_rpc", method, list(args), dict(kwargs or {}), timeout
            )
        )

    async def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        """As ``LLM.save_sharded_state``."""
        self._one_engine("save_sharded_state")
        await self.engine.call_utility_async("save_sharded_state", str(path), pattern, max_size)

    async def start_profile(self) -> None:
        """As ``LLM.start_profile``."""
        self._one_engine("start_profile")
        await self.engine.call_utility_async("start_profile")

    async def stop_profile(self) -> list[str]:
        """As ``LLM.stop_profile``: the traces written, one per worker process."""
        self._one_engine("stop_profile")
        return list(await self.engine.call_utility_async("stop_profile"))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """As ``LLM.add_lora``."""
        self._one_engine("add_lora")
        lora = check_lora_request(lora_request, self.config.lora.enable_lora)
        return bool(await self.engine.call_utility_async("add_lora", lora))

    async def remove_lora(self, lora_id: int) -> bool:
        """As ``LLM.remove_lora``."""
        self._one_engine("remove_lora")
        return bool(await self.engine.call_utility_async("remove_lora", lora_id))

    async def list_loras(self) -> list[int]:
        """As ``LLM.list_loras``."""
        self._one_engine("list_loras")
        return list(await self.engine.call_utility_async("list_loras"))

    async def pin_lora(self, lora_id: int) -> bool:
        """As ``LLM.pin_lora``."""
        self._one_engine("pin_lora")
        return bool(await self.engine.call_utility_async("pin_lora", lora_id))

    async def get_memory_usage(self) -> list[WorkerMemory]:
        """As ``LLM.get_memory_usage``."""
        return list(await self.engine.call_utility_async("get_memory_usage"))

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        await self.engine.call_utility_async("check_health")

    def shutdown(self) -> None:
        """Stop the engine. Requests still in flight end with EngineShuttingDownError, not a hang."""
        for task in (self._handler, self._logger_task):
            if task is not None:
                task.cancel()
        if self.output_processor.states:
            self._fail_all(EngineShuttingDownError("the AsyncLLM was shut down"), dead=False)
        self.engine.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()  # the spans still buffered go out


_Output = TypeVar("_Output", RequestOutput, PoolingRequestOutput)


def _raised(item: _Output | BaseException) -> _Output:
    """An output from a request's queue; raises what failed it (the engine dead, its error)."""
    if isinstance(item, BaseException):
        raise item
    if item.error is not None:
        raise error_from_message(item.error)
    return item
