"""The engine's view of one request and its status machine.

WAITING -> RUNNING -> FINISHED_*; WAITING_FOR_FSM first when the request
carries a grammar that is still compiling; WAITING -> WAITING_FOR_KV -> WAITING while a KV
connector loads its prefix asynchronously; RUNNING -> PREEMPTED -> RUNNING when
its KV blocks are taken back (it recomputes from its tokens and produces the
same output). Any state -> FINISHED_ABORTED.
"""

from __future__ import annotations

import enum
from typing import Any

from baton.lora.request import LoRARequest
from baton.pooling_params import PoolingParams
from baton.protocol import EngineCoreEvent, EngineCoreEventType, EngineCoreRequest, FinishReason
from baton.sampling_params import SamplingParams
from baton.scheduling_info import SchedulingInfo, as_scheduling_info


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FSM = 1
    RUNNING = 2
    PREEMPTED = 3
    #: Admitted with blocks while a KV connector loads its prefix asynchronously; computes
    #: nothing until the load is reported (``baton.sched.kv_transfer``).
    WAITING_FOR_KV = 4
    # finished: everything from here on
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Mutable per-request state owned by the scheduler. Plain attributes, no properties on the hot path."""

    __slots__ = (
        "_output_start",
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "client_index",
        "deadline_time",
        "eos_token_id",
        "error",
        "events",
        "first_token_time",
        "fork_from",
        "grammar",
        "kv_transfer_params",
        "lora_key",
        "lora_request",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "pooling_params",
        "priority",
        "prompt_token_ids",
        "request_id",
        "retain_kv",
        "sampling_params",
        "scheduling",
        "skip_reading_prefix_cache",
        "status",
        "stop_reason",
        "user",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
        client_index: int = 0,
        max_model_len: int | None = None,
        scheduling: SchedulingInfo | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        retain_kv: bool = False,
        fork_from: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self._output_start = self.num_prompt_tokens
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        if scheduling is None:
            scheduling = SchedulingInfo(priority=priority)
        elif scheduling.priority != priority:
            scheduling = as_scheduling_info(scheduling, priority)  # merged, or a conflict refused
        #: The request's scheduling metadata, for policies (deadline, tenant, tags).
        self.scheduling = scheduling
        self.priority = scheduling.priority
        self.user = user
        #: ``arrival_time + scheduling.deadline`` on the scheduler's clock, or None.
        self.deadline_time: float | None = (
            None if self.scheduling.deadline is None else arrival_time + self.scheduling.deadline
        )
        self.cache_salt = cache_salt
        self.client_index = client_index
        # max_tokens=None: up to the model's length limit
        cap = sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - self.num_prompt_tokens
            cap = room if cap is None else min(cap, room)
        self.max_tokens: int = cap if cap is not None else 2**31
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 until then
        self.num_preemptions = 0
        #: When its first output token was produced, on the scheduler's clock (None: not yet).
        self.first_token_time: float | None = None
        self.block_hashes: list[Any] = []
        self.grammar: Any = None  # the structured-output matcher, when the request has a spec
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.events: list[EngineCoreEvent] | None = None
        #: Set for a pooling request: it finishes with its pooled vector after its prompt.
        self.pooling_params = pooling_params
        #: A prefix-cache hit would skip tokens whose hidden states the pooling needs (mean, cls).
        self.skip_reading_prefix_cache = (
            pooling_params is not None and pooling_params.needs_all_tokens
        )
        #: The LoRA adapter it runs with (None: the base model), and the key of its KV in the
        #: prefix cache: the adapter's id and the engine's registration of it (EngineCore sets it).
        self.lora_request = lora_request
        self.lora_key: str | None = None if lora_request is None else str(lora_request.lora_int_id)
        #: Its blocks outlive its finish, for forks, until it is aborted (beam search).
        self.retain_kv = retain_kv
        #: The retained request it forks its KV from when added (beam search); None: none.
        self.fork_from = fork_from
        #: What the KV connector reads about it (``EngineCoreRequest.kv_transfer_params``);
        #: after it finished, what the connector returned for the client.
        self.kv_transfer_params = kv_transfer_params

    @classmethod
    def from_engine_core_request(
        cls, req: EngineCoreRequest, max_model_len: int | None = None
    ) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_id,
            req.arrival_time,
            req.priority,
            req.user,
            req.cache_salt,
            req.client_index,
            max_model_len,
            req.scheduling,
            req.pooling_params,
            req.lora_request,
            req.retain_kv,
            req.fork_from,
            # a client without a frontend may leave it in extra_args, vLLM's route
            req.kv_transfer_params or req.sampling_params.kv_transfer_params,
        )

    @property
    def lora_id(self) -> int:
        """The LoRA adapter's id (0: none)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self._output_start :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self._output_start

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    def record_event(self, type_: EngineCoreEventType, timestamp: float) -> None:
        if self.events is None:
            self.events = []
        self.events.append(EngineCoreEvent(type=type_, timestamp=timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        events, self.events = self.events, None
        return events

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
