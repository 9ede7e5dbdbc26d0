"""The ``offload`` connector: the factory the plugin registry calls, and its registration."""

from __future__ import annotations

from typing import Any

from baton.kv_transfer.connector import KVSchedulerContext, KVWorkerContext
from baton.kv_transfer.offload.scheduler_half import OffloadScheduler
from baton.kv_transfer.offload.settings import OffloadSettings
from baton.kv_transfer.offload.worker_half import OffloadWorker
from baton.plugins.hookspecs import hookimpl


class OffloadConnector:
    """``factory(config, settings)``: makes the offload connector's two halves."""

    def __init__(self, config: Any = None, settings: OffloadSettings | None = None) -> None:
        self.settings = settings or OffloadSettings()

    def scheduler_side(self, context: KVSchedulerContext) -> OffloadScheduler:
        return OffloadScheduler(context, self.settings)

    def worker_side(self, context: KVWorkerContext) -> OffloadWorker:
        return OffloadWorker(context, self.settings)


@hookimpl
def register_kv_connectors(register) -> None:  # type: ignore[no-untyped-def]
    register("offload", OffloadConnector, OffloadSettings)
