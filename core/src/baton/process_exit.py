"""Ending a process that baton started (an engine or a worker) once it has closed everything."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.util
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush the logs and standard streams, then end the process without the interpreter's teardown.

    The teardown walks every object torch and the model made (~1.5-2 s a process on 2 cores) and
    lets extension modules report objects still alive at exit (nanobind's "leaked" lists from
    triton's bindings); the process has closed its channel and joined its children by now, and
    its memory goes back to the OS either way. Only for processes baton spawned: never a user's.
    """
    # What multiprocessing runs when a child's target returns: its finalizers (semaphores that
    # tqdm's lock registered with the resource tracker, ...) and its own children.
    exit_function = getattr(multiprocessing.util, "_exit_function", None)
    if exit_function is not None:
        exit_function()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing more to write
            stream.flush()
    os._exit(code)
