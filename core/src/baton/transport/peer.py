"""Watching the process at the other end of a channel, without polling it.

A transport that knows its peer's pid wraps it in a ``PeerWatch``: on Linux a
pidfd, which becomes readable the moment the process exits (before it is
reaped), so it can sit in the same ``poll`` set as the channel's data and a
blocked ``recv`` wakes at once when the peer dies. Where pidfds are missing
(old kernels, other systems) ``fileno()`` is None and callers poll ``alive()``
every ``POLL_SLICE`` seconds instead.
"""

from __future__ import annotations

import os
import select
import socket

from baton.errors import TransportError

#: How often a waiter without a pidfd re-checks its peer.
POLL_SLICE = 0.25


class PeerWatch:
    """One peer process: ``alive()``, and a pollable ``fileno()`` where the OS has pidfds."""

    def __init__(self, pid: int, what: str) -> None:
        self.pid = pid
        self.what = what  # "engine 0", "the frontend": used in error messages
        self._fd: int | None = None
        self._dead = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._dead = True
        except (AttributeError, OSError):  # no pidfd_open here: fall back to kill(pid, 0)
            self._fd = None

    def fileno(self) -> int | None:
        """A descriptor that polls readable when the peer exits, or None (poll ``alive()``)."""
        return self._fd

    def alive(self) -> bool:
        if self._dead:
            return False
        if self._fd is not None:
            readable, _, _ = select.select([self._fd], [], [], 0)
            self._dead = bool(readable)
        else:
            self._dead = not pid_running(self.pid)
        return not self._dead

    def error(self, detail: str = "") -> TransportError:
        """The error to raise once the peer is gone."""
        return TransportError(f"{self.what} (pid {self.pid}) exited{detail}")

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
            # Without the fd we can no longer tell; alive() falls back to kill(pid, 0).

    def __repr__(self) -> str:
        return f"PeerWatch({self.what}, pid={self.pid})"


def pid_running(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (a killed child before it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc: kill(pid, 0) is all we know
    # the state follows the parenthesised command name, which may itself contain ") "
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def machine_id() -> str:
    """Which machine (and boot) this process runs on: the host name and Linux's boot id.

    Two processes see each other's pids only when their machine ids are equal; a transport
    whose peer may run on another host (an engine on a Ray node) watches the peer's pid only
    then. Without /proc's boot id, the host name alone.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
