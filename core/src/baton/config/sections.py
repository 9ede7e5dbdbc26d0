"""The sections of baton's configuration: one pydantic model per ``[section]`` table.

Each field's docstring is its documentation (docs/configuration.md is rendered from them). An
extra key of a section is a plugin's settings sub-table (``[transport.zmq]``), checked by
``baton.plugins.check`` once the plugins are known.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import pydantic
from pydantic import BaseModel, ByteSize, ConfigDict, Field

from baton.errors import ConfigError

#: Turns executor.batch_invariant on by default, for tools that cannot pass configuration
#: (as vLLM's VLLM_BATCH_INVARIANT); BATON_EXECUTOR__BATCH_INVARIANT and the config still win.
BATCH_INVARIANT_ENV = "BATON_BATCH_INVARIANT"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _env_flag(name: str) -> bool:
    """A boolean environment variable: 1/true/yes/on or 0/false/no/off (any case); unset: False."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r}: use 1/true/yes/on or 0/false/no/off")


class _Section(BaseModel):
    # extra keys are plugin sub-tables (e.g. [transport.zmq]); plain typos are caught
    # by baton.plugins.check.check_config_plugins once the plugins are known.
    model_config = ConfigDict(
        extra="allow", validate_assignment=True, use_attribute_docstrings=True
    )


class ModelSection(_Section):
    name: str = "smollm2-135m-instruct"
    """A built-in alias, a local Hugging Face model folder, a .gguf file, or a Hugging Face Hub
    id (``org/name``: from the local Hub cache, downloaded into it when ``download`` allows)."""
    revision: str | None = None
    """The Hub revision (branch, tag or commit) of a Hub id; None: main."""
    download: bool = True
    """Download a Hub id missing from the local Hub cache (HF_HUB_CACHE / HF_HOME), with a
    progress bar. HF_HUB_OFFLINE=1 forbids it too; either way a missing model is an error
    saying how to get it."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Weights and activations. "auto": the checkpoint's dtype; on CPU a bfloat16 / float16
    checkpoint keeps it only where the CPU computes that type natively (bf16: avx512_bf16,
    amx_bf16, arm bf16; fp16: avx512_fp16, amx_fp16, arm asimdhp), else runs in float32 (the
    weights upcast once at load; info log), and float32 with quantization int8/int4. An explicit
    "bfloat16" / "float16" runs as asked; where the CPU emulates it, torch converts around every
    op and baton's float32-only CPU kernels and fast decode are off, so it is slower than float32
    (a warning says by how much) and only halves the weights' memory."""
    max_model_len: int | None = Field(None, gt=0)
    """Longest prompt + output. None: the model's own limit (max_position_embeddings; 8192 for
    SmolLM2), lowered to what the KV cache holds, with an info log saying so. A value set here
    must be within the model's limit and fit in the KV cache (else a ConfigError naming the
    largest that fits)."""
    tokenizer: str | None = None
    """A tokenizer folder when it differs from the model's."""
    cache_dir: Path | None = None
    """Where converted models (GGUF -> safetensors) are kept; default: the user cache dir."""
    seed: int = 0
    """Seed of the random generator for unseeded sampling."""
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    """Weight format in memory. "auto": a GGUF keeps its quantized tensors as they are (Q4_0,
    Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) on CPU in float32 without tensor parallelism, else it is
    dequantized (info log); a safetensors checkpoint runs as stored. "none": every weight
    dequantized to dtype (the exactness reference). "int8" / "int4": weight-only quantization in
    groups of 32 (Q8_0 / Q4_1 blocks) applied at load to every plain linear layer, the LM head
    and the embedding (not with tensor_parallel_size > 1). Quantized layers compute in float32:
    "int8" and "int4" need dtype float32 (or "auto" on CPU)."""
    load_format: Literal["auto", "sharded_state"] = "auto"
    """How the weights load. "auto": the model folder's full checkpoint, sharded at load for
    tensor / pipeline parallelism. "sharded_state": a folder written by
    ``LLM.save_sharded_state(path)``, each rank reading its own already sharded file
    (``model-rank-{rank}-part-{part}.safetensors``); the engine's tensor_parallel_size and
    pipeline_parallel_size must be those it was saved with (else a ConfigError)."""
    activation_quantization: Literal["none", "int8"] = "none"
    """Inputs of the quantized layers (model.quantization). "none": float32, exact weight-only
    quantization. "int8": quantized to int8 per 32 values, integer dot products with the weight
    blocks (as llama.cpp computes), faster and not exact (greedy tokens may differ): in
    decode-sized calls (up to 16 rows) always, in prefill too where the layer's rows are
    packed for linear_q8p (CPUs with AVX-512 VNNI or AVX2; Q4_0, Q4_1, Q8_0 blocks), elsewhere
    prefill keeps float32 inputs. `baton env` names the path."""
    pooling_type: Literal["auto", "last", "mean", "cls"] = "auto"
    """How a pooling request (embeddings: LLM.embed, /v1/embeddings) turns its prompt's final
    hidden states (after the model's final norm) into one vector, unless the request says:
    "last" the last token's, "mean" the mean over every prompt token, "cls" the first token's.
    "auto": the model's own (a sentence-transformers Pooling config in its folder; else "cls"
    for an encoder such as BERT, "last" for a causal LM). vLLM's --pooler-config pooling_type."""
    pooling_normalize: bool = True
    """L2-normalise pooled vectors unless the request says (vLLM's pooler normalize; on by
    default for embeddings, as in vLLM)."""

    @pydantic.model_validator(mode="after")
    def _quantization_needs_float32(self) -> ModelSection:
        if self.quantization in ("int8", "int4") and self.dtype in ("bfloat16", "float16"):
            raise ValueError(
                f"quantization={self.quantization!r} runs its layers in float32, so it cannot "
                f"take dtype={self.dtype!r}: set model.dtype to 'float32' (or 'auto'), or "
                "model.quantization to 'none' for unquantized weights in that dtype"
            )
        if self.activation_quantization != "none" and self.quantization == "none":
            raise ValueError(
                f"activation_quantization={self.activation_quantization!r} applies to quantized "
                "layers, and quantization='none' makes none: set model.quantization to 'auto', "
                "'int8' or 'int4', or activation_quantization to 'none'"
            )
        return self


class CacheSection(_Section):
    block_size: int = Field(16, gt=0, le=1024)
    """Tokens per KV-cache block (the unit of allocation and of prefix caching)."""
    kv_cache_memory: ByteSize | None = None
    """KV cache size, e.g. "2GiB". None: memory_utilization on CUDA; on CPU what max_num_seqs full-length sequences need, at most 1GiB (with a cache.dtype narrower than the activations, at most the tokens 1GiB holds in the activation dtype)."""
    memory_utilization: float | None = Field(None, gt=0, le=1)
    """On CUDA: the fraction of device memory the model and the KV cache may use (default 0.9)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks shared with earlier requests (chained block hashes)."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Element type of the KV cache. "auto": the model's activation dtype (exact). "float16" /
    "bfloat16" halve a float32 cache (twice the blocks for the same kv_cache_memory) and are
    not exact: keys/values are rounded to nearest-even when written, attention still computes in
    the activation dtype, so greedy tokens may differ from a float32 cache's (float16 keeps 11
    bits of mantissa up to +-65504, bfloat16 8 bits over float32's range)."""
    prefault: bool = True
    """On CPU, map every page of the KV cache when it is allocated (a zero written into each), as
    vLLM and llama.cpp fill theirs at start: the cache's memory is taken at start, not when a
    burst of requests first reaches it, and serving never stops for a page fault (mapped first,
    workload.json ran 1.13-1.32x faster in a 2-core virtual machine). Start-up takes longer by
    the time the kernel needs to map the cache (logged; well under a second a GiB on bare
    metal, 0.1-6 s in that VM, where a one-message `baton chat` took 12-17 s against 8-11 s).
    False: pages are mapped as requests first write them (a quicker start, and a small engine
    takes only the memory it uses); a smaller kv_cache_memory also starts quicker."""


class SchedulerSection(_Section):
    policy: str = "fcfs"
    """Any installed scheduler policy: fcfs, priority, slo (per-request SLO deadlines), ...
    (`baton plugins`); a policy's own settings sit in ``[scheduler.<name>]`` (docs/hooks.md:
    ``[scheduler.fcfs] victim``, ``[scheduler.slo] on_miss``)."""
    max_num_seqs: int = Field(64, gt=0)
    """Most requests running at once."""
    max_num_batched_tokens: int = Field(2048, gt=0)
    """Token budget of one step (prompt chunks + decodes)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget over several steps."""
    reserve_full_prompt: bool = True
    """Admit a waiting request only when the blocks of its whole sequence (prompt, plus the
    tokens a preempted request had generated) can be taken at once, and take them at admission,
    though the step computes only the first chunk. Prefix-cache hits need no block; cached blocks
    no request uses count as free (evicted at admission). Its later prompt chunks then never need
    a block, so a request never preempts itself mid-prompt; decodes still take blocks one at a
    time and may preempt. False: admission takes the first chunk's blocks only (earlier
    admission, but a long prompt may be preempted and recomputed when the cache runs short)."""
    long_prefill_token_threshold: int | None = Field(None, gt=0)
    """Most prompt tokens one request computes in a step (vLLM's long_prefill_token_threshold),
    so a long prompt leaves budget to others; None: up to the step's budget. Needs
    enable_chunked_prefill (ignored without it)."""
    max_num_partial_prefills: int | None = Field(None, gt=0)
    """Most requests part-way through their prompt at once (vLLM's max_num_partial_prefills): a
    waiting request whose prompt does not end in its first step is admitted only below this
    cap (admission stops there, keeping the policy's order); None: no cap. Needs
    enable_chunked_prefill (ignored without it)."""
    target_step_ms: (
        Literal["auto", "off"] | Annotated[float, Field(gt=0, le=3_600_000, allow_inf_nan=False)]
    ) = "auto"
    """Latency-aware token budget: a step's prompt chunks (all requests together) shrink so that
    the step takes about this long with the decodes it carries, by a step-time model learned
    from the measured time of each step (a prior from the built-in cost model until steps are
    measured). Every running decode still gets its token each step; prompt chunks never go below
    one KV block (cache.block_size tokens) a step, and a step with no decode is not held to it.
    "auto" (the default): the target is 1.75x the time of a step of decodes alone, for the
    batch the decodes grow to (those running plus the requests waiting, up to max_num_seqs), so
    it follows the machine, the model and the load. That time is measured: the first step with
    decodes computes no prompt token (a probe), and so does the next while no such step is
    measured, then one in 8 while the decodes grow or shrink by a quarter and one in 32 anyway;
    the lower quartile of the latest 5 such steps (the smallest of fewer), carried to other
    batch sizes by the step-time model's shape and the cost model's (the smaller), sets it
    (before one is measured: the step-time model's prediction; before any step is measured: no
    target). A number: that many milliseconds. "off" (or None): prompt
    chunks fill max_num_batched_tokens. Needs
    enable_chunked_prefill (off without it), and is off with a pipeline batch queue (overlapping
    batches have no step time to measure; a number set there logs a warning). "auto" is also
    off where the model computes in bfloat16 or float16 on CPU: those results depend on each
    step's shapes, so a budget that follows the clock would change tokens from run to run (a
    number is kept there)."""

    decode_steps: int = Field(4, ge=1, le=64)
    """Most decode steps one engine step runs (vLLM's num_scheduler_steps): when every scheduled
    request decodes greedily with nothing else reading its logits (``SamplingParams.argmax_only``:
    no logprobs, penalties, min_tokens, logit bias, allowed tokens, bad words or grammar), no
    request waits, and at most ``baton.sched.decode_steps.MAX_ROWS`` (4) requests run, the model runner feeds
    each token it picks back for up to this many tokens a request, capped by each request's
    max_tokens and max_model_len. The engine's per-step work (scheduling, the hand-off to the
    executor, sampling, output processing) is then paid once for them; outputs stream that many
    tokens at a time, and an abort or a new request waits for the steps in flight. The same
    tokens as one step at a time. 1: one decode step per engine step. Off with a pipeline batch
    queue, speculative decoding, a KV connector, and runners that share their forward with other
    ranks (tensor, pipeline and expert parallel)."""

    @pydantic.field_validator("target_step_ms", mode="before")
    @classmethod
    def _none_is_off(cls, value: Any) -> Any:
        return "off" if value is None else value


class ExecutorSection(_Section):
    backend: str = "uniproc"
    """Any installed executor: uniproc, cuda-tp, pipeline, ..."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """cpu, cuda, cuda:N, or auto (CUDA when available)."""
    tensor_parallel_size: int = Field(1, gt=0)
    """Ranks the model's heads, MLP and vocabulary are split across (executor cuda-tp)."""
    pipeline_parallel_size: int = Field(1, gt=0)
    """Stages the model's layers are split across (executor pipeline)."""
    data_parallel_size: int = Field(1, gt=0)
    """Independent engine cores behind one asyncio frontend (AsyncLLM, baton serve), each with
    the whole model; routing.router picks the engine of each request."""
    data_parallel_backend: str = "mp"
    """Where engine cores run when the transport crosses processes (zmq, shm): mp (a local
    process each) or an installed engine launcher: ray (baton-plugin-ray: a Ray actor each,
    on any node of the cluster; [executor.ray] engine_* settings; needs transport zmq, tcp
    across hosts; not with expert_parallel). vLLM's --data-parallel-backend."""
    num_threads: int | None = Field(None, gt=0)
    """torch intra-op threads per process; None keeps torch's default."""
    cpu_kernels: bool = True
    """On CPU in float32, run decode attention and decode-sized linears through baton's C++ kernels
    (compiled once with the system's C++ compiler; without one, a warning and torch ops)."""
    fast_decode: bool = True
    """Run decode-only steps (and a float32 model's prefill and mixed steps of up to 2048 tokens whose
    prompt rows read short contexts) of Llama-block models (Llama, Qwen2, Mistral without sliding window) through one native call
    for the whole layer stack (needs cpu_kernels; CPU, float32 or bfloat16: a bfloat16 model's
    linears run as oneDNN's bf16 GEMMs, the rest in float32)."""
    batch_invariant: bool = Field(default_factory=lambda: _env_flag(BATCH_INVARIANT_ENV))
    """Batch-invariant inference: a request's tokens and logprobs are the same bits whatever else
    runs beside it (batch size and composition, its row, prefill chunk boundaries, speculative
    verify rows). Every step, prefill included, runs fast_decode's native layer stack with one
    summation order per output whatever the number of rows (docs/cpu-kernels.md). Default: the
    environment variable BATON_BATCH_INVARIANT (1/true/yes/on), else false. With
    tensor_parallel_size > 1 it holds within that size (the ranks' partial sums added in rank
    order); another size gives other bits. Refused (an error naming why) where it cannot hold:
    CUDA, pipeline / expert parallelism, LoRA, cpu_kernels or fast_decode off, dtype other than
    float32, a model fast_decode does not run."""
    expert_parallel: bool = False
    """With data_parallel_size N > 1 and a mixture-of-experts model (Mixtral, Qwen2/3-MoE, OLMoE):
    each engine core holds E/N of every MoE layer's E experts and the layers dispatch tokens to
    them across the engines (gloo on CPU, NCCL on CUDA), which then step together in waves
    (docs/data-parallel.md). vLLM's --enable-expert-parallel. Ignored (a warning)
    for a dense model; needs E divisible by N, tensor/pipeline_parallel_size 1."""
    data_parallel_master_port: int = Field(0, ge=0, le=65535)
    """With expert_parallel: the 127.0.0.1 TCP port where the engine cores meet to build their
    process groups (a torch TCPStore the frontend serves); 0: a free port."""
    data_parallel_rank: int = Field(0, ge=0)
    """Which engine core of the data-parallel group this is: set by the frontend for each engine
    it starts (leave it at 0)."""
    dp_wave_check_steps: int = Field(32, ge=1, le=100_000)
    """With expert_parallel: every this many steps of a wave the engine cores all-reduce whether
    any has unfinished requests, and stop together when none has; once a check finds one of them
    idle (running dummy batches), they check every step until the wave ends."""
    collective_timeout_s: float = Field(300.0, gt=0, le=86_400, allow_inf_nan=False)
    """With expert_parallel: how long an engine core waits in one collective (an MoE layer's
    dispatch, a wave check) for the others before it fails (an engine that dies fails them at
    once); also the most one engine's step may take while the others wait."""


class TransportSection(_Section):
    name: str = "inproc"
    """Frontend <-> engine-core transport: inproc, zmq, shm, ..."""


class StructuredOutputSection(_Section):
    backend: str = "auto"
    """A structured-output backend; "auto" takes xgrammar when installed."""
    compile_threads: int = Field(2, gt=0)
    """Threads compiling grammars off the hot path."""


class SpeculativeSection(_Section):
    method: str = "none"
    """A speculator proposing draft tokens that each step verifies: ngram (prompt lookup), or an
    installed plugin's (`baton plugins`); none: no speculation."""
    num_tokens: int = Field(3, ge=1, le=15)
    """Most draft tokens per request per step (vLLM's num_speculative_tokens). Each costs a row
    of every matmul in the verifying step: on a 2-core CPU 3 beat 5 (docs/benchmarks.md)."""
    disable_by_batch_size: int | None = Field(4, gt=0)
    """No drafts in a step where more requests than this are running: verifying drafts of many
    requests costs more than it saves once a step is compute-bound. None: always speculate."""
    adaptive: bool = True
    """Per request: draft one more than was accepted last time (up to num_tokens), and pause
    drafting for a while after repeated verifications that accepted nothing."""


class KVTransferSection(_Section):
    connector: str = "none"
    """A KV connector (plugin kind ``kv_connector``) that keeps KV blocks outside the engine's
    own pool: a tier in RAM or on disk, or another engine (vLLM's ``kv_connector``); none: the
    pool only. Its settings are the ``[kv_transfer.<name>]`` sub-table (docs/kv-connectors.md)."""
    role: Literal["both", "producer", "consumer"] = "both"
    """What this engine does with the connector (vLLM's ``kv_role``): ``producer`` only saves
    computed blocks, ``consumer`` only loads them, ``both`` does both (a tiered cache)."""


class LoRASection(_Section):
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) on top
    of the model: requests name one (``lora_request``, or an adapter's name as the server's
    ``model``), several adapters and the base model share a batch (vLLM's --enable-lora). Needs
    tensor_parallel_size = pipeline_parallel_size = 1; steps with an adapter run transformers'
    modules (not fast_decode's native layer stack)."""
    max_loras: int = Field(1, gt=0, le=64)
    """Most adapters in one batch: slots of stacked factors in device memory, each
    max_lora_rank wide in every adapted layer; a waiting request whose adapter would make one
    more among the running requests waits (vLLM's --max-loras)."""
    max_lora_rank: int = Field(16, gt=0, le=512)
    """The highest adapter rank accepted; every slot is this wide, so a larger value costs memory
    and time on every step with an adapter (vLLM's --max-lora-rank)."""
    max_cpu_loras: int | None = Field(None, gt=0)
    """Adapters kept loaded in host memory (add_lora, or named by a request); past it the least
    recently used one that no request is using and that is not pinned (pin_lora) is dropped, and
    read again from its folder when a request names it. None: max_loras (vLLM's
    --max-cpu-loras); at least max_loras."""

    @pydantic.model_validator(mode="after")
    def _cpu_loras_hold_a_batch(self) -> LoRASection:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} < max_loras={self.max_loras}: the adapters "
                "kept in host memory must hold a batch's; raise max_cpu_loras or leave it unset"
            )
        return self


class RoutingSection(_Section):
    router: str = "least-loaded"
    """With executor.data_parallel_size > 1, which engine core serves each request:
    least-loaded (fewest requests in flight), round-robin, prefix-aware (requests sharing a
    prompt prefix go to the engine that has it cached, within a load cap; [routing.prefix-aware]),
    or an installed plugin's (`baton plugins`)."""
    on_engine_death: Literal["fail-server", "fail-requests"] = "fail-server"
    """With data_parallel_size > 1, when one engine core dies: fail-server (every request fails
    and the frontend reports the engine dead, as with one engine) or fail-requests (that engine's
    requests fail with an EngineDeadError, the others go on and new requests go to the engines
    still alive; the frontend dies with the last one)."""


#: A KV-events endpoint: a loopback TCP port, or an ipc:// path.
_TCP_ENDPOINT = re.compile(r"^tcp://127\.0\.0\.1:(\d{1,5})$")


def endpoint_port(endpoint: str) -> int | None:
    """The TCP port of a ``tcp://127.0.0.1:PORT`` endpoint; None for ``ipc://``."""
    m = _TCP_ENDPOINT.match(endpoint)
    return int(m.group(1)) if m else None


def _check_endpoint(value: str) -> str:
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return value
    port = endpoint_port(value)
    if port is None or not 0 < port <= 65535:
        raise ValueError(
            f"{value!r} is not an endpoint baton binds: use tcp://127.0.0.1:PORT (PORT 1-65535; "
            "subscribers connect to it) or ipc:///path/to/socket"
        )
    return value


class KVEventsSection(_Section):
    enable_kv_cache_events: bool = False
    """Publish the engine's KV cache events: BlockStored when a full block enters the prefix
    cache, BlockRemoved when a cached block is evicted, AllBlocksCleared on reset_prefix_cache
    (medium "GPU": the engine's own pool, on every device), in vLLM's wire format, so a KV-aware
    router reads them (docs/kv-events.md). vLLM's --kv-events-config enable_kv_cache_events.
    Off: nothing is recorded or published, no socket is bound."""
    publisher: Literal["zmq", "null"] = "zmq"
    """zmq: a ZeroMQ PUB socket on ``endpoint`` (needs pyzmq: ``pip install
    'baton-core[kv-events]'``), from a background thread of each engine core; null: the events
    are recorded and dropped (nothing bound)."""
    endpoint: str = "tcp://127.0.0.1:5557"
    """Where the PUB socket binds: tcp://127.0.0.1:PORT or ipc:///path. With
    executor.data_parallel_size N each engine core binds its own: the port plus its
    data-parallel rank (an ipc path with ``_dp<rank>`` appended, rank 0 as given), as vLLM does."""
    replay_endpoint: str | None = None
    """Where a ROUTER socket answers replay requests (a subscriber that missed batches sends the
    8-byte big-endian sequence number to start from and gets every buffered batch from there,
    then an end marker); same forms and per-rank offset as ``endpoint``. None: no replay."""
    buffer_steps: int = Field(10_000, gt=0)
    """Published batches kept for replay (the newest)."""
    hwm: int = Field(100_000, ge=0)
    """The PUB socket's send high-water mark (messages queued per subscriber before ZeroMQ
    drops for that subscriber; 0: no limit)."""
    max_queue_size: int = Field(100_000, gt=0)
    """Batches waiting for the publisher thread; when it is full a step's batch is dropped (a
    warning says how many so far) rather than the engine waiting."""
    topic: str = ""
    """The first frame of every message (subscribers filter on its prefix; "" matches all)."""
    int_block_hashes: bool = True
    """Send each block hash as an unsigned 64-bit integer, the low 64 bits of baton's 16-byte
    digest (its last 8 bytes, big-endian): what vLLM sends by default
    (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) and KV-aware routers written for it read. False: the
    whole digest as bytes (vLLM's ``=0``)."""

    @pydantic.field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        return _check_endpoint(value)

    @pydantic.field_validator("replay_endpoint")
    @classmethod
    def _replay_endpoint(cls, value: str | None) -> str | None:
        return None if value is None else _check_endpoint(value)

    @pydantic.model_validator(mode="after")
    def _apart(self) -> KVEventsSection:
        if self.replay_endpoint == self.endpoint:
            raise ValueError(
                f"replay_endpoint = endpoint = {self.endpoint!r}: the replay socket needs its "
                "own address (e.g. the next port), or replay_endpoint = None"
            )
        return self


class ServingSettings(msgspec.Struct, frozen=True):
    """What the kernel takes from the config section of the plugin that serves (its
    ``serving_settings()``; baton-plugin-openai's ``[server]``), read as
    ``BatonConfig.serving``. The defaults are the library's, with no such plugin."""

    shutdown_timeout: float = 0.0
    """On SIGTERM / shutdown: seconds an engine lets in-flight requests finish; 0 aborts them."""
    served_model_name: str | None = None
    """The model name clients use (tracing spans); None: model.name."""


#: The standard logging level names, most verbose first (observability.log_level, --log-level).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ObservabilitySection(_Section):
    log_stats: bool = True
    """Collect per-step and per-request statistics and feed the stat loggers."""
    log_stats_interval: float = Field(10.0, gt=0)
    """Seconds between two periodic stats log lines."""
    stat_loggers: list[str] = Field(default_factory=lambda: ["logging"])
    """Installed stat loggers to run: logging, prometheus (baton serve), ..."""
    log_level: str = "INFO"
    """Log level of the engine and worker processes: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)."""
    tracing: bool = False
    """OpenTelemetry tracing: a span ``llm_request`` per finished request (queue, prefill and
    decode timings; a child of the request's ``traceparent``). Needs ``pip install
    'baton-core[otel]'``. Spans go to the tracer provider the application set
    (``opentelemetry.trace.set_tracer_provider``, ``opentelemetry-instrument``), else to an
    exporter made from the standard variables: OTEL_TRACES_EXPORTER (otlp, console, none),
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL (grpc, http/protobuf),
    OTEL_SERVICE_NAME (default baton). Off: no opentelemetry import, nothing on the hot path."""
    otlp_traces_endpoint: str | None = None
    """Send the spans by OTLP to this endpoint (vLLM's ``--otlp-traces-endpoint``, e.g.
    ``http://127.0.0.1:4317``); setting it turns tracing on, with baton's own exporter whatever
    OTEL_TRACES_EXPORTER and the OTEL_* endpoint variables say. None: see ``tracing``."""
    profile_dir: str | None = None
    """Folder for the torch profiler's traces (vLLM's ``VLLM_TORCH_PROFILER_DIR``):
    ``start_profile()`` / ``stop_profile()`` (LLM, AsyncLLM; the server's ``POST /start_profile``
    and ``POST /stop_profile``, which exist only when it is set) write one chrome trace (JSON) per
    worker process there. None: profiling is refused."""

    @pydantic.field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, value: Any) -> str:
        level = value.upper() if isinstance(value, str) else value
        if level not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)} (any case)")
        return level  # type: ignore[no-any-return]


#: Every section, in the order of the config and its docs: name -> its model.
SECTION_MODELS: dict[str, type[BaseModel]] = {
    "model": ModelSection,
    "cache": CacheSection,
    "scheduler": SchedulerSection,
    "executor": ExecutorSection,
    "transport": TransportSection,
    "structured_output": StructuredOutputSection,
    "speculative": SpeculativeSection,
    "kv_transfer": KVTransferSection,
    "routing": RoutingSection,
    "lora": LoRASection,
    "kv_events": KVEventsSection,
    "observability": ObservabilitySection,
}
SECTIONS = tuple(SECTION_MODELS)
