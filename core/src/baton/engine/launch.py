"""Where engine cores run: the engine launchers, chosen by ``executor.data_parallel_backend``.

A frontend client whose transport crosses processes asks the launcher its config names
(a plugin kind, ``register_engine_launchers``) to start each engine core: ``mp`` (built in)
starts a local process (``baton.processes``: forkserver or spawn); baton-plugin-ray's
``ray`` starts a Ray actor. Either way the engine runs ``run_engine_core`` and talks to the
frontend through the transport only; the client watches it through its ``EngineHandle``.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from baton import processes
from baton.errors import ConfigError, PluginError
from baton.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from baton.config import BatonConfig
    from baton.interfaces import EngineLauncher, Transport
    from baton.plugins.resolve import ResolvedPlugins


class ProcessHandle:
    """An engine core in a local process (``EngineHandle``)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def terminate(self) -> None:
        if self.process.is_alive():
            self.process.terminate()  # SIGTERM: the engine shuts down (drain or abort mode)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    def describe(self) -> str:
        code = self.process.exitcode
        return f"pid {self.process.pid}" + (f", exit code {code}" if code is not None else "")


class ProcessLauncher:
    """``mp``: each engine core in a process of this machine (``EngineLauncher``)."""

    def launch(
        self,
        config: BatonConfig,
        address: Any,
        engine_index: int,
        fingerprint: list[tuple[str, str, str, str]],
    ) -> ProcessHandle:
        return self.start(
            run_engine_core, (config, address, engine_index, fingerprint), engine_index
        )

    def start(
        self, target: Callable[..., None], args: Sequence[Any], engine_index: int
    ) -> ProcessHandle:
        """``target(*args)`` in a local process named for engine ``engine_index`` (forkserver or
        spawn: ``target`` at module level); its handle. For a launcher whose process does
        something around ``run_engine_core``."""
        return ProcessHandle(
            processes.start(target, tuple(args), name=f"baton-engine-{engine_index}")
        )

    def close(self) -> None:
        return None


def create_process_launcher(config: BatonConfig, settings: Any) -> ProcessLauncher:
    """The ``mp`` launcher's registered factory."""
    return ProcessLauncher()


def make_launcher(
    config: BatonConfig, transport: Transport, plugins: ResolvedPlugins
) -> EngineLauncher:
    """The launcher ``executor.data_parallel_backend`` names, for engines behind ``transport``.

    Only ``mp`` may start engines for a transport whose engines live in the frontend's
    process (``multiprocess`` False); the caller runs those on threads itself.
    """
    name = config.executor.data_parallel_backend
    if name != "mp" and not transport.multiprocess:
        raise ConfigError(
            f"executor.data_parallel_backend={name!r} starts engine cores outside this process, "
            f"but transport.name={config.transport.name!r} keeps them in it: use a transport "
            "that crosses processes (transport.name = 'zmq') or data_parallel_backend = 'mp'"
        )
    try:
        launcher: EngineLauncher = plugins.one("engine_launcher").create(config)
    except PluginError as e:
        if isinstance(e.__cause__, ConfigError):  # the launcher refused the config: keep its type
            raise ConfigError(str(e)) from e.__cause__
        raise
    return launcher


def run_engine_core(
    config: BatonConfig,
    address: Any,
    engine_index: int = 0,
    parent_fingerprint: list[tuple[str, str, str, str]] | None = None,
    in_thread: bool = False,
    shutdown_event: Any = None,
) -> None:
    """An engine core's life, for a launcher to run where it placed the engine: connect to
    the transport's ``address``, check the plugin set against ``parent_fingerprint``, build
    the core, answer READY, serve until shutdown.

    In a process of its own (``in_thread`` False) it configures logging, turns SIGTERM and
    SIGINT into a graceful shutdown and ends the process when done. With ``in_thread`` (a
    thread of a process that lives on, e.g. an actor's) it does none of that: setting the
    ``threading.Event`` ``shutdown_event`` is the graceful shutdown, and it returns when the
    engine has stopped (a failure to start included, after ENGINE_CORE_DEAD went out).
    """
    # the engine's modules (torch) load in the engine's process, not when the plugins load
    from baton.engine.core_main import run_engine_core as run

    run(config, address, engine_index, parent_fingerprint, in_thread, shutdown_event)


@hookimpl
def register_engine_launchers(register: Any) -> None:
    register("mp", create_process_launcher)


__all__ = ["ProcessHandle", "ProcessLauncher", "make_launcher", "run_engine_core"]
