"""run_engine_core: an engine core's life in its process (or thread): connect to the
transport, check the plugin set, build the core, pick its loop (``EngineCoreProc``, or
``DPEngineCoreProc`` when its experts are shared with the other engines), serve until shutdown.
Launchers reach it through ``baton.engine.launch.run_engine_core``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.engine.core_proc import EngineCoreProc
from baton.engine.dp_core_proc import DPEngineCoreProc
from baton.errors import BatonError
from baton.parallel.expert import expert_parallel_size
from baton.plugins.registry import ChosenPlugin, get_registry
from baton.plugins.resolve import resolve_plugins
from baton.process_exit import exit_now
from baton.protocol import ENGINE_CORE_DEAD

# the engine process's logger, as before this module was cut from baton.engine.core_proc
log = logging.getLogger("baton.engine.core_proc")


def run_engine_core(
    config: BatonConfig,
    address: Any,
    engine_index: int = 0,
    parent_fingerprint: list[tuple[str, str, str, str]] | None = None,
    in_thread: bool = False,
    shutdown_event: threading.Event | None = None,
) -> None:
    """Entry point of an engine process (or thread): connect, build the core, serve."""
    if not in_thread:
        logging.basicConfig(
            level=config.observability.log_level,
            format=f"%(asctime)s %(levelname)s engine{engine_index} %(name)s: %(message)s",
        )
    registry = get_registry()  # plugins load in every process the kernel spawns
    # the transport first, alone: what fails after it (another plugin set, a plugin missing
    # here) is reported to the frontend through it; the rest are resolved with it, once
    entry = registry.get("transport", config.transport.name)
    transport_plugin = ChosenPlugin(entry, entry.settings(config))
    channel = transport_plugin.create(config).connect_engine(address, engine_index)
    try:
        if (
            parent_fingerprint is not None
            and [tuple(x) for x in parent_fingerprint] != registry.fingerprint()
        ):
            ours, theirs = set(registry.fingerprint()), {tuple(x) for x in parent_fingerprint}
            raise BatonError(
                "the engine process sees other plugins than the frontend: only in frontend "
                f"{sorted(theirs - ours)}, only in engine {sorted(ours - theirs)}; install the same "
                "plugins in one environment"
            )
        plugins = resolve_plugins(config, registry, given=(transport_plugin,))
        core = EngineCore(config, plugins=plugins, engine_index=engine_index)
        try:
            proc = _proc_class(core)(core, channel, engine_index, shutdown_event)
        except BaseException:
            core.shutdown()
            raise
    except BaseException as e:
        log.error("engine %d failed to start: %s", engine_index, e)
        channel.send(
            [ENGINE_CORE_DEAD, f"engine failed to start: {type(e).__name__}: {e}".encode()]
        )
        time.sleep(0.1)  # let the frame leave before the channel closes
        channel.close()
        if in_thread:
            return
        raise SystemExit(1) from e
    if not in_thread:
        signal.signal(signal.SIGTERM, proc.request_shutdown)
        signal.signal(signal.SIGINT, proc.request_shutdown)
    code = 0
    try:
        proc.run()
    except BaseException:
        code = 1
    if not in_thread:  # the loop has stopped and the channel is closed
        exit_now(code)


def _proc_class(core: EngineCore) -> type[EngineCoreProc]:
    """The loop this engine needs: waves when its experts are shared with the other engines."""
    if expert_parallel_size(core.config.executor, core.config.model) > 1:
        return DPEngineCoreProc
    return EngineCoreProc
