"""How baton starts its own processes (engine cores, executor workers).

On Linux a forkserver does the heavy imports (torch, transformers, baton's engine
and worker modules) once per parent process; every process baton starts after
that is forked from it and starts in a fraction of a second instead of importing
them again (3-6 s each on a 2-core machine). Where there is no forkserver, or
with ``BATON_START_METHOD=spawn``, each process is spawned (a fresh interpreter).

A forked process gets the environment its parent has when it starts it (the
forkserver's own was fixed when it started), as a spawned one would. The
forkserver lives, idle, as long as the parent: process-tree checks should leave
it out, as they leave out multiprocessing's resource tracker (``is_helper``). A
process started so has the forkserver as its parent: to notice that the process
which started it is gone, watch for a change of ``os.getppid()`` (the forkserver
exits with its owner) or for the owner's pid (``alive``).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from multiprocessing.context import BaseContext
from typing import Any

from baton.errors import ConfigError

#: Environment variable choosing how baton starts processes: forkserver or spawn.
START_METHOD_ENV = "BATON_START_METHOD"
PR_SET_NAME = 15
#: Imported once in the forkserver.
PRELOAD = (
    "torch",
    "transformers",
    "baton.engine.core_proc",
    "baton.executor.worker_proc",
    "baton.worker.model_runner",
)


def start_method() -> str:
    """``BATON_START_METHOD`` if set, else forkserver where the platform has it, else spawn."""
    method = os.environ.get(START_METHOD_ENV, "").strip()
    if not method:
        return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method not in ("forkserver", "spawn"):
        raise ConfigError(f"{START_METHOD_ENV}={method!r}: use forkserver or spawn")
    return method


def context() -> BaseContext:
    """The multiprocessing context baton starts its processes with."""
    method = start_method()
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # type: ignore[attr-defined]
    return ctx


def start(
    target: Callable[..., None], args: Sequence[Any], name: str, daemon: bool | None = None
) -> Any:
    """Start ``target(*args)`` (both pickled: define ``target`` at module level) in a new
    process with this process's current environment; the started ``Process``.

    ConfigError when called while a child process imports the parent's main module (a
    script that starts baton's processes without ``if __name__ == "__main__":``)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise ConfigError(
            f"baton cannot start {name!r} while this process is importing its parent's main "
            "module: the script starts baton's processes (an executor's workers, an engine "
            'process) at import; put its code under `if __name__ == "__main__":`'
        )
    p = context().Process(
        target=_run, args=(name, dict(os.environ), target, tuple(args)), name=name, daemon=daemon
    )
    p.start()
    return p


def _run(
    name: str, env: dict[str, str], target: Callable[..., None], args: tuple[Any, ...]
) -> None:
    if os.environ != env:  # forked from a forkserver started earlier, with other variables
        os.environ.clear()
        os.environ.update(env)
    set_process_name(name)
    target(*args)


def set_process_name(name: str) -> None:
    """Name this process as ``ps``, ``top`` and psutil's ``name()`` show it (Linux: the first
    15 bytes); elsewhere nothing. A forked process otherwise shows its forkserver's name."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: keep the inherited name
        pass


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts: its parent has not reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process by that pid
        return True
    return True


def is_helper(proc: Any) -> bool:
    """Whether a process (a ``psutil.Process``) is multiprocessing's resource tracker or
    forkserver: processes that outlive the ones baton starts, for the parent's lifetime.
    Processes forked from a forkserver keep its command line; baton names its own ``baton-*``."""
    line = " ".join(proc.cmdline())
    if "resource_tracker" in line:
        return True
    return "forkserver" in line and not proc.name().startswith("baton")
