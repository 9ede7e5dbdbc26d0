"""The ``pd`` connector: the factory the plugin registry calls, and its registration."""

from __future__ import annotations

from typing import Any

from baton.kv_transfer.connector import KVSchedulerContext, KVWorkerContext
from baton.kv_transfer.pd.scheduler import PDScheduler
from baton.kv_transfer.pd.settings import PDSettings
from baton.kv_transfer.pd.worker import PDWorker
from baton.plugins.hookspecs import hookimpl


class PDConnector:
    """``factory(config, settings)``: makes the pd connector's two halves."""

    def __init__(self, config: Any = None, settings: PDSettings | None = None) -> None:
        self.settings = settings or PDSettings()

    def scheduler_side(self, context: KVSchedulerContext) -> PDScheduler:
        return PDScheduler(context, self.settings)

    def worker_side(self, context: KVWorkerContext) -> PDWorker:
        return PDWorker(context, self.settings)


@hookimpl
def register_kv_connectors(register) -> None:  # type: ignore[no-untyped-def]
    register("pd", PDConnector, PDSettings)
