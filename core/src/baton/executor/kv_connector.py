"""The KV connector's worker halves, started on every rank of whatever executor runs them.

``start_worker_half`` is a ``collective_rpc`` target: each rank builds its half with its own
shard (tensor-parallel rank, pipeline stage and the stage's first layer) from its parallel
context; a worker without one (the uniproc executor) is rank 0 of a group of one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.errors import ExecutorError
from baton.kv_transfer.connector import KVWorkerContext
from baton.parallel.context import get_parallel_context
from baton.parallel.stages import layer_ranges

if TYPE_CHECKING:
    from baton.kv_transfer.types import KVNamespace, KVRole
    from baton.worker.worker import Worker


def start_worker_half(worker: Worker, namespace: KVNamespace, role: KVRole) -> None:
    """collective_rpc target: this rank's half of the configured KV connector."""
    try:
        ctx = get_parallel_context()
    except ExecutorError:  # no parallel context: the one worker of the uniproc executor
        tp_rank = pp_rank = first_layer = 0
    else:
        tp_rank, pp_rank = ctx.tp_rank, ctx.pp_rank
        first_layer = layer_ranges(namespace.num_layers, ctx.pp_size)[pp_rank][0]
    worker.start_kv_connector(
        KVWorkerContext(
            role=role,
            namespace=namespace,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            first_layer=first_layer,
        )
    )
