"""Fault injection for tests: kill a process at a known point of a run, not after a timer."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def kill_on_first_output(client: Any, pid: int, sig: int = signal.SIGKILL) -> list[float]:
    """Send ``sig`` to ``pid`` as soon as the sync ``client.get_output()`` first returns.

    A timer races a fast machine (the run may end before it fires); the first output
    proves the run is under way. Returns a list that receives the ``time.monotonic()``
    of the kill, so a test can bound how long the failure took to surface.
    """
    killed_at: list[float] = []
    get_output = client.get_output

    def get_output_then_kill() -> Any:
        out = get_output()
        if not killed_at:
            os.kill(pid, sig)
            killed_at.append(time.monotonic())
        return out

    client.get_output = get_output_then_kill
    return killed_at
