"""The KV connector's worker halves, started on every rank of whatever executor runs them.

``start_worker_half`` is a ``collective_rpc`` target: each rank builds its half with its own
shard (tensor-parallel rank, pipeline stage and the stage's first layer) from its parallel
context; a worker without one (the uniproc executor) is rank 0 of a group of one. In a group
of several ranks, each step's reports meet on the driver (``GatherReports``: an all-gather over
the group, merged by ``KVOutputMerger``), the rank whose output the executor returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.errors import ExecutorError
from baton.kv_transfer.connector import KVWorkerContext
from baton.kv_transfer.merge import KVOutputMerger
from baton.parallel.context import ParallelContext, get_parallel_context
from baton.parallel.stages import layer_ranges
from baton.protocol import KVConnectorOutput

if TYPE_CHECKING:
    from baton.kv_transfer.types import KVNamespace, KVRole
    from baton.worker.worker import Worker


class GatherReports:
    """Every rank's report of a step, all-gathered over the group; merged on the driver."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.merger = KVOutputMerger(ctx.world_size)

    def __call__(self, report: KVConnectorOutput | None) -> KVConnectorOutput | None:
        import torch.distributed as dist  # torch: this module is imported by the engine too

        reports: list[KVConnectorOutput | None] = [None] * self.ctx.world_size
        dist.all_gather_object(reports, report)
        return self.merger.merge(reports) if self.ctx.is_driver else None


def start_worker_half(worker: Worker, namespace: KVNamespace, role: KVRole) -> None:
    """collective_rpc target: this rank's half of the configured KV connector."""
    ctx: ParallelContext | None
    try:
        ctx = get_parallel_context()
    except ExecutorError:  # no parallel context: the one worker of the uniproc executor
        ctx = None
    tp_rank = ctx.tp_rank if ctx else 0
    pp_rank = ctx.pp_rank if ctx else 0
    first_layer = layer_ranges(namespace.num_layers, ctx.pp_size)[pp_rank][0] if ctx else 0
    worker.start_kv_connector(
        KVWorkerContext(
            role=role,
            namespace=namespace,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            first_layer=first_layer,
        )
    )
    if ctx is not None and ctx.world_size > 1 and worker.kv_connector is not None:
        worker.kv_connector.gather = GatherReports(ctx)
