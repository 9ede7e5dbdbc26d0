"""A worker's half of the KV connector (``[kv_transfer]``), around its model runner's steps.

``Worker.start_kv_connector`` builds it once the runner's KV cache exists; it registers the
cache (again after ``wake_up``), and each step calls the half's ``start_step`` with the
scheduler half's orders before the forward and ``finish_step`` right after it (before the
sampling that may wait for a grammar bitmask: the forward wrote the KV already). Its report
rides on the step's ``ModelRunnerOutput.kv_connector``.

With several workers each rank's report is gathered to the driver after every step and merged
there (``gather``, set by ``baton.executor.kv_connector``), the only report that goes back.

Containment: a half whose ``start_step`` or ``finish_step`` raises fails that step's requests
with connector work (the report's ``step_error``), not the worker; a half that fails one
request reports it in ``KVConnectorOutput.failed`` itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from baton.errors import ExecutorError
from baton.protocol import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from baton.worker.containment import describe

if TYPE_CHECKING:
    from baton.kv_transfer.connector import KVConnectorWorker

log = logging.getLogger(__name__)


class WorkerKVConnector:
    """One worker's connector half and the report of its latest step."""

    def __init__(self, half: KVConnectorWorker, name: str) -> None:
        self.half = half
        self.name = name
        #: The report of a step whose sampling waits for ``sample_tokens``.
        self._pending: KVConnectorOutput | None = None
        self._started = False
        self._error: str | None = None
        #: With several workers (set by the executor's side): every rank calls it with its
        #: report after each step; the driver gets the merged report back, the others None.
        self.gather: Callable[[KVConnectorOutput | None], KVConnectorOutput | None] | None = None

    def register(self, runner: Any) -> None:
        """Hand the half the runner's KV cache: one ``[2, num_blocks, kv_heads, block_size,
        head_size]`` tensor per layer this worker holds."""
        caches = getattr(runner, "kv_caches", None)
        if not caches or any(c is None for c in caches):
            raise ExecutorError(
                f"KV connector {self.name!r} needs the runner's KV cache as one tensor per "
                f"layer (runner.kv_caches); {type(runner).__name__} has none: use baton's "
                "stock runner or set kv_transfer.connector = 'none'"
            )
        self.half.register_kv_caches(list(caches), runner.get_kv_cache_spec())

    def start(self, so: SchedulerOutput) -> None:
        """Before the step's forward: its orders (none when the scheduler half failed to make
        them; the scheduler then fails the requests they were about)."""
        self._error = None
        self._started = so.kv_connector_metadata is not None
        if not self._started:
            return
        try:
            self.half.start_step(so.kv_connector_metadata)  # type: ignore[arg-type]
        except Exception as e:  # the step's requests with connector work fail, not the worker
            self._fail("start_step", e)

    def finish(self) -> KVConnectorOutput | None:
        """After the step's forward: the half's report (kept for ``attach``)."""
        report: KVConnectorOutput | None = None
        if self._started and self._error is None:
            try:
                report = self.half.finish_step()
            except Exception as e:
                self._fail("finish_step", e)
        if self._error is not None:
            report = report or KVConnectorOutput()
            report.step_error = self._error
        if self.gather is not None:  # every rank's report, merged on the driver
            report = self.gather(report)
        self._pending = report
        return report

    def attach(self, out: ModelRunnerOutput | None) -> ModelRunnerOutput | None:
        """The step's output with the half's report (None: sampling still pending)."""
        if out is not None:
            out.kv_connector, self._pending = self._pending, None
        return out

    def _fail(self, what: str, error: Exception) -> None:
        self._error = f"{what} raised {describe(error)}"
        log.warning("KV connector %r: %s", self.name, self._error)
        log.debug("KV connector %r: traceback", self.name, exc_info=error)

    def shutdown(self) -> None:
        try:
            self.half.shutdown()
        except Exception as e:  # the worker stops anyway; say why the half could not
            log.warning("KV connector %r: shutdown raised %s", self.name, describe(e))
