"""Built-in connector ``pd``: prefill on one engine, decode on another, on one machine.

A producer engine (``[kv_transfer] role = "producer"``) computes a prompt for a request whose
``kv_transfer_params`` say ``do_remote_decode`` and saves its full blocks into a hand-off store
in a folder both engines share (``[kv_transfer.pd] path``, /dev/shm by default); its response's
``kv_transfer_params`` name the hand-off. A consumer engine (``role = "consumer"``) given those
params loads the blocks instead of computing them and decodes. ``baton pd-proxy`` runs the
flow for OpenAI clients (docs/kv-connectors.md).
"""

from __future__ import annotations

from baton.kv_transfer.connector import KVSchedulerContext, KVWorkerContext
from baton.kv_transfer.pd.scheduler import PDScheduler
from baton.kv_transfer.pd.settings import PDSettings
from baton.kv_transfer.pd.worker import PDWorker


class PDConnector:
    """The ``pd`` connector: makes its scheduler and worker halves."""

    def __init__(self, settings: PDSettings | None = None) -> None:
        self.settings = settings or PDSettings()

    def scheduler_side(self, context: KVSchedulerContext) -> PDScheduler:
        return PDScheduler(context, self.settings)

    def worker_side(self, context: KVWorkerContext) -> PDWorker:
        return PDWorker(context, self.settings)


__all__ = ["PDConnector", "PDScheduler", "PDSettings", "PDWorker"]
