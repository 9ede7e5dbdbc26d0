"""The engine-core actor: one data-parallel engine core inside a Ray actor.

A threaded actor (a few concurrent calls): ``start`` runs
``baton.engine.launch.run_engine_core`` on a thread of its own, in its thread
mode (no signal handlers, no process exit; setting the actor's stop event is
the graceful shutdown, as SIGTERM is for a local engine process); ``wait``
returns when the engine has stopped, so the launcher's handle sees the engine
alive while that call is pending, and dead when it returns or when Ray reports
the actor dead (killed, its process crashed, its node gone). The engine talks
to the frontend only through the transport (zmq), as a local engine does.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from typing import Any

import ray

from baton.engine.launch import run_engine_core
from baton.transport.peer import machine_id
from baton_ray.cluster import prepare_actor

log = logging.getLogger(__name__)

#: Imported by an engine actor as soon as it exists (each takes seconds on a small machine).
PRELOAD = ("torch", "transformers", "baton.engine.core_proc")


@ray.remote(max_concurrency=4)
class EngineActor:
    """One engine core (see the module docstring). ``env`` is applied before torch loads."""

    def __init__(self, env: dict[str, str], nice: int | None = 0) -> None:
        self._preload = prepare_actor(env, nice, "engine", PRELOAD)
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def where(self) -> tuple[int, str, str]:
        """(pid, node address, machine id) of this actor's process."""
        return os.getpid(), ray.util.get_node_ip_address(), machine_id()

    def start(
        self,
        config: Any,
        address: Any,
        engine_index: int,
        fingerprint: list[tuple[str, str, str, str]],
    ) -> None:
        """Start the engine core on a thread; returns at once (it answers READY through the
        transport)."""
        if self._thread is not None:
            raise RuntimeError("this engine actor runs an engine already")
        logging.basicConfig(
            level=config.observability.log_level,
            format=f"%(asctime)s %(levelname)s engine{engine_index} %(name)s: %(message)s",
        )
        self._thread = threading.Thread(
            target=self._run,
            args=(config, address, engine_index, fingerprint),
            name=f"baton-engine-{engine_index}",
            daemon=True,
        )
        self._thread.start()

    def _run(
        self, config: Any, address: Any, index: int, fingerprint: list[tuple[str, str, str, str]]
    ) -> None:
        self._preload.join()  # its imports first: not the same modules from two threads at once
        try:
            run_engine_core(
                config, address, index, fingerprint, in_thread=True, shutdown_event=self._stop
            )
        except BaseException as e:  # run_engine_core reports its own failures; this is a bug
            self._error = f"{type(e).__name__}: {e}"
            log.error("engine %d: %s", index, "".join(traceback.format_exception(e)))
        finally:
            self._done.set()

    def wait(self) -> str | None:
        """Block until the engine has stopped; None, or what broke its thread."""
        self._done.wait()
        return self._error

    def ping(self) -> None:
        """The heartbeat: answered on a thread of its own while the engine steps."""
        return None

    def stop(self) -> None:
        """The graceful shutdown (drain or abort mode, as SIGTERM for a local engine)."""
        self._stop.set()
