"""LLM: the offline, synchronous API (vLLM's shape)."""

from __future__ import annotations

import itertools
import numbers
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from baton.beam_search import BeamSearchOutput, BeamSearchParams
from baton.config import BatonConfig
from baton.engine.client import EngineCoreClient
from baton.engine.clients import make_client
from baton.engine.utility_methods import check_sleep_level
from baton.errors import EngineSleepingError, InvalidRequestError
from baton.frontend.beam_run import BeamRun
from baton.frontend.output_processor import OutputProcessor, split_request
from baton.frontend.pooling import check_pooling_prompt, pooling_engine_request
from baton.frontend.prompts import ChatMessages, InputProcessor, PromptMethods, PromptType
from baton.frontend.request_meta import RequestMeta
from baton.frontend.stat_loggers import StatLoggers
from baton.lora.request import LoRARequest, check_lora_request
from baton.metrics.stats import IterationStats
from baton.metrics.tracing import check_tracing, make_tracer
from baton.model.tokenizer import load_tokenizer
from baton.model_info import model_info
from baton.outputs import PoolingRequestOutput, RequestOutput
from baton.plugins.resolve import resolve_plugins
from baton.pooling_params import PoolingParams, check_generation
from baton.protocol import EngineCoreOutput, WorkerMemory
from baton.sampling_params import SamplingParams
from baton.scheduling_info import SchedulingInfo

#: One request's scheduling metadata as the API takes it: the struct or a mapping of its fields.
SchedulingArg = SchedulingInfo | Mapping[str, Any] | None


class LLM(PromptMethods):
    """Generate offline: ``LLM(model=..., config="baton.toml", **overrides).generate(prompts, params)``.

    ``overrides`` are config fields (``max_num_seqs=8``, ``transport="zmq"``,
    ``scheduler={"policy": "priority"}``, ``**{"cache.block_size": 32}``); see BatonConfig.load.
    """

    def __init__(
        self,
        model: str | None = None,
        config: str | os.PathLike[str] | None = None,
        **overrides: Any,
    ) -> None:
        self.config = BatonConfig.load(config, model=model, **overrides)
        # a bad config is refused before the tokenizer and the weights load
        #: The config's plugins, resolved once (the start-up check)
        self.plugins = resolve_plugins(self.config)
        # tracing asked for without its packages: refused here
        check_tracing(self.config.observability)
        info = model_info(self.config.model)
        self.tokenizer = load_tokenizer(self.config.model, info)
        self.stat_loggers = StatLoggers(
            self.config.observability, self.plugins.factories("stat_logger", self.config)
        )
        self.engine: EngineCoreClient = make_client(self.config, self.plugins, info=info)
        try:
            #: The request tracer (observability.tracing); None: tracing is off.
            self.tracer = make_tracer(self.config.observability, self.config.served_model_name)
        except BaseException:  # a bad OTEL_* variable: the engine must not outlive the error
            self.engine.shutdown()
            raise
        self.output_processor = OutputProcessor(self.tokenizer, tracer=self.tracer)
        # the engine's info: its max_model_len may be lowered to what the KV cache holds
        self.info = self.engine.info
        self.input_processor = InputProcessor(self.tokenizer, self.info)
        self._ids = itertools.count()
        #: The level this LLM put its engine to sleep at (0: awake).
        self._asleep = 0

    # ------------------------------------------------------------------ API

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        user: str | Sequence[str | None] | None = None,
        scheduling: SchedulingArg | Sequence[SchedulingArg] = None,
        trace_headers: Mapping[str, str] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs in prompt order.

        ``priority``, ``user`` and ``scheduling`` (a ``SchedulingInfo`` or a dict of its
        fields: priority, deadline, tenant, tags) are for the scheduler policy: one for
        all prompts, or one per prompt. With ``observability.tracing``, each request's span
        is a child of the trace ``trace_headers`` name (``traceparent``, ``tracestate``),
        else of the caller's current span, if any. ``lora_request`` (``lora.enable_lora``):
        the ``baton.lora.LoRARequest`` adapter to run with, one for all prompts or one (or
        None: the base model) per prompt.
        """
        prompt_list = _as_prompt_list(prompts)
        tokenized = [self.input_processor.tokenize(p) for p in prompt_list]
        return self._run(
            tokenized,
            sampling_params,
            use_tqdm,
            lambda n: self._metas(n, priority, user, scheduling, trace_headers, lora_request),
        )

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        scheduling: SchedulingArg | Sequence[SchedulingArg] = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several; ``scheduling`` and
        ``lora_request`` as in ``generate``."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise InvalidRequestError(
                "chat() got no messages: give a conversation (a list of {'role', 'content'} "
                "dicts) or a list of conversations",
                param="messages",
            )
        conversations = [messages] if isinstance(messages[0], Mapping) else messages
        tokenized = []
        for conv in conversations:
            ids = self.input_processor.render_chat(
                conv,  # type: ignore[arg-type]
                chat_template_kwargs=chat_template_kwargs,
            )
            tokenized.append((self.tokenizer.decode(ids), ids))
        return self._run(
            tokenized,
            sampling_params,
            use_tqdm,
            lambda n: self._metas(n, None, None, scheduling, None, lora_request),
        )

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: each prompt's best ``params.beam_width`` beams, best first.

        Each step sends every live beam as a one-token request asking for the top
        ``2 * beam_width`` logprobs; a beam's request forks the KV of the request its beam
        grew from (shared full blocks, a copied partial last block), so no token's KV is
        computed twice (see docs/beam-search.md).
        """
        self._check_awake()
        check_generation(self.info)
        params.check()
        tokenized = [self.input_processor.tokenize(p) for p in _as_prompt_list(prompts)]
        run = BeamRun(
            self.input_processor,
            [ids for _, ids in tokenized],
            params,
            self.tokenizer.eos_token_id,
            self._loras(lora_request, 1)[0],
        )
        try:
            while not run.search.done:
                for req in run.requests(lambda: f"beam-{next(self._ids)}"):
                    self.engine.add_request(req)
                # the new requests hold what they need of their parents' KV: the rest goes
                self.engine.abort_requests(run.previous)
                run.released()
                run.advance(self._finished(run.live))
        finally:
            self.engine.abort_requests(run.held)
        return run.search.outputs(self.tokenizer.decode)

    def _finished(self, request_ids: list[str]) -> dict[str, EngineCoreOutput]:
        """The final engine outputs of ``request_ids`` (read past the output processor)."""
        wanted = set(request_ids)
        done: dict[str, EngineCoreOutput] = {}
        while len(done) < len(wanted):
            for o in self.engine.get_output().outputs:
                if o.finished and o.request_id in wanted:
                    done[o.request_id] = o
        return done

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        user: str | Sequence[str | None] | None = None,
        scheduling: SchedulingArg | Sequence[SchedulingArg] = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt's final hidden states into one vector; outputs in prompt order.

        The prompts run through the same scheduler and runner steps as ``generate``'s
        (batched with them); ``pooling_params`` None fields take ``model.pooling_type`` and
        ``model.pooling_normalize``. ``outputs.data`` is the vector (``outputs.embedding``
        as floats). The other arguments are as in ``generate``.
        """
        self._check_awake()
        tokenized = [self.input_processor.tokenize(p) for p in _as_prompt_list(prompts)]
        n = len(tokenized)
        given = _per_prompt(pooling_params, n, "pooling_params")
        metas = self._metas(n, priority, user, scheduling, None, lora_request)
        # check everything before anything reaches the engine
        checked = [
            check_pooling_prompt(self.input_processor, self.config.model, ids, p, meta)
            for (_, ids), p, meta in zip(tokenized, given, metas, strict=True)
        ]
        request_ids: list[str] = []
        try:
            for (text, ids), meta, (params, info) in zip(tokenized, metas, checked, strict=True):
                rid = str(next(self._ids))
                request_ids.append(rid)
                arrival = time.monotonic()
                self.output_processor.add_request(
                    rid, text, ids, SamplingParams(), arrival, user=meta.user, pooling=True
                )
                self.engine.add_request(
                    pooling_engine_request(
                        self.input_processor, rid, ids, params, info, arrival, meta
                    )
                )
            return self._run_engine(request_ids, use_tqdm, "Pooling")
        except BaseException:
            self.engine.abort_requests(self.output_processor.abort_requests(request_ids))
            raise

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        **kwargs: Any,
    ) -> list[PoolingRequestOutput]:
        """Embeddings of the prompts (vLLM's ``LLM.embed``): ``encode`` with the config's pooling."""
        return self.encode(prompts, pooling_params, **kwargs)

    def reset_prefix_cache(self, reset_running: bool = False) -> bool:
        """Forget the prefix cache; False while requests hold blocks, unless ``reset_running``
        preempts the running ones first (they are recomputed later, with the same tokens)."""
        return self.engine.call_utility("reset_prefix_cache", reset_running)

    def get_stats(self) -> Any:
        return self.engine.call_utility("get_stats")

    def sleep(self, level: int = 1) -> None:
        """Free the engine's KV cache (level 1: the weights stay in host memory) or its weights
        too (level 2: reloaded from the model folder on ``wake_up``). Refused while requests
        are in flight; the prefix cache is forgotten; requests are refused until ``wake_up``."""
        check_sleep_level(level)
        self.engine.call_utility("sleep", level)
        self._asleep = level

    def wake_up(self) -> None:
        """Allocate the KV cache again (and load the weights after level 2); outputs are as before."""
        self.engine.call_utility("wake_up")
        self._asleep = 0

    def _check_awake(self) -> None:
        """Refuse a batch while asleep, before anything reaches the engine (which refuses too)."""
        if self._asleep:
            raise EngineSleepingError(
                f"the engine is asleep (level {self._asleep}, its KV cache freed): call "
                "LLM.wake_up() before generating"
            )

    def is_sleeping(self) -> bool:
        return bool(self.engine.call_utility("is_sleeping"))

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call ``method`` on every worker; one result per worker, in rank order. Only a
        Worker method on ``baton.rpc.WORKER_RPC_METHODS`` or a name registered with
        ``baton.rpc.register_worker_rpc`` is callable; results arrive as msgpack builtins."""
        return list(
            self.engine.call_utility(
                "collective_rpc", method, list(args), dict(kwargs or {}), timeout
            )
        )

    def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        """Save every worker's already sharded weights into folder ``path`` (files
        ``model-rank-{rank}-part-{part}.safetensors`` or ``pattern``; a new part past
        ``max_size`` bytes), with the model's config and tokenizer; load it with
        ``LLM(model=path, load_format="sharded_state")`` at the same tensor_parallel_size."""
        self.engine.call_utility("save_sharded_state", str(path), pattern, max_size)

    def start_profile(self) -> None:
        """Start the torch profiler in every worker (``observability.profile_dir`` must be set)."""
        self.engine.call_utility("start_profile")

    def stop_profile(self) -> list[str]:
        """Stop it; the chrome traces written (JSON files in ``observability.profile_dir``),
        one per worker process."""
        return list(self.engine.call_utility("stop_profile"))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter into the engine ahead of its requests (read and checked against
        the model: a bad folder fails here); False if it is loaded already."""
        lora = check_lora_request(lora_request, self.config.lora.enable_lora)
        return bool(self.engine.call_utility("add_lora", lora))

    def remove_lora(self, lora_id: int) -> bool:
        """Drop a loaded adapter (refused while a request uses it); False if it was not loaded."""
        return bool(self.engine.call_utility("remove_lora", lora_id))

    def list_loras(self) -> list[int]:
        """The ids of the loaded adapters."""
        return list(self.engine.call_utility("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter loaded (never dropped to make room, lora.max_cpu_loras)."""
        return bool(self.engine.call_utility("pin_lora", lora_id))

    def _loras(self, lora_request: Any, n: int) -> list[LoRARequest | None]:
        return [
            check_lora_request(x, self.config.lora.enable_lora)
            for x in _per_prompt(lora_request, n, "lora_request")
        ]

    def _metas(
        self,
        n: int,
        priority: Sequence[int] | None,
        user: str | Sequence[str | None] | None,
        scheduling: SchedulingArg | Sequence[SchedulingArg],
        trace_headers: Mapping[str, str] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[RequestMeta]:
        """One RequestMeta per prompt from ``generate``'s / ``encode``'s arguments (each one
        value for all prompts, or one per prompt; ``trace_headers`` one for all)."""
        loras = self._loras(lora_request, n)
        priorities = _per_prompt(priority if priority is not None else 0, n, "priority")
        users = _per_prompt(user, n, "user")
        given = _per_prompt(scheduling, n, "scheduling")
        return [
            RequestMeta(
                priority=prio, user=u, scheduling=s, trace_headers=trace_headers, lora_request=lora
            )
            for prio, u, s, lora in zip(priorities, users, given, loras, strict=True)
        ]

    def get_memory_usage(self) -> list[WorkerMemory]:
        """Each worker's memory, measured in its process: RSS, KV-cache and weight storages."""
        return list(self.engine.call_utility("get_memory_usage"))

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()  # the spans still buffered go out

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the loop

    def _run(
        self,
        tokenized: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        metas_of: Callable[[int], list[RequestMeta]],
    ) -> list[RequestOutput]:
        """Generate for ``tokenized``; ``metas_of(n)``: the n prompts' RequestMeta (checked
        once the LLM is known to be awake and to generate)."""
        self._check_awake()
        check_generation(self.info)
        n = len(tokenized)
        metas = metas_of(n)
        params = _per_prompt(sampling_params or SamplingParams(), n, "sampling_params")
        request_ids = []
        # validate everything before anything reaches the engine
        infos = [
            self.input_processor.validate(
                ids, p, priority=m.priority, user=m.user, scheduling=m.scheduling
            )
            for (_, ids), p, m in zip(tokenized, params, metas, strict=True)
        ]
        try:
            for (text, ids), p, meta, info in zip(tokenized, params, metas, infos, strict=True):
                rid = str(next(self._ids))
                request_ids.append(rid)
                self._add_request(rid, text, ids, p, meta, info)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            self.engine.abort_requests(self.output_processor.abort_requests(request_ids))
            raise

    def _add_request(
        self,
        request_id: str,
        prompt: str | None,
        ids: list[int],
        params: SamplingParams,
        meta: RequestMeta,
        scheduling: SchedulingInfo,
    ) -> None:
        """Hand one checked prompt (its ``n`` samples: one engine request each) to the engine."""
        arrival = time.monotonic()
        children = split_request(request_id, params)
        for rid, index, p, parent in children:
            self.output_processor.add_request(
                rid,
                prompt,
                ids,
                p,
                arrival,
                index=index,
                parent=parent,
                user=meta.user,
                trace_headers=meta.trace_headers,
            )
            # validated in _run, once per prompt
            req = self.input_processor.process(
                rid,
                ids,
                p,
                scheduling=scheduling,
                arrival_time=arrival,
                user=meta.user,
                lora_request=meta.lora_request,
            )
            self.engine.add_request(req)

    def _run_engine(
        self, request_ids: list[str], use_tqdm: bool, desc: str = "Generating"
    ) -> list[Any]:
        """The finished outputs of ``request_ids`` (RequestOutput or PoolingRequestOutput)."""
        wanted = set(request_ids)
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc=desc, disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(finished) < len(wanted):
                out = self.engine.get_output()
                stats = IterationStats(timestamp=time.monotonic())
                processed = self.output_processor.process_outputs(out.outputs, stats)
                if processed.reqs_to_abort:
                    self.engine.abort_requests(processed.reqs_to_abort)
                self.stat_loggers.record(out.scheduler_stats, stats, out.engine_index)
                self.stat_loggers.maybe_log()
                for ro in processed.request_outputs:
                    if ro.finished and ro.request_id in wanted:
                        finished[ro.request_id] = ro
                        bar.update(1)
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids, a dict) or a list of them -> the list; none is an error."""
    if isinstance(prompts, Iterator):
        prompts = list(prompts)
    if not isinstance(prompts, Sequence) or isinstance(prompts, str | bytes | bytearray):
        return [prompts]  # type: ignore[list-item]  # tokenize() says what is wrong with it
    if not prompts:
        raise InvalidRequestError(
            "generate() got no prompts: give a prompt or a non-empty list of prompts",
            param="prompt",
        )
    if isinstance(prompts[0], numbers.Number):
        return [prompts]  # one tokenised prompt (tokenize() refuses what is not an int)
    return list(prompts)


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    """``value`` once per prompt: a sequence (not a string) gives one item per prompt."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise InvalidRequestError(
                f"{name} has {len(value)} entries for {n} prompts: give one, or one per prompt"
            )
        return list(value)
    return [value] * n
