"""Closing a channel from any thread without pulling memory or sockets from under another."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def release_when_idle(
    locks: list[tuple[threading.Lock, float]], release: Callable[[], None], what: str
) -> bool:
    """Run ``release`` once no thread is inside a send or recv (each lock held for the call).

    The caller has already woken any blocked call (a flag plus a pipe byte); each lock is
    waited for up to its timeout. If one is still held then, a thread is stuck inside the
    transport: releasing under it could crash the process, so nothing is released (the
    finalizer runs at interpreter exit instead) and False is returned.
    """
    held: list[threading.Lock] = []
    try:
        for lock, timeout in locks:
            if not lock.acquire(timeout=timeout):
                log.warning(
                    "%s: a send/recv did not return; its resources go at interpreter exit", what
                )
                return False
            held.append(lock)
        release()
        return True
    finally:
        for lock in held:
            lock.release()
