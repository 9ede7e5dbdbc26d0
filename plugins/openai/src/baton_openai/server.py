"""Running the server: engine first, then uvicorn; exit code 1 when the engine dies.

Shutdown on SIGTERM/SIGINT: uvicorn stops accepting connections and waits for
in-flight responses (streams included) for up to ``server.shutdown_timeout``
seconds, then the engine is stopped (in drain mode while that timeout is > 0).
An engine death makes every waiting request a 503 and stops the server, so a
supervisor sees a non-zero exit instead of a process that hangs.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from baton import AsyncLLM
from baton.config import BatonConfig
from baton_openai.app import build_app

log = logging.getLogger("baton_openai")

#: Drain time on SIGTERM when the config does not set server.shutdown_timeout.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def prepare_config(config: BatonConfig) -> BatonConfig:
    """The server's view of the config: the prometheus stat logger on, a drain timeout by default."""
    changes: dict[str, Any] = {}
    loggers = list(config.observability.stat_loggers)
    if "prometheus" not in loggers:
        changes["observability.stat_loggers"] = [*loggers, "prometheus"]
    if "shutdown_timeout" not in config.server.model_fields_set:
        # a server drains its streams unless told otherwise (0 = abort them at once)
        changes["server.shutdown_timeout"] = DEFAULT_SHUTDOWN_TIMEOUT_S
    return config.replace(**changes) if changes else config


class _Uvicorn(uvicorn.Server):
    """uvicorn without re-raising the caught signal after a graceful shutdown (so a drain exits 0)."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    def install_signal_handlers(self) -> None:  # older uvicorn
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)

    def capture_signals(self) -> Any:  # newer uvicorn: same, without the re-raise
        import contextlib

        @contextlib.contextmanager
        def captured() -> Any:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            originals = {
                sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
            }
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

        return captured()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._on_started()


class OpenAIServer:
    """``await OpenAIServer(config).run()`` serves until shutdown and returns the exit code."""

    def __init__(self, config: BatonConfig, *, access_log: bool = False) -> None:
        self.config = prepare_config(config)
        self.access_log = access_log
        self.engine: AsyncLLM | None = None
        self.uvicorn: _Uvicorn | None = None
        self.started = threading.Event()
        self.address: tuple[str, int] | None = None
        self.engine_died = False
        self.loop: asyncio.AbstractEventLoop | None = None

    async def run(self, sock: socket.socket | None = None) -> int:
        """Start the engine, serve until shutdown (or engine death), stop the engine; the exit code."""
        self.loop = asyncio.get_running_loop()
        self.engine = engine = await AsyncLLM.create(config=self.config)
        watcher: asyncio.Task[None] | None = None
        try:
            app = build_app(engine, self.config)
            srv = self.config.server
            timeout = srv.shutdown_timeout
            uv_config = uvicorn.Config(
                app,
                host=srv.host,
                port=srv.port,
                log_config=None,
                access_log=self.access_log,
                timeout_graceful_shutdown=int(timeout)
                if timeout == int(timeout)
                else int(timeout) + 1,
                lifespan="off",
                timeout_keep_alive=5,
            )
            self.uvicorn = _Uvicorn(uv_config, self._on_started)
            watcher = asyncio.ensure_future(self._watch_engine(engine))
            await self.uvicorn.serve(sockets=[sock] if sock is not None else None)
        finally:
            if watcher is not None:
                watcher.cancel()
            engine.shutdown()
        return 1 if self.engine_died or engine.errored else 0

    def _on_started(self) -> None:
        assert self.uvicorn is not None
        sock = self.uvicorn.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        self.address = (host, port)
        log.info(
            "baton serve: listening on http://%s:%d (model %s)",
            host,
            port,
            self.config.server.served_model_name or self.config.model.name,
        )
        self.started.set()

    async def _watch_engine(self, engine: AsyncLLM) -> None:
        error = await engine.wait_until_dead()
        self.engine_died = True
        log.error("the engine died (%s): stopping the server", error)
        self.request_exit()

    def request_exit(self) -> None:
        """Begin a graceful shutdown (thread-safe: uvicorn polls the flag)."""
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    @property
    def url(self) -> str:
        assert self.address is not None, "the server has not started"
        return f"http://{self.address[0]}:{self.address[1]}"
