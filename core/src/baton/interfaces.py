"""The protocols that plugin products implement (what the hookspec factories return).

These are structural (``typing.Protocol``): a plugin needs no base class. The
conformance suites in ``baton.testing.conformance`` check the behaviour behind
each one. Mechanics (the step loop, overlap of the forward with grammar work,
the batch queue, abort handling, stop checks) stay in the kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from baton.config import BatonConfig
    from baton.metrics.stats import IterationStats
    from baton.protocol import (
        GrammarOutput,
        KVCacheConfig,
        KVCacheSpec,
        ModelCapabilities,
        ModelInfo,
        ModelRunnerOutput,
        SchedulerOutput,
        SchedulerStats,
        WorkerMemory,
    )
    from baton.request import Request
    from baton.routing.types import EngineLoad, RouteRequest
    from baton.sampling_params import StructuredOutputSpec
    from baton.sched.victims import VictimCandidate

Frame = bytes | bytearray | memoryview


# --------------------------------------------------------------------------- scheduler policy


@runtime_checkable
class SchedulerPolicy(Protocol):
    """Orders the waiting queue, admits, and picks preemption victims.

    The scheduler mechanism (token budget, KV allocation, chunked prefill,
    preemption by recompute, stop checks) calls these; a policy never touches
    blocks or token counts. Requests waiting for a grammar are kept out of the
    policy until they are ready. Every method must be cheap: peek/pop run for
    each admitted request, ``select_victim`` on each preemption.

    Optional: ``finished(request)`` (see ``FinishAwarePolicy``), called once
    when a request the policy was given finishes. A policy without it is
    never told (the kernel's default does nothing).

    A request carries what its sender said about it in ``request.scheduling``
    (a ``baton.scheduling_info.SchedulingInfo``: priority, deadline, tenant,
    tags) and ``request.deadline_time`` (its deadline on the clock ``peek``
    gets, or None).
    """

    def add(self, request: Request) -> None:
        """A request becomes schedulable: new, or back after preemption (status PREEMPTED)."""

    def peek(self, now: float) -> Request | None:
        """The request to admit next, or None to admit nothing more this step.

        ``now`` is the scheduler's clock (``time.monotonic`` in an engine, a
        simulated clock in ``baton bench scheduler``), comparable with
        ``Request.arrival_time``. Returning None while requests wait is
        admission control; the mechanism stops admitting for this step.
        """

    def pop(self, request: Request) -> None:
        """Remove ``request``, the one ``peek`` just returned: it was admitted."""

    def remove(self, request_ids: set[str]) -> list[Request]:
        """Remove waiting requests by id (aborts); return those that were here."""

    def select_victim(self, running: Sequence[Request]) -> Request:
        """Choose which running request to preempt when KV blocks run out.

        ``running`` is never empty and in admission order. It holds the running
        requests that are not in flight: a request in a SchedulerOutput whose
        result is not applied yet is never a candidate. The requester (the
        running request that needs a block) is a candidate: choosing it makes it
        yield, and no later running request is scheduled this step. A request
        scheduled earlier in the same step is a candidate too; choosing it takes
        its tokens for the step back. With ``scheduler.reserve_full_prompt`` (the
        default) the requester is always decoding, since a request computing its
        prompt already holds all the prompt's blocks. The victim's blocks are
        freed and it comes back through ``add`` with status PREEMPTED. Return a
        member of ``running``; any other request fails the step (RuntimeError).
        """

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests, in the order the policy would admit them."""


@runtime_checkable
class FinishAwarePolicy(Protocol):
    """The optional event of a ``SchedulerPolicy``: implement it to learn when requests finish."""

    def finished(self, request: Request) -> None:
        """``request`` finished: stopped, length-capped, aborted or failed (``request.status``).

        Called exactly once for each request the policy was given through ``add``
        (a request aborted while its grammar compiled never was), after it left
        the policy (an aborted waiting request was ``remove``d first) and after
        its last output was produced. ``request`` is read-only here as everywhere;
        ``request.num_computed_tokens`` and ``num_output_tokens`` say how far it got.
        An exception raised here fails the engine (a policy bug), not the request.
        """


@runtime_checkable
class VictimAwarePolicy(Protocol):
    """The optional data-rich victim choice of a ``SchedulerPolicy``."""

    def choose_victim(self, candidates: Sequence[VictimCandidate], now: float) -> Request:
        """Choose which running request to preempt, given what each would cost.

        Called instead of ``select_victim`` when the policy has it, with one
        ``baton.sched.victims.VictimCandidate`` per candidate ``select_victim`` would
        get (same requests, same order): the tokens it computed (what recomputing it
        redoes), the KV blocks it holds, its output tokens and ``max_tokens``, and
        whether it is the requester. ``now`` is the scheduler's clock. Return one of
        the candidates' requests.
        """


# --------------------------------------------------------------------------- speculator


@runtime_checkable
class Speculator(Protocol):
    """Proposes draft tokens for a running request; the model verifies them in one step.

    The kernel (``baton.speculative.drafting``) asks for drafts when a request is
    about to decode, schedules them with its next token, verifies them in the
    same forward pass and keeps the longest prefix the model would have produced
    itself (greedy: the argmax; sampling: the token drawn at that position), plus
    the model's own next token. A proposal is taken as certain (a point
    distribution), so accepting exactly the drafts that equal the model's draw
    keeps the output distribution: speculation never changes what is generated,
    only how many tokens a step yields.

    Methods run in the engine process, once per request per step at most; keep
    them cheap (a step of a 135M model on a CPU takes ~15 ms). ``request`` is
    read-only (``baton.request.Request``: ``all_token_ids`` is the prompt and
    the output so far).
    """

    def propose(self, request: Request, max_tokens: int) -> Sequence[int]:
        """Up to ``max_tokens`` (>= 1) tokens likely to follow ``request.all_token_ids``;
        empty when there is no good guess (the request then decodes one token)."""

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """The model kept ``num_accepted`` of the ``num_proposed`` tokens last proposed for
        ``request`` (they are now part of ``request.all_token_ids``)."""

    def finished(self, request: Request) -> None:
        """``request`` finished (stopped, capped, aborted or failed); forget it. Called once
        for each request that was ever passed to ``propose``."""


# --------------------------------------------------------------------------- router


@runtime_checkable
class Router(Protocol):
    """Picks the engine core for each request when several serve one frontend
    (``executor.data_parallel_size > 1``).

    Runs in the frontend's client (the asyncio frontend's thread), once per request
    as it is sent; keep it cheap. ``engines`` lists every engine with its load at
    that moment (``baton.routing.EngineLoad``: requests in flight from the client's
    own count, the rest from each engine's latest scheduler stats).

    Optional: ``close()``, called once when the client shuts down (a router that holds a
    thread or sockets releases them there).
    """

    def route(self, request: RouteRequest, engines: Sequence[EngineLoad]) -> int:
        """The ``engine_index`` of one of ``engines`` (never empty) to serve ``request``."""

    def finished(self, request_id: str, engine_index: int) -> None:
        """A request routed to ``engine_index`` finished (completed, aborted or failed)."""


# --------------------------------------------------------------------------- executor


@runtime_checkable
class Executor(Protocol):
    """Runs the model for the engine core. One per engine; may own worker processes.

    Life: factory -> ``get_kv_cache_specs`` and ``determine_available_memory``
    (the core sizes the cache) -> ``initialize_kv_cache`` -> ``execute_model``
    each step -> ``shutdown``.

    Optional: ``sleep(level)`` / ``wake_up()`` (see ``Sleepable``); without them the
    engine's ``sleep`` utility is refused with an ExecutorError naming the executor.
    ``collective_rpc`` reaches each worker, a ``Worker`` (``memory_usage`` answers the
    engine's ``get_memory_usage``).
    """

    #: > 1 makes the core use step_with_batch_queue (pipeline parallel).
    max_concurrent_batches: int
    #: The loaded model's limits (vocabulary, EOS ids, max_model_len, dtype), read once the
    #: workers loaded it; None for an executor that loads no model (the core then reads the
    #: model folder).
    model_info: ModelInfo | None
    #: What the loaded model allows (chunked prefill, prefix caching); None: no restriction.
    #: The core turns off a setting the model does not support, logging the reason.
    model_capabilities: ModelCapabilities | None

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per worker: the KV bytes per block for that worker's layers and heads."""

    def determine_available_memory(self) -> list[int]:
        """Bytes each worker can give to the KV cache (same order as the specs)."""

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        """Allocate ``config.num_blocks`` blocks on every worker and warm up."""

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput | None] | None:
        """Run one step's forward pass and sample.

        Returns None (or a future of None) when ``scheduler_output.structured_output_req_ids``
        is non-empty: the logits then wait for ``sample_tokens``. With
        ``non_block=True`` returns a Future at once, so the core can compute the
        grammar bitmask while the forward runs.
        """

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Sample the step whose execute_model returned None, applying the bitmask."""

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call ``method`` on every worker (a ``Worker``): a name, ``worker.<method>(*args,
        **kwargs)``, or a callable, ``method(worker, *args, **kwargs)``; one result per worker,
        in rank order. A target that raises fails this call alone (a ``BatonError`` naming the
        worker: ``baton.errors.worker_error``); the executor stays healthy. ``timeout``
        seconds unanswered raise ExecutorError, the executor stays healthy too."""

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """``callback(error)`` runs (once, from any thread) when a worker dies or the executor fails."""

    def check_health(self) -> None:
        """Raise ExecutorError if a worker is dead or hung."""

    def shutdown(self) -> None:
        """Stop workers and free resources; idempotent."""


# --------------------------------------------------------------------------- model runner


@runtime_checkable
class ModelRunner(Protocol):
    """Runs the model on one device for one worker; an executor's workers call it.

    Life: made by a ``RunnerFactory`` -> ``load_model`` -> ``get_kv_cache_spec`` and
    ``determine_available_memory`` -> ``initialize_kv_cache`` -> ``execute_model``
    (+ ``sample_tokens``) each step. The runner keeps each request's state between
    steps from the SchedulerOutputs alone (new, cached, finished, preempted requests).
    baton's own is ``baton.runner.StockRunner()``; hooks change it for parallel ranks.

    Optional: ``sleep(level)`` / ``wake_up()`` (see ``Sleepable``); the stock runner has them.
    """

    #: The loaded model's limits; set by ``load_model``.
    model_info: ModelInfo

    def load_model(self) -> None:
        """Load the weights onto the device (the runner's part of them)."""

    def get_model_capabilities(self) -> ModelCapabilities:
        """What the loaded model allows (chunked prefill, prefix caching)."""

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """The KV bytes per block this runner needs: its own layers and heads."""

    def determine_available_memory(self) -> int:
        """Bytes this runner can give to the KV cache."""

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        """Allocate ``config.num_blocks`` blocks and warm up."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply the step's changes, run the forward and sample; None when
        ``structured_output_req_ids`` is set (sampling then waits for ``sample_tokens``).
        Requests that fail alone are reported in ``ModelRunnerOutput.failed``."""

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the step whose ``execute_model`` returned None, applying the bitmask."""


@runtime_checkable
class Worker(Protocol):
    """The worker-side contract: what the engine calls on each of an executor's workers.

    The engine reaches a worker only through its executor's ``collective_rpc``, which gets
    either a method name, called as ``worker.<name>(*args, **kwargs)``, or a callable, called
    as ``fn(worker, *args, **kwargs)``: ``baton.rpc.run_worker_rpc`` (``LLM.collective_rpc``:
    the methods on ``baton.rpc.WORKER_RPC_METHODS`` and registered functions, which read
    ``worker.model_runner``). An executor whose worker loop is its own hands every call this
    object (``baton.runner.load_worker`` makes baton's, around any runner factory); the
    stock executors' workers are baton's.

    Optional, each reached by an engine utility call of the same name (a worker without it
    fails that call alone): ``start_profile()`` / ``stop_profile() -> str`` (the trace's
    path), ``save_sharded_state(path, pattern, max_size) -> list[str]``, ``add_lora(request)
    -> bool`` / ``remove_lora(lora_id) -> bool`` / ``list_loras() -> list[int]``, and
    ``sleep(level)`` / ``wake_up()`` / ``can_sleep() -> bool`` when the executor passes the
    engine's ``sleep`` on (``Sleepable``).
    """

    #: The runner this worker drives (``ModelRunner``); None before it is made.
    model_runner: ModelRunner | None

    def memory_usage(self) -> WorkerMemory:
        """This worker's memory, measured in its process (the engine's ``get_memory_usage``)."""

    def get_model_info(self) -> ModelInfo:
        """The loaded model's limits: the runner's ``model_info``."""

    def get_model_capabilities(self) -> ModelCapabilities:
        """What the loaded model allows: the runner's ``get_model_capabilities()``."""

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """The KV bytes per block this worker's runner needs."""


@runtime_checkable
class Sleepable(Protocol):
    """The optional methods of an ``Executor`` or a ``ModelRunner`` that free memory on demand
    (the engine's ``sleep`` / ``wake_up`` utility calls, vLLM's sleep mode).

    The engine calls ``sleep`` only with no request in flight and after forgetting its prefix
    cache, and refuses requests until ``wake_up`` returns. An executor passes the calls to
    every worker's runner (the stock executors do, through ``baton.worker.worker.Worker``).
    """

    def sleep(self, level: int) -> None:
        """Free the KV cache's storage (level 1: keep the weights, in host memory when they were
        on a GPU); level 2 frees the weights too. ``level`` is 1 or 2."""

    def wake_up(self) -> None:
        """Bring back what ``sleep`` freed: the weights (after level 2: loaded from the model
        folder, prepared as at start) and an empty KV cache of the same size; greedy outputs
        are then those before the sleep. A no-op when awake."""


@runtime_checkable
class RunnerFactory(Protocol):
    """Makes a worker's runner, in the worker process: ``factory(config, device)``.

    A ``ModelRunner`` class taking ``(config, device)`` is one; so is
    ``baton.runner.StockRunner(hooks)``. Executors with worker processes pickle it:
    define it at module level.
    """

    def __call__(self, config: BatonConfig, device: torch.device) -> ModelRunner: ...


# --------------------------------------------------------------------------- transport


@runtime_checkable
class ClientChannel(Protocol):
    """The frontend's end: sends to engines, receives from all of them."""

    #: Picklable; handed to the engine process for ``Transport.connect_engine``.
    address: Any

    def send(self, frames: Sequence[Frame], engine_index: int = 0) -> None:
        """Queue a multipart message (one frame or more) for one engine. Never blocks indefinitely.

        Raises TransportError when that engine is gone or the link stays full, ValueError for an
        ``engine_index`` out of range. Buffers may leave after ``send`` returns (zero-copy):
        do not change them afterwards.
        """

    def recv(self, timeout: float | None = None) -> list[Frame] | None:
        """The next multipart message from any engine, or None after ``timeout`` seconds.

        Frames arrive as sent (bytes-like; never decoded). Once an engine exited or closed its
        end, what it sent before is delivered, then recv raises TransportError; it also raises
        when the channel is closed, including by ``close()`` from another thread while blocked.
        """

    def close(self) -> None:
        """Release sockets / segments; idempotent, from any thread, also after the peer died."""


@runtime_checkable
class EngineChannel(Protocol):
    """The engine's end: receives the frontend's messages, sends outputs."""

    def recv(self, timeout: float | None = None) -> list[Frame] | None:
        """The next message from the frontend, or None after ``timeout`` seconds;
        TransportError once the frontend exited or closed its end."""

    def send(self, frames: Sequence[Frame]) -> None:
        """Queue an output message; TransportError if the frontend is gone (buffers: as above)."""

    def close(self) -> None:
        """Release; idempotent, safe from any thread. Messages already sent are still delivered."""


@runtime_checkable
class Transport(Protocol):
    """Makes the two ends of a frontend <-> engine link.

    A multiprocess transport object must pickle: the testing kit hands it to a spawned process.
    """

    #: False: the engine runs in the frontend's process (inproc); no process is spawned.
    multiprocess: bool

    def create_client(self, num_engines: int = 1) -> ClientChannel:
        """Bind the frontend's end (in the frontend process) before engines start."""

    def connect_engine(self, address: Any, engine_index: int = 0) -> EngineChannel:
        """Connect an engine's end (in the engine process) to ``address``."""


# --------------------------------------------------------------------------- engine launcher


@runtime_checkable
class EngineHandle(Protocol):
    """One engine core a launcher started: the life-cycle calls the frontend's client makes."""

    def is_alive(self) -> bool:
        """False once the engine has stopped, crashed or been killed (cheap: polled every
        0.25 s by the client's output thread)."""

    def terminate(self) -> None:
        """Ask the engine to shut down as SIGTERM does (drain or abort mode, then exit);
        returns at once. A no-op when it has stopped."""

    def kill(self) -> None:
        """Stop the engine now, without its shutdown; returns at once. Idempotent."""

    def join(self, timeout: float | None = None) -> None:
        """Wait until the engine has stopped, at most ``timeout`` seconds (None: no limit)."""

    def describe(self) -> str:
        """Where the engine runs, for messages: ``pid 123``, ``Ray actor ... on node ...``;
        once it stopped, with how (``exited with code 1``) where that is known."""


@runtime_checkable
class EngineLauncher(Protocol):
    """Starts the frontend's engine cores somewhere: local processes (``mp``), Ray actors, ...

    Made once per frontend client in the frontend's process; ``launch`` is called once per
    engine, ``close`` once after the client has joined (or killed) every engine it started.
    """

    def launch(
        self,
        config: BatonConfig,
        address: Any,
        engine_index: int,
        fingerprint: list[tuple[str, str, str, str]],
    ) -> EngineHandle:
        """Start ``baton.engine.launch.run_engine_core(config, address, engine_index,
        fingerprint)`` (engine ``engine_index`` connects to the transport's ``address`` and
        answers READY through it) and return its handle without waiting for READY. Raise a
        ``BatonError`` (ConfigError for a setting that cannot work) when it cannot start."""

    def close(self) -> None:
        """Release what the launcher holds (actors, placement groups, a Ray instance it
        started); idempotent. The engines are stopped already."""


# --------------------------------------------------------------------------- structured output


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over all of ``token_ids`` and return True, or return False and stay where it was
        (no token of the call accepted) if one of them is not allowed."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, bit set = allowed; token t is
        bit ``t % 32`` of word ``t // 32``), touching no other row. Tokens past the tokenizer's
        vocabulary are never allowed; once the output is complete, only EOS is."""

    def is_terminated(self) -> bool:
        """The grammar accepted a complete output (the request finishes with reason stop)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""


class StructuredOutputBackend(Protocol):
    """Compiles specs and makes matchers for one tokenizer and vocabulary size."""

    def compile(self, spec: StructuredOutputSpec) -> Any:
        """Compile a spec; runs on a thread pool, must be thread-safe. Raises StructuredOutputError."""

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of the compiled grammar."""

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A reusable int32 bitmask of shape [num_rows, ceil(vocab_size / 32)], all allowed."""


# --------------------------------------------------------------------------- stat loggers


class StatLogger(Protocol):
    """Observes engine stats in the frontend process."""

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        """Called for every batch of engine outputs; must be cheap."""

    def log(self) -> None:
        """Called every ``observability.log_stats_interval`` seconds."""
