"""What a test left behind: transport files of a process, open descriptors."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile


def leftover_files(pid: int) -> list[str]:
    """Transport files of process ``pid`` in /dev/shm and the temp dir."""
    pattern = re.compile(rf"^baton_([a-z0-9]+_)?{pid}_")
    found = []
    for folder in ("/dev/shm", tempfile.gettempdir()):
        with contextlib.suppress(FileNotFoundError):
            found += [os.path.join(folder, n) for n in os.listdir(folder) if pattern.match(n)]
    return sorted(found)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))
