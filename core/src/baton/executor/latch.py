"""The failure latch of an executor: the first failure is kept, told once, and refuses later calls.

Every executor needs the same three things when a worker dies or a step fails:
remember the first error (later ones are consequences), run the failure
callbacks the engine registered exactly once (also for a callback registered
after the failure), and make every later call raise ``ExecutorError`` naming
the first error. ``FailureLatch`` is that, thread-safe, for any executor.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from baton.errors import ExecutorError

log = logging.getLogger(__name__)

FailureCallback = Callable[[BaseException], None]


class FailureLatch:
    """The first failure of executor ``name`` and its callbacks (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._callbacks: list[FailureCallback] = []
        self._failure: BaseException | None = None
        self._closed = False

    @property
    def failure(self) -> BaseException | None:
        """The first failure, or None while healthy."""
        return self._failure

    @property
    def closed(self) -> bool:
        return self._closed

    def register(self, callback: FailureCallback) -> None:
        """``callback(error)`` runs once on the first failure; at once if the executor failed already."""
        with self._lock:
            failed = self._failure
            if failed is None:
                self._callbacks.append(callback)
        if failed is not None:  # registered after the failure: it still learns of it
            callback(failed)

    def fail(self, error: BaseException) -> bool:
        """Latch ``error`` and run the callbacks; False (nothing done) when failed or closed already."""
        callbacks = self.trip(error)
        if callbacks is None:
            return False
        self.notify(error, callbacks)
        return True

    def trip(self, error: BaseException) -> list[FailureCallback] | None:
        """Latch ``error`` without telling anyone yet (an executor first settles its pending
        calls); the callbacks to give ``notify``, or None when failed or closed already."""
        with self._lock:
            if self._failure is not None or self._closed:
                return None
            self._failure = error
            return list(self._callbacks)

    def notify(self, error: BaseException, callbacks: list[FailureCallback]) -> None:
        """Log the failure and run ``callbacks`` (what ``trip`` returned), each once."""
        log.error("%s executor failed: %s", self.name, error)
        for cb in callbacks:
            try:
                cb(error)
            except Exception:  # one callback's bug must not keep the others from the news
                log.exception("executor failure callback %r raised", cb)

    def close(self) -> bool:
        """Mark the executor shut down; False when it was already. Later failures are not reported."""
        with self._lock:
            was_open, self._closed = not self._closed, True
        return was_open

    def check(self) -> None:
        """Raise ExecutorError when the executor is shut down or failed (chained to the failure)."""
        if self._closed:
            raise ExecutorError(f"the {self.name} executor is shut down")
        if self._failure is not None:
            raise ExecutorError(
                f"the {self.name} executor failed earlier: {self._failure}"
            ) from self._failure
