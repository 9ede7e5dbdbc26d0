"""Starting the configured KV connector (``[kv_transfer]``) in an engine: its namespace built
once from the loaded model, its scheduler half given to the scheduler, its worker halves started
on every worker (``baton.executor.kv_connector``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from baton.errors import ConfigError
from baton.executor.kv_connector import start_worker_half
from baton.kv_transfer.connector import KVSchedulerContext
from baton.kv_transfer.namespace import build_namespace, model_identity
from baton.kv_transfer.types import KVNamespace
from baton.model.loader import model_folder

if TYPE_CHECKING:
    from baton.engine.core import EngineCore

log = logging.getLogger(__name__)

#: Longest wait of reset_prefix_cache / sleep on an idle engine for the KV connector's reports.
KV_SETTLE_S = 5.0


def start_kv_connector(core: EngineCore) -> KVNamespace | None:
    """Start the connector ``core``'s config selects (after its KV cache and its scheduler
    exist); its namespace, or None when the config selects none."""
    chosen = core.plugins.find("kv_connector")
    if chosen is None:
        return None
    config = core.config
    name, role = chosen.name, config.kv_transfer.role
    if core.batch_queue_size > 1:
        raise ConfigError(
            f"kv_transfer.connector={name!r} with executor {config.executor.backend!r}, which "
            f"keeps {core.batch_queue_size} batches in flight (pipeline parallel): not supported "
            "yet (a load must land before the batch that reads it is sent). Use "
            "kv_transfer.connector = 'none' or an executor without a batch queue"
        )
    ex, m = config.executor, config.model
    variant = f"dtype={core.info.dtype or m.dtype};quantization={m.quantization};rev={m.revision}"
    namespace = build_namespace(
        model_identity(model_folder(config.model), variant),
        core.executor.get_kv_cache_specs(),
        ex.tensor_parallel_size,
        ex.pipeline_parallel_size,
    )
    connector = chosen.create(config)
    half = connector.scheduler_side(
        KVSchedulerContext(
            role=role,
            namespace=namespace,
            num_blocks=core.num_blocks,
            engine_index=core.engine_index,
        )
    )
    core.scheduler.use_kv_connector(half, name, role)
    core.executor.collective_rpc(start_worker_half, (namespace, role))
    log.info("KV connector %r (role %s), namespace %s", name, role, namespace.key)
    return namespace


def settle_kv_transfers(core: EngineCore) -> None:
    """With no request left, step ``core`` until the KV connector's workers reported what it
    waits for (blocks held for saves, aborted loads): an idle engine's blocks are then all free
    (an in-process engine is not stepped between calls). At most KV_SETTLE_S seconds."""
    scheduler = core.scheduler
    deadline = time.monotonic() + KV_SETTLE_S
    while (
        scheduler.has_kv_transfers()
        and not scheduler.has_unfinished_requests()
        and time.monotonic() < deadline
    ):
        core.step_fn()
