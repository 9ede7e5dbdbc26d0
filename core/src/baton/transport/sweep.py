"""Removing what killed frontends left behind.

Transports unlink their files early (as soon as every engine has attached), so
only a frontend killed during start-up (SIGKILL, or SIGTERM, which skips
``atexit``) leaves any. Each new client sweeps the files whose owner process
is gone. Names carry the creator's pid: ``baton_<pid>_...`` or
``baton_<kind>_<pid>_...``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil

from baton.transport.peer import pid_running

log = logging.getLogger(__name__)

_NAME = re.compile(r"^baton_(?:[a-z]+_)?(\d+)_")


def sweep_stale(folder: str, prefix: str) -> list[str]:
    """Remove our user's entries in ``folder`` starting with ``prefix`` whose creator is dead."""
    removed = []
    uid = os.getuid()
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except FileNotFoundError:
        return removed
    for name in names:
        match = _NAME.match(name)
        path = os.path.join(folder, name)
        with contextlib.suppress(FileNotFoundError):  # another sweeper got there first
            if not match or os.lstat(path).st_uid != uid or pid_running(int(match.group(1))):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed.append(path)
    if removed:
        log.info("removed %d files of dead baton frontends: %s", len(removed), removed[:5])
    return removed
