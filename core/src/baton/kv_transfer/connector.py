"""The protocols a ``kv_connector`` plugin implements: a scheduler half and a worker half.

The seam follows vLLM's ``KVConnectorBase_V1`` (the two halves it found necessary), in baton's
terms. The factory registered by ``register_kv_connectors`` returns a ``KVConnector``; the kernel
asks it for its scheduler half once per engine core (engine process) and for its worker half once
per worker (each worker process). The halves talk only through the kernel: the scheduler half's
``build_connector_meta`` bytes travel to every worker in ``SchedulerOutput.kv_connector_metadata``;
each worker half's ``KVConnectorOutput`` travels back in ``ModelRunnerOutput.kv_connector``.

A request's path through a connector:

1. admission: after the engine's own prefix-cache lookup (``num_computed_tokens`` tokens, whole
   blocks), ``get_num_new_matched_tokens`` says how many more the connector can supply;
2. the kernel allocates blocks for the request and calls ``update_state_after_alloc``;
3. a synchronous load runs in the step that first computes the request, before its layers run;
   an asynchronous one (the request waits, holding its blocks, computing nothing) until a worker
   reports it in ``finished_loading``: the tokens loaded then count as computed, a shortfall
   (a missing or corrupt block) is recomputed;
4. every step, ``build_connector_meta`` gets the full blocks the step completes (``KVStep``),
   which the worker half may save after the forward (the kernel never overwrites a block before
   the next step starts, so a copy made in ``finish_step`` is consistent);
5. ``request_finished`` when the request ends; it may hold the request's blocks until a worker
   reports them in ``finished_saving``.

Containment: a half that raises inside a call about one request fails that request (finish
reason ``error``), not the engine; a worker half reports such failures in
``KVConnectorOutput.failed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

from baton.kv_transfer.types import KVConnectorOutput, KVNamespace, KVRole, KVTransferStats

if TYPE_CHECKING:
    import torch

    from baton.kv.events import KVCacheEvent
    from baton.protocol import KVCacheSpec
    from baton.request import Request


class KVBlockRef(msgspec.Struct, frozen=True, array_like=True):
    """One block of a request: its id in the engine's pool and its hash (the key across tiers)."""

    block_id: int
    block_hash: bytes


class KVStep(msgspec.Struct, kw_only=True):
    """What the kernel tells the scheduler half about a step it just scheduled."""

    step_id: int
    #: request id -> the full blocks this step's forward completes, in order (positions holding
    #: speculative draft tokens excluded: their KV may be rejected).
    new_full_blocks: dict[str, list[KVBlockRef]] = msgspec.field(default_factory=dict)
    #: requests that finished or were preempted since the last step (their blocks may be reused
    #: from the next step on).
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    preempted_req_ids: list[str] = msgspec.field(default_factory=list)


class KVSchedulerContext(msgspec.Struct, kw_only=True):
    """What the scheduler half is made with (engine process)."""

    role: KVRole
    namespace: KVNamespace
    num_blocks: int  # the engine's pool, the null block included
    engine_index: int = 0  # data-parallel rank


class KVWorkerContext(msgspec.Struct, kw_only=True):
    """What a worker half is made with (worker process)."""

    role: KVRole
    namespace: KVNamespace
    #: this worker's shard: its tensor-parallel rank and its pipeline stage (first layer held)
    tp_rank: int = 0
    pp_rank: int = 0
    first_layer: int = 0


@runtime_checkable
class KVConnectorScheduler(Protocol):
    """The scheduler half: decides what is loaded and saved. Runs in the engine process, inside
    the step loop; keep each call cheap (no blocking I/O beyond a metadata lookup)."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens the connector can supply after the request's first ``num_computed_tokens``
        (the engine's own prefix hits, whole blocks): a multiple of the block size that never
        reaches the request's last token; and whether they load asynchronously. ``(0, False)``:
        nothing. Called once per admission attempt (again if the request had to wait)."""

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """The request's blocks are allocated (``block_ids``: its whole table). The
        ``num_external_tokens`` after its computed tokens (``request.num_computed_tokens``:
        the engine's own hits, as ``get_num_new_matched_tokens`` was told) are to be loaded (0:
        load nothing). Record the load for the next ``build_connector_meta``."""

    def build_connector_meta(self, step: KVStep) -> bytes:
        """Once per step, after scheduling: the worker halves' orders for this step (the loads
        recorded, the blocks to save), encoded for the worker half's ``start_step``."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The workers' merged report for a step, before the kernel acts on it."""

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request`` ended (stopped, capped, aborted, failed). Returns whether to hold its
        blocks until a worker reports the request in ``finished_saving``, and the
        ``kv_transfer_params`` to return to the client (None: none), e.g. where a consumer
        engine finds the KV of a prefill this producer computed."""

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since last asked (blocks the connector's tiers stored or dropped)."""

    def take_stats(self) -> KVTransferStats | None:
        """Figures since last asked (``SchedulerStats.kv_transfer``)."""

    def shutdown(self) -> None:
        """The engine stops; idempotent."""


@runtime_checkable
class KVConnectorWorker(Protocol):
    """The worker half: moves KV between the worker's cache and the connector's tiers. Runs in
    each worker process, in the step's thread, around the forward."""

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], spec: KVCacheSpec) -> None:
        """The runner's KV cache, after it is allocated (again after ``wake_up``): one tensor
        per layer this worker holds, shaped ``[2 (K, V), num_blocks, num_kv_heads, block_size,
        head_size]``; block ``i`` of a layer is ``kv_caches[layer][:, i]``."""

    def start_step(self, metadata: bytes) -> None:
        """Before the step's forward: the scheduler half's orders for this step. Synchronous
        loads are done when this returns; asynchronous ones may run on in the background."""

    def finish_step(self) -> KVConnectorOutput | None:
        """After the forward: save what the step's orders ask (copy it out before returning:
        the next step may overwrite the blocks), and report finished loads and saves. None:
        nothing to report."""

    def shutdown(self) -> None:
        """The worker stops: finish or drop pending transfers; idempotent."""


@runtime_checkable
class KVConnector(Protocol):
    """What a ``kv_connector`` factory returns: a maker of its two halves."""

    def scheduler_side(self, context: KVSchedulerContext) -> KVConnectorScheduler:
        """The scheduler half, once per engine core (engine process)."""

    def worker_side(self, context: KVWorkerContext) -> KVConnectorWorker:
        """The worker half, once per worker (worker process)."""


__all__ = [
    "KVBlockRef",
    "KVConnector",
    "KVConnectorOutput",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVSchedulerContext",
    "KVStep",
    "KVTransferStats",
    "KVWorkerContext",
]
