"""Clients for an engine core behind a transport: a process per engine (or a thread, for inproc).

The transport plugin supplies the channel; the engine launcher that
``executor.data_parallel_backend`` names starts the engines (``mp``: local processes;
``baton.engine.launch``); everything here is transport- and launcher-agnostic.
One background thread per client receives outputs, resolves utility calls and
watches the engines: a dead engine (ENGINE_CORE_DEAD, or its process or actor gone
without one) turns every pending and later call into EngineDeadError.
Resources are released by weakref.finalize, even after a half-finished start.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec

from baton.config import BatonConfig
from baton.engine.client import EngineCoreClient
from baton.engine.core_main import run_engine_core
from baton.engine.core_proc import READY
from baton.engine.launch import make_launcher
from baton.engine.utility_methods import UTILITY_METHODS
from baton.errors import (
    BatonError,
    EngineDeadError,
    InvalidRequestError,
    ProtocolError,
    error_from_message,
)
from baton.interfaces import ClientChannel, EngineLauncher, Transport
from baton.plugins.resolve import ResolvedPlugins
from baton.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    ModelInfo,
    RequestType,
    UtilityRequest,
)
from baton.serial import MsgpackDecoder, MsgpackEncoder

log = logging.getLogger(__name__)

#: How often the output thread checks that every engine is alive.
LIVENESS_INTERVAL_S = 0.25
STARTUP_TIMEOUT_S = 900.0


@dataclass
class _Resources:
    """Everything a client must release; closed by weakref.finalize or shutdown()."""

    channel: ClientChannel | None = None
    #: an EngineHandle per engine (a launcher started it), or a threading.Thread (inproc)
    procs: list[Any] = field(default_factory=list)
    launcher: EngineLauncher | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    closing: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None
    shutdown_timeout: float = 0.0

    def close(self) -> None:
        self.closing.set()
        self.stop_event.set()  # in-thread engines
        deadline = time.monotonic() + max(5.0, self.shutdown_timeout + 2.0)
        engines = [p for p in self.procs if not isinstance(p, threading.Thread)]
        for p in engines:
            p.terminate()  # as SIGTERM: the engine shuts down (drain or abort mode)
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in engines:
            if p.is_alive():
                log.warning("engine (%s) did not exit in time; killing it", p.describe())
                p.kill()
                p.join(timeout=5)
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(timeout=2)
        try:
            if self.channel is not None:
                self.channel.close()
        finally:
            launcher, self.launcher = self.launcher, None
            if launcher is not None:
                launcher.close()


class MPClient(EngineCoreClient):
    """Start engines, handshake, then deliver their outputs through ``_deliver``."""

    def __init__(
        self,
        config: BatonConfig,
        plugins: ResolvedPlugins,
        transport: Transport,
        *,
        num_engines: int = 1,
    ) -> None:
        self.config = config
        self.plugins = plugins
        self.num_engines = num_engines
        self.resources = _Resources(shutdown_timeout=config.serving.shutdown_timeout)
        self._finalizer = weakref.finalize(self, self.resources.close)
        self.dead_error: EngineDeadError | None = None
        self._encoder = MsgpackEncoder()
        self._send_lock = threading.Lock()
        self._call_ids = itertools.count()
        self._pending: dict[int, Future[Any]] = {}
        #: engines known dead (their death already handled)
        self._gone: set[int] = set()
        try:
            self._start(config, transport)
        except BaseException:
            self._finalizer()
            raise

    # ------------------------------------------------------------------ start-up

    def _start(self, config: BatonConfig, transport: Transport) -> None:
        res = self.resources
        if transport.multiprocess or config.executor.data_parallel_backend != "mp":
            # before the channel binds: a launcher may refuse the config (and any launcher but
            # mp refuses a transport whose engines run on threads of this process)
            res.launcher = make_launcher(config, transport, self.plugins)
        channel = res.channel = transport.create_client(self.num_engines)
        fingerprint = self.plugins.registry.fingerprint()
        for i in range(self.num_engines):
            if res.launcher is not None:
                p: Any = res.launcher.launch(
                    self._engine_config(i), channel.address, i, fingerprint
                )
            else:
                p = threading.Thread(
                    target=run_engine_core,
                    kwargs=dict(
                        config=self._engine_config(i),
                        address=channel.address,
                        engine_index=i,
                        in_thread=True,
                        shutdown_event=res.stop_event,
                    ),
                    name=f"baton-engine-{i}",
                    daemon=True,
                )
                p.start()
            res.procs.append(p)
        self.ready = self._wait_ready(channel)
        self.info: ModelInfo = self.ready[0].info
        res.reader = threading.Thread(
            target=self._output_loop, name="baton-client-output", daemon=True
        )
        res.reader.start()

    def _engine_config(self, index: int) -> BatonConfig:
        """The config engine ``index`` starts with (a data-parallel client sets its rank)."""
        return self.config

    def _wait_ready(self, channel: ClientChannel) -> list[EngineReady]:
        decoder = MsgpackDecoder(EngineReady)
        ready: dict[int, EngineReady] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < self.num_engines:
            frames = channel.recv(timeout=0.1)
            if frames is None:
                dead = self._dead_engine()
                if dead:
                    raise EngineDeadError(f"the engine failed to start: {dead}")
                if time.monotonic() > deadline:
                    raise EngineDeadError(
                        f"the engine did not report READY within {STARTUP_TIMEOUT_S:.0f} s"
                    )
                continue
            head = bytes(frames[0])
            if head == ENGINE_CORE_DEAD:
                raise EngineDeadError(_dead_message(frames))
            if head == READY:
                r = decoder.decode(frames[1:])
                ready[r.engine_index] = r
        return [ready[i] for i in range(self.num_engines)]

    def _dead_engine(self) -> str | None:
        for i, p in enumerate(self.resources.procs):
            if not p.is_alive():
                return f"engine {i} ({_where(p)}) exited"
        return None

    # ------------------------------------------------------------------ output thread

    def _output_loop(self) -> None:
        res = self.resources
        decoder = MsgpackDecoder(EngineCoreOutputs)
        next_check = time.monotonic() + LIVENESS_INTERVAL_S
        assert res.channel is not None
        while not res.closing.is_set():
            try:
                frames = res.channel.recv(timeout=0.1)
            except BatonError as e:
                if res.closing.is_set() or not self._transport_failed(e):
                    return
                continue
            now = time.monotonic()
            if frames is None or now >= next_check:
                next_check = now + LIVENESS_INTERVAL_S
                if not res.closing.is_set() and not self._check_engines():
                    return
            if frames is None:
                continue
            if len(frames[0]) == len(ENGINE_CORE_DEAD) and bytes(frames[0]) == ENGINE_CORE_DEAD:
                index = _dead_index(frames)
                if index is not None:
                    self._gone.add(index)
                if not self._engine_died(index, _dead_message(frames)):
                    return
                continue
            try:
                outputs = decoder.decode(frames)
            except ProtocolError as e:
                log.error("dropped a malformed output message: %s", e)
                continue
            if outputs.utility_output is not None:
                u = outputs.utility_output
                fut = self._pending.pop(u.call_id, None)
                if fut is not None:
                    if u.failure_message is None:
                        fut.set_result(_typed_result(fut, u.result))
                    else:
                        fut.set_exception(error_from_message(u.failure_message))
            if (
                outputs.outputs
                or outputs.scheduler_stats is not None
                or outputs.wave_complete is not None
                or outputs.start_wave is not None
            ):
                self._deliver(outputs)

    def _check_engines(self) -> bool:
        """Notice engines whose process or thread ended without a word; False when the whole
        client is dead (the output thread stops)."""
        for i, p in enumerate(self.resources.procs):
            if i in self._gone or p.is_alive():
                continue
            self._gone.add(i)
            message = f"engine {i} ({_where(p)}) exited"
            if not self._engine_died(i, f"{message} without notice"):
                return False
        return True

    def _transport_failed(self, error: BaseException) -> bool:
        """The channel's recv raised (an engine exited, or the channel broke); True when the
        client goes on (a data-parallel client that lost one engine may)."""
        self._mark_dead(f"the transport failed: {error}")
        return False

    def _engine_died(self, index: int | None, message: str) -> bool:
        """Engine ``index`` (None: unknown) died; True when the client goes on without it.
        One engine's death is the client's: a data-parallel client may say otherwise."""
        self._mark_dead(message)
        return False

    def _mark_dead(self, message: str) -> None:
        err = EngineDeadError(f"the engine core died: {message}")
        log.error("%s", err)
        self.dead_error = err
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._deliver(err)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ requests

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def _send(self, rtype: RequestType, payload: Any, engine_index: int = 0) -> None:
        self._check_alive()
        frames = [rtype.value, *self._encoder.encode(payload)]
        channel = self.resources.channel
        assert channel is not None
        with self._send_lock:
            try:
                channel.send(frames, engine_index)
            except BatonError as e:
                raise EngineDeadError(f"could not reach the engine: {e}") from e

    def engine_for(self, request_id: str) -> int:
        return 0

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(RequestType.ADD, request, self.engine_for(request.request_id))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_error is None:
            by_engine: dict[int, list[str]] = {}
            for rid in request_ids:
                by_engine.setdefault(self.engine_for(rid), []).append(rid)
            for idx, ids in by_engine.items():
                self._send(RequestType.ABORT, ids, idx)

    def _utility_future(
        self, method: str, args: tuple[Any, ...], engine_index: int = 0
    ) -> Future[Any]:
        self._check_alive()
        call_id = next(self._call_ids)
        fut: Future[Any] = Future()
        fut.result_type = UTILITY_METHODS.get(method)  # type: ignore[attr-defined]
        self._pending[call_id] = fut
        try:
            self._send(
                RequestType.UTILITY,
                UtilityRequest(call_id=call_id, method=method, args=list(args)),
                engine_index,
            )
        except BaseException:
            self._pending.pop(call_id, None)
            raise
        if self.dead_error is not None and not fut.done():  # died between the check and the send
            fut.set_exception(self.dead_error)
        return fut

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._utility_future(method, args).result()

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(MPClient):
    """Blocking face: get_output() waits on a queue the output thread fills."""

    def __init__(self, config: BatonConfig, plugins: ResolvedPlugins, transport: Transport) -> None:
        self._outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        super().__init__(config, plugins, transport)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self._outputs.put(item)

    def get_output(self) -> EngineCoreOutputs:
        while True:
            self._check_alive()
            try:
                item = self._outputs.get(timeout=1.0)
            except queue.Empty:
                continue
            if isinstance(item, EngineDeadError):
                self._outputs.put(item)  # every later call raises too
                raise item
            return item


class AsyncMPClient(MPClient):
    """asyncio face: outputs land in an asyncio.Queue of the loop that created the client."""

    def __init__(
        self, *args: Any, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any
    ) -> None:
        """``MPClient``'s arguments; ``loop``: where outputs are delivered (the running one)."""
        self._loop = loop or asyncio.get_running_loop()
        self._outputs_async: asyncio.Queue[EngineCoreOutputs | EngineDeadError] = asyncio.Queue()
        super().__init__(*args, **kwargs)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        # a RuntimeError means the loop is closed: nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._outputs_async.put_nowait, item)

    def get_output(self) -> EngineCoreOutputs:
        raise InvalidRequestError("AsyncMPClient is asynchronous: await get_output_async()")

    async def get_output_async(self) -> EngineCoreOutputs:
        self._check_alive()
        item = await self._outputs_async.get()
        if isinstance(item, EngineDeadError):
            self._outputs_async.put_nowait(item)
            raise item
        return item

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self._utility_future(method, args))


def _where(engine: Any) -> str:
    """Where an engine ran, for messages: its handle's words, or "thread" (inproc)."""
    return "thread" if isinstance(engine, threading.Thread) else str(engine.describe())


def _typed_result(fut: Future[Any], result: Any) -> Any:
    """Utility results travel as plain msgpack; rebuild the method's declared type."""
    type_ = getattr(fut, "result_type", None)
    return result if type_ is None or result is None else msgspec.convert(result, type_)


def _dead_message(frames: list[Any]) -> str:
    return bytes(frames[1]).decode(errors="replace") if len(frames) > 1 else "no reason given"


def _dead_index(frames: list[Any]) -> int | None:
    """The engine a DEAD message names (its third frame), if it names one."""
    try:
        return int(bytes(frames[2])) if len(frames) > 2 else None
    except ValueError:
        return None
