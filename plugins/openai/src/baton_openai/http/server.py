"""Running the server: the port, then the engine, then uvicorn; exit code 1 when the engine dies.

The address is bound before the model loads, so a busy port fails in a moment
with a message naming it (BindError), not after a long load.

Shutdown on SIGTERM/SIGINT: uvicorn stops accepting connections and waits for
in-flight responses (streams included) until ``server.shutdown_timeout``
seconds after the signal; then it cancels what is left, whose requests are
aborted in the engine, and the engine stops (it has nothing left to drain).
The whole shutdown takes that timeout plus about a second. An engine death
makes every waiting request a 503 and stops the server, so a supervisor sees a
non-zero exit instead of a process that hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from baton import AsyncLLM
from baton.config import BatonConfig
from baton.errors import ConfigError, InvalidRequestError
from baton.lora.adapter import read_adapter_config
from baton_openai.endpoints.lora import load_into_engine
from baton_openai.http.address import bind_sockets, is_loopback
from baton_openai.http.app import build_app, build_routes
from baton_openai.http.connection import protocol_class
from baton_openai.parsing.registry import ParserRegistry
from baton_openai.templates.chat_template import load_chat_template

log = logging.getLogger("baton_openai")

#: Drain time on SIGTERM when the config does not set server.shutdown_timeout.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
#: After the drain: how long cancelled requests get to abort in the engine before it stops.
CANCEL_GRACE_S = 1.0
#: Idle keep-alive connections close after this long (also a new connection that sends nothing).
KEEP_ALIVE_S = 5


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
    """uvicorn without re-raising the caught signal after a graceful shutdown (so a drain exits 0),
    and whose drain ends ``shutdown_timeout`` seconds after the exit request, not after the signal
    plus uvicorn's own timeout plus the engine's."""

    def __init__(
        self, config: uvicorn.Config, on_started: Callable[[], None], shutdown_timeout: float
    ) -> None:
        super().__init__(config)
        self._on_started = on_started
        self.shutdown_timeout = shutdown_timeout
        self.exit_requested_at: float | None = None

    def request_exit(self) -> None:
        if self.exit_requested_at is None:
            self.exit_requested_at = time.monotonic()
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.exit_requested_at is None:
            self.exit_requested_at = time.monotonic()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        began = self.exit_requested_at or time.monotonic()
        # uvicorn's wait (connections, then tasks) gets what is left of the budget: its own 0.1 s
        # pause and the tick that noticed should_exit are part of it
        left = self.shutdown_timeout - (time.monotonic() - began) - 0.1
        self.config.timeout_graceful_shutdown = max(0.0, left)  # type: ignore[assignment]
        await super().shutdown(sockets=sockets)
        # the tasks uvicorn cancelled: let them close their streams (an abort in the engine each),
        # so that the engine has nothing left to drain when it stops
        tasks = list(self.server_state.tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_GRACE_S)

    def install_signal_handlers(self) -> None:  # older uvicorn
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)

    def capture_signals(self) -> Any:  # newer uvicorn: same, without the re-raise
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


def check_lora_modules(config: BatonConfig) -> None:
    """server.lora_modules' folders hold adapters the engine accepts (ConfigError naming one)."""
    name = config.server.served_model_name or config.model.name
    for lora_name, path in config.server.lora_modules.items():
        if lora_name == name:
            raise ConfigError(f"server.lora_modules: {lora_name!r} is the served model's name")
        try:
            read_adapter_config(path, config.lora.max_lora_rank)
        except InvalidRequestError as e:
            raise ConfigError(f"server.lora_modules {lora_name!r}: {e}") from None


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
        """Bind, start the engine, serve until shutdown (or engine death), stop; the exit code.

        ``sock``: an already bound socket to serve on instead of server.host:server.port.
        BindError when the address cannot be bound (before the model loads).
        """
        self.loop = asyncio.get_running_loop()
        srv = self.config.server
        parsers = ParserRegistry.load()
        parsers.check(srv.tool_call_parser, srv.reasoning_parser)  # before the model loads
        load_chat_template(srv.chat_template)  # a missing file is refused before it loads too
        check_lora_modules(self.config)  # a bad adapter folder too
        sockets = [sock] if sock is not None else bind_sockets(srv.host, srv.port)
        if srv.api_key is None and not is_loopback(srv.host):
            log.warning(
                "baton serve: listening on %s, which other machines can reach, without an API "
                "key: anyone who reaches it can use the model; set --api-key / server.api_key "
                "(or bind 127.0.0.1 behind a proxy that authenticates)",
                srv.host,
            )
        try:
            self.engine = engine = await AsyncLLM.create(config=self.config)
        except BaseException:
            if sock is None:
                for s in sockets:
                    s.close()
            raise
        watcher: asyncio.Task[None] | None = None
        app = None
        try:
            app = build_app(engine, self.config, parsers)
            await build_routes(app)
            await self._load_loras(app.state.baton)
            # The model, torch and the app are ~500k objects that live as long as the server;
            # a full garbage collection walks them all (0.3 s here, the event loop stopped),
            # triggered by any request that allocates many objects. Frozen, they are skipped.
            gc.collect()
            gc.freeze()
            uv_config = uvicorn.Config(
                app,
                host=srv.host,
                port=srv.port,
                http=protocol_class(srv.header_timeout),
                log_config=None,
                access_log=self.access_log,
                lifespan="off",
                timeout_keep_alive=KEEP_ALIVE_S,
            )
            self.uvicorn = _Uvicorn(uv_config, self._on_started, srv.shutdown_timeout)
            watcher = asyncio.ensure_future(self._watch_engine(engine))
            async with app.router.lifespan_context(app):  # the batch worker (uvicorn's is off)
                await self.uvicorn.serve(sockets=sockets)
        finally:
            if watcher is not None:
                watcher.cancel()
            gc.unfreeze()  # the objects of a server run in-process (tests) can be collected again
            if app is not None:
                try:
                    await app.state.baton.preprocess.aclose()
                except Exception:  # the engine must still stop; say what was left behind
                    log.exception("stopping the preprocessing workers failed")
            engine.shutdown()
        return 1 if self.engine_died or engine.errored else 0

    async def _load_loras(self, ctx: Any) -> None:
        """server.lora_modules' adapters read by the engine before the first request (one
        engine; a bad one stops the start-up here)."""
        if ctx.loras is None:
            return
        for lora in ctx.loras.by_name.values():
            await load_into_engine(ctx, lora)
            log.info("LoRA adapter %r served from %s", lora.lora_name, lora.lora_path)

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
        url = f"http://{host}:{port}"
        chat = f"{url}/ (chat playground), " if self.config.server.playground else ""
        log.info("baton serve: open %s%s/dashboard (engine dashboard)", chat, url)
        self.started.set()

    async def _watch_engine(self, engine: AsyncLLM) -> None:
        error = await engine.wait_until_dead()
        self.engine_died = True
        log.error("the engine died (%s): stopping the server", error)
        self.request_exit()

    def request_exit(self) -> None:
        """Begin a graceful shutdown (thread-safe: uvicorn polls the flag)."""
        if self.uvicorn is not None:
            self.uvicorn.request_exit()

    @property
    def url(self) -> str:
        assert self.address is not None, "the server has not started"
        return f"http://{self.address[0]}:{self.address[1]}"
