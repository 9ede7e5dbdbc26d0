"""Everything that crosses a process boundary, as msgspec structs.

Frontend <-> engine core: EngineCoreRequest, UtilityRequest in; EngineCoreOutputs
(with UtilityOutput and SchedulerStats) out. Engine core <-> executor workers:
SchedulerOutput, GrammarOutput in; ModelRunnerOutput out. The encoding is
baton.serial's msgpack codec. These structs are public, versioned API
(docs/stability.md): fields are only ever added, with defaults, at the end.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from baton.lora.request import LoRARequest
from baton.pooling_params import PoolingParams
from baton.sampling_params import SamplingParams
from baton.scheduling_info import SchedulingInfo

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False, kw_only=True)

#: The frame an engine sends before it exits on a fatal error; no client hangs.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


class RequestType(bytes, enum.Enum):
    """First frame of every frontend -> engine message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    EXECUTOR_FAILED = b"\x03"  # internal: the executor's failure callback woke the busy loop
    START_DP_WAVE = b"\x04"


class FinishReason(enum.IntEnum):
    """Why a request ended; ``str()`` gives OpenAI's finish_reason."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class EngineCoreRequest(msgspec.Struct, **_STRUCT):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    #: Who sent it (OpenAI's ``user``); tenant-aware scheduler policies group by it.
    user: str | None = None
    #: Mixed into prefix-cache block hashes: requests with different salts never share KV.
    cache_salt: str | None = None
    client_index: int = 0
    #: What the scheduler policy may read (deadline, tenant, tags); its priority equals
    #: ``priority``. None: only ``priority`` (clients that predate it send none).
    scheduling: SchedulingInfo | None = None
    #: Set for a pooling request (embeddings): its prompt's hidden states are pooled after
    #: its last prompt chunk instead of sampled, and it finishes there.
    pooling_params: PoolingParams | None = None
    #: The LoRA adapter the request runs with (``lora.enable_lora``); None: the base model.
    #: Its id is mixed into the prefix-cache block hashes.
    lora_request: LoRARequest | None = None
    #: Keep the request's KV blocks when it finishes, for forks, until it is aborted (beam search).
    retain_kv: bool = False
    #: A retained finished request whose computed tokens begin this prompt: the new request
    #: shares its full KV blocks and gets a copy of its last partial one (beam search's fork).
    fork_from: str | None = None
    #: What the KV connector (``[kv_transfer]``) reads about this request, e.g. where a consumer
    #: finds a producer's KV; from ``SamplingParams.extra_args["kv_transfer_params"]`` (vLLM's).
    kv_transfer_params: dict[str, Any] | None = None


class UtilityRequest(msgspec.Struct, **_STRUCT):
    """Call ``EngineCore.<method>(*args)`` in the engine; answered by a UtilityOutput."""

    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)
    client_index: int = 0


class TokenLogprobs(msgspec.Struct, **_STRUCT):
    """Logprobs at one position: entry 0 is the sampled token, then the top-k in order."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # rank of the sampled token in the full distribution, 1 = most likely


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, **_STRUCT):
    type: EngineCoreEventType
    timestamp: float  # time.monotonic() in the engine process


class EngineCoreOutput(msgspec.Struct, **_STRUCT):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    #: The stop token id (an int) that ended the request, if any.
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    events: list[EngineCoreEvent] | None = None
    #: Set with FinishReason.ERROR: what went wrong for this request only.
    error: str | None = None
    #: With the first token of a request with prompt_logprobs: one entry per prompt token
    #: but the first (the prompt token, then the top-k there).
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    #: A pooling request's result: a 1-D float32 torch tensor (its embedding).
    pooling_output: Any = None
    #: With the finished output: what the KV connector returns to the client about this
    #: request (its ``request_finished``), e.g. where a consumer engine finds its KV.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, **_STRUCT):
    call_id: int
    result: Any = None
    failure_message: str | None = None


class KVTransferStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A KV connector's figures since it was last asked (``SchedulerStats.kv_transfer``).

    Token and byte counts are deltas; ``tier_bytes`` / ``tier_capacity_bytes`` are levels.
    Tiers are named by their ``medium`` as in KV events (``CPU``, ``DISK``, ...).
    """

    hit_tokens: dict[str, int] = msgspec.field(default_factory=dict)  # tier -> tokens served
    load_bytes: int = 0
    load_seconds: float = 0.0
    save_bytes: int = 0
    save_seconds: float = 0.0
    failed_loads: int = 0  # blocks found bad or missing when loading (then recomputed)
    tier_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    tier_capacity_bytes: dict[str, int] = msgspec.field(default_factory=dict)


class KVConnectorOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a worker's KV-connector half reports after a step (``ModelRunnerOutput.kv_connector``).

    With several workers the kernel merges their reports: a load counts as finished once every
    worker finished it, with the fewest tokens any worker loaded.
    """

    #: request id -> tokens loaded (from the first token the load was asked for); fewer than
    #: asked means a block was missing or bad: the rest is recomputed, never served.
    finished_loading: dict[str, int] = msgspec.field(default_factory=dict)
    #: requests whose blocks, held after they finished (``request_finished`` returned True),
    #: are saved and may be freed.
    finished_saving: list[str] = msgspec.field(default_factory=list)
    #: request id -> message: the connector failed this request (the request fails, not the
    #: engine; its blocks are freed at once: the half must not write into them any more).
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    stats: KVTransferStats | None = None
    #: Set by the kernel when the worker half's ``start_step`` or ``finish_step`` raised (the
    #: message): the requests with connector work in that step fail, not the engine.
    step_error: str | None = None


class SchedulerStats(msgspec.Struct, **_STRUCT):
    """The scheduler's figures after one step."""

    step: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_scheduled_tokens: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # of which found cached
    num_preemptions: int = 0  # this step
    num_batches_in_flight: int = 0
    # speculative decoding, this step (totals in a snapshot): verifications of drafts, draft
    # tokens proposed, of which accepted, and accepted by draft position (index 0 = first draft)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] | None = None
    # goodput, this step (totals in a snapshot): requests with an SLO (scheduling.slo_ttft_ms /
    # slo_tpot_ms) that finished (stopped, length-capped or failed; not aborted), of which met it
    num_slo_finished: int = 0
    num_slo_met: int = 0
    #: The KV connector's figures since the previous step (``[kv_transfer]``); None: no connector.
    kv_transfer: KVTransferStats | None = None


class EngineCoreOutputs(msgspec.Struct, **_STRUCT):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    #: Requests that finished without a final token output (e.g. aborted by the engine).
    finished_requests: list[str] | None = None
    #: Data-parallel waves (expert parallel): engine 0 says that wave N ended on every engine.
    wave_complete: int | None = None
    #: An idle engine got a request and started wave N: the frontend starts it on the others.
    start_wave: int | None = None


class DPWaveStart(msgspec.Struct, **_STRUCT):
    """START_DP_WAVE's body: engines still idle in a wave before ``wave`` step from now on
    (dummy batches while they have no request); a start for a wave an engine already
    finished is stale and ignored. ``exclude_engine`` is the engine that started it itself."""

    wave: int
    exclude_engine: int = -1


# --------------------------------------------------------------------------
# engine core <-> executor workers
# --------------------------------------------------------------------------


class NewRequestData(msgspec.Struct, **_STRUCT):
    """A request the model runner has not seen (or dropped on preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    #: Tokens generated before a preemption; empty for a first-time request.
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    #: Set for a pooling request: the runner pools its prompt's hidden states, never samples it.
    pooling_params: PoolingParams | None = None
    #: The LoRA adapter its tokens run with (the runner reads it if it has not yet); None: none.
    lora_request: LoRARequest | None = None


class CachedRequestData(msgspec.Struct, **_STRUCT):
    """Requests already in the runner's batch: only what changed, aligned by index."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    #: Tokens appended since the request was last scheduled (normally the last sampled one).
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    #: Blocks appended to the request's block table since it was last scheduled.
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)


class SchedulerOutput(msgspec.Struct, **_STRUCT):
    """One step's work: which requests run, how many tokens each, and their blocks."""

    step_id: int = 0
    scheduled_new_reqs: list[NewRequestData] = msgspec.field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    #: Finished or aborted since the previous step: the runner drops their state.
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    #: Preempted since the previous step: dropped too; they come back as new requests.
    preempted_req_ids: list[str] = msgspec.field(default_factory=list)
    #: Scheduled requests whose sampling waits for a grammar bitmask (sample_tokens).
    structured_output_req_ids: list[str] = msgspec.field(default_factory=list)
    #: Draft tokens to verify: req id -> the tokens proposed after its last token. Such a
    #: request's num_scheduled_tokens is 1 + len(drafts); the runner returns the drafts it
    #: accepted followed by one token of its own.
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    #: KV blocks to copy, (source id, destination id), in every layer before this step's
    #: forward: a forked request's copy of its parent's last partial block (copy-on-write).
    kv_block_copies: list[tuple[int, int]] = msgspec.field(default_factory=list)
    #: The KV connector's orders for this step (its scheduler half's ``build_connector_meta``),
    #: for every worker's half; None: no connector.
    kv_connector_metadata: bytes | None = None
    #: Decode steps the runner may run for this step (``scheduler.decode_steps``): when > 1 every
    #: scheduled request decodes one token greedily and has KV slots for this many; the runner
    #: feeds each token it picks back and returns up to this many per request (fewer: the
    #: scheduler counts what it returns).
    decode_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class GrammarOutput(msgspec.Struct, **_STRUCT):
    """The bitmask for sample_tokens: row i masks req_ids[i]; bit set = token allowed.

    ``bitmask`` is an int32 numpy array or torch tensor of shape [len(req_ids), ceil(vocab/32)].
    A request verifying k drafts has 1 + k rows in a row, in position order: the j-th masks
    the token that follows its first j drafts.
    """

    req_ids: list[str]
    bitmask: Any


class ModelRunnerOutput(msgspec.Struct, **_STRUCT):
    """Sampled tokens of one step, aligned with req_ids (empty for a mid-prompt chunk)."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    sampled_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    logprobs: dict[str, list[TokenLogprobs]] | None = None
    #: Requests that failed this step (their preparation or sampling raised) -> "ExceptionType: message".
    #: They are not in req_ids; the scheduler finishes them with FinishReason.ERROR.
    failed: dict[str, str] | None = None
    #: Requests whose prompt ended this step and that asked for prompt_logprobs -> one entry
    #: per prompt token but the first (TokenLogprobs: the prompt token, then the top-k).
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None
    #: Pooling requests that computed their last prompt token this step -> their pooled
    #: vector (a 1-D float32 torch tensor). They are in req_ids with no sampled token.
    pooler_output: dict[str, Any] | None = None
    #: The KV connector's report for this step (its worker halves', merged); None: nothing.
    kv_connector: KVConnectorOutput | None = None


class KVCacheSpec(msgspec.Struct, **_STRUCT):
    """The paged KV cache one worker needs per block (its own layers and heads only)."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str  # a torch dtype name, e.g. "float32"

    @property
    def page_size_bytes(self) -> int:
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[self.dtype]
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * itemsize


class ModelInfo(msgspec.Struct, **_STRUCT):
    path: str  # the resolved Hugging Face folder
    architecture: str
    vocab_size: int
    max_model_len: int  # the effective limit: config.model.max_model_len capped by the model's
    eos_token_ids: list[int]
    dtype: str = ""  # what the loaded model computes in; "" until a worker has loaded it
    dtype_native: bool = True  # whether the device computes dtype in hardware (not emulated)
    hidden_size: int = 0  # the size of a pooled vector (embedding); 0: unknown
    #: Embedding sizes the model was trained to be cut to (PoolingParams.dimensions): None
    #: when it was not (Matryoshka), [] when any size up to hidden_size is.
    matryoshka_dimensions: list[int] | None = None
    #: "generate" (a causal LM), or "pooling": a base model without a head (BertModel, ...),
    #: which serves pooling requests (embeddings) only.
    runner_type: str = "generate"
    #: The model's own pooling (model.pooling_type "auto"): its sentence-transformers Pooling
    #: mode, else "cls" for an encoder, "last" for the rest.
    pooling_type: str = "last"

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None


class EngineReady(msgspec.Struct, **_STRUCT):
    """The engine's READY handshake, sent once its executor and KV cache are initialised."""

    engine_index: int
    pid: int
    num_blocks: int
    info: ModelInfo


class KVCacheConfig(msgspec.Struct, **_STRUCT):
    num_blocks: int
    block_size: int


class ModelCapabilities(msgspec.Struct, **_STRUCT):
    """What the loaded model allows the scheduler (an executor's ``model_capabilities``).

    A model with a bidirectional layer supports neither: a token's keys then depend on
    later tokens, so neither an earlier chunk nor a cached prefix can be reused.
    """

    supports_chunked_prefill: bool = True
    supports_prefix_caching: bool = True
    #: Why a capability is off (logged when the core turns the matching setting off); "" if none.
    reason: str = ""
    #: Whether the runner can run several decode steps in one call (``SchedulerOutput.decode_steps``):
    #: False where other ranks take part in its forward (``ModelRunnerHooks.runs_alone``).
    supports_decode_steps: bool = True


class WorkerMemory(msgspec.Struct, **_STRUCT):
    """What one worker holds, measured from its live tensors and its process (``get_memory_usage``)."""

    rank: int
    pid: int
    #: The worker process's resident set size (the engine process for the uniproc executor).
    rss_bytes: int
    #: Bytes of the storages behind the runner's KV-cache tensors (0 while asleep).
    kv_cache_bytes: int
    #: Bytes of the storages behind the model's parameters and buffers (0 once dropped).
    weights_bytes: int
    #: Where the weights are: a torch device string ("cpu", "cuda:0"); "" when dropped.
    weights_device: str = ""
    #: CUDA bytes the caching allocator holds on this worker's device (0 on CPU).
    device_reserved_bytes: int = 0
