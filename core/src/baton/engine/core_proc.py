"""EngineCoreProc: the engine core behind a transport, in its own process (or thread, for inproc).

Two IO threads bridge the transport's engine channel to two queue.Queue; the
busy loop blocks on the input queue when there is no work, drains every
pending message before each step, and steps. READY is sent only after the
executor and the KV cache are initialised. SIGTERM/SIGINT shut down in drain
mode (``config.serving.shutdown_timeout > 0``, the serving plugin's
``server.shutdown_timeout``: in-flight requests finish) or abort mode (they end
FINISHED_ABORTED); ADD and UTILITY are refused meanwhile. On any fatal error an ENGINE_CORE_DEAD frame goes out before the process exits,
so no client hangs.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from typing import Any

import msgspec

from baton.engine.core import EngineCore
from baton.engine.utility_methods import UTILITY_METHODS
from baton.errors import BatonError, ExecutorError, ProtocolError, TransportError
from baton.interfaces import EngineChannel
from baton.protocol import (
    ENGINE_CORE_DEAD,
    DPWaveStart,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    RequestType,
    UtilityOutput,
    UtilityRequest,
)
from baton.serial import MsgpackDecoder, MsgpackEncoder

log = logging.getLogger(__name__)

READY = b"READY"
_STOP = object()  # output-queue sentinel


class EngineCoreProc:
    """Runs an EngineCore against an engine channel until shutdown."""

    def __init__(
        self,
        core: EngineCore,
        channel: EngineChannel,
        engine_index: int = 0,
        shutdown_event: threading.Event | None = None,
    ) -> None:
        self.core = core
        self.channel = channel
        self.engine_index = engine_index
        self.input_queue: queue.Queue[tuple[RequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.shutdown_requested = shutdown_event or threading.Event()
        #: set by the first shutdown step, after it took in what had arrived: from then on new
        #: requests get EngineShuttingDownError
        self._shutdown_deadline: float | None = None
        self.closing = threading.Event()  # IO threads stop
        self.fatal: BaseException | None = None
        core.executor.register_failure_callback(self._on_executor_failure)
        self._threads = [
            threading.Thread(target=self._input_loop, name="baton-engine-input", daemon=True),
            threading.Thread(target=self._output_loop, name="baton-engine-output", daemon=True),
        ]

    # ------------------------------------------------------------------ IO threads

    def _input_loop(self) -> None:
        decoders = {
            RequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            RequestType.ABORT: MsgpackDecoder(list[str]),
            RequestType.UTILITY: MsgpackDecoder(UtilityRequest),
            RequestType.START_DP_WAVE: MsgpackDecoder(DPWaveStart),
        }
        parent = os.getppid()
        while not self.closing.is_set():
            try:
                frames = self.channel.recv(timeout=0.1)
            except BatonError as e:  # the frontend is gone: nothing left to serve
                log.error("engine %d: input channel failed: %s", self.engine_index, e)
                self.input_queue.put((RequestType.EXECUTOR_FAILED, e))
                return
            if frames is None:
                if os.getppid() != parent:  # re-parented: the frontend died without closing us
                    self.input_queue.put(
                        (RequestType.EXECUTOR_FAILED, TransportError("the frontend process exited"))
                    )
                    return
                continue
            rtype = None
            try:
                rtype = RequestType(bytes(frames[0]))
                decoder = decoders[rtype]
                self.input_queue.put((rtype, decoder.decode(frames[1:])))
            except (ValueError, KeyError, IndexError, ProtocolError) as e:
                # garbage must never take the engine down: log it and keep serving
                log.warning(
                    "engine %d: dropped a malformed message (%d frames): %s",
                    self.engine_index,
                    len(frames),
                    e,
                )
                if rtype is RequestType.ADD:
                    self._refuse_undecodable(frames, e)

    def _refuse_undecodable(self, frames: Any, error: BaseException) -> None:
        """Answer an ADD that failed to decode (e.g. SamplingParams out of bounds) when its
        request id can be read, so that its client gets an error instead of waiting forever."""
        try:
            fields = msgspec.msgpack.decode(frames[1])
        except (msgspec.DecodeError, IndexError, TypeError):
            return
        if not (isinstance(fields, list) and fields and isinstance(fields[0], str)):
            return
        cause = error.__cause__ if error.__cause__ is not None else error
        out = EngineCoreOutput(
            request_id=fields[0],
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            error=f"InvalidRequestError: {cause}",
        )
        self.output_queue.put(
            EngineCoreOutputs(
                engine_index=self.engine_index, outputs=[out], timestamp=time.monotonic()
            )
        )

    def _output_loop(self) -> None:
        encoder = MsgpackEncoder()
        while True:
            item = self.output_queue.get()
            if item is _STOP:
                return
            frames = item if isinstance(item, list) else encoder.encode(item)
            try:
                self.channel.send(frames)
            except BatonError as e:
                log.error("engine %d: output channel failed: %s", self.engine_index, e)
                return

    # ------------------------------------------------------------------ the busy loop

    def run(self) -> None:
        """Serve until shutdown; raises on a fatal error (after ENGINE_CORE_DEAD went out)."""
        for t in self._threads:
            t.start()
        core = self.core
        try:
            self.output_queue.put(self._ready_frames())
            was_busy = False
            while True:
                if self.shutdown_requested.is_set() and self._shutdown_step():
                    return
                self._drain_input(block=not core.has_work())
                outputs, _ = core.step_fn()
                busy = core.has_work()
                if outputs is not None and (
                    outputs.outputs or outputs.utility_output or busy or was_busy
                ):
                    # stats while busy, and once more on going idle (e.g. after an abort), so
                    # the frontend's gauges (running, KV usage) do not stay at their last busy value
                    self.output_queue.put(outputs)
                was_busy = busy
        except BaseException as e:
            self.fatal = e
            self._send_dead(e)
            raise
        finally:
            self._close()

    def _ready_frames(self) -> list[bytes]:
        ready = EngineReady(
            engine_index=self.engine_index,
            pid=os.getpid(),
            num_blocks=self.core.num_blocks,
            info=self.core.info,
        )
        return [READY, *MsgpackEncoder().encode(ready)]

    def _drain_input(self, block: bool) -> None:
        q = self.input_queue
        if block:
            try:
                self._handle(*q.get(timeout=0.1))
            except queue.Empty:
                return
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _handle(self, rtype: RequestType, payload: Any) -> None:
        if rtype is RequestType.ADD:
            self._add(payload)
        elif rtype is RequestType.ABORT:
            self.core.abort_requests(payload)
        elif rtype is RequestType.UTILITY:
            self._utility(payload)
        elif rtype is RequestType.EXECUTOR_FAILED:
            raise payload if isinstance(payload, BaseException) else ExecutorError(str(payload))
        elif rtype is RequestType.START_DP_WAVE:  # only engines stepping in waves use it
            log.warning("engine %d: ignored START_DP_WAVE (no expert parallel)", self.engine_index)

    def _add(self, req: EngineCoreRequest) -> None:
        error: str | None = None
        if self._shutdown_deadline is not None:
            error = (
                "EngineShuttingDownError: the engine is shutting down and accepts no new requests"
            )
        else:
            error = self._try_add(req)
        if error is not None:
            out = EngineCoreOutput(
                request_id=req.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=error,
            )
            self.output_queue.put(
                EngineCoreOutputs(
                    engine_index=self.engine_index, outputs=[out], timestamp=time.monotonic()
                )
            )

    def _try_add(self, req: EngineCoreRequest) -> str | None:
        """Add a request; what went wrong, if anything. A bad request fails alone."""
        rid = req.request_id
        # a live request under this id is not ours to drop if adding fails
        known = rid in self.core.scheduler.requests
        try:
            self.core.add_request(req)
        except BatonError as e:  # refused on purpose: the message says why
            return f"{type(e).__name__}: {e}"
        except Exception as e:  # a fault on this request's way in: the engine keeps serving
            log.warning(
                "engine %d: request %s failed to be added", self.engine_index, rid, exc_info=e
            )
            if not known:
                self.core.abort_requests([rid])  # whatever part of it got in
            return f"{type(e).__name__}: {e}"
        return None

    def _utility(self, call: UtilityRequest) -> None:
        result, failure = None, None
        if self.shutdown_requested.is_set():
            failure = (
                "EngineShuttingDownError: the engine is shutting down and accepts no utility calls"
            )
        elif call.method not in UTILITY_METHODS:
            failure = f"InvalidRequestError: unknown utility method {call.method!r} (known: {', '.join(sorted(UTILITY_METHODS))})"
        else:
            try:
                result = getattr(self.core, call.method)(*call.args)
            except Exception as e:  # re-raised in the client with its message
                failure = f"{type(e).__name__}: {e}"
        self.output_queue.put(
            EngineCoreOutputs(
                engine_index=self.engine_index,
                utility_output=UtilityOutput(
                    call_id=call.call_id, result=result, failure_message=failure
                ),
                timestamp=time.monotonic(),
            )
        )

    # ------------------------------------------------------------------ shutdown and failure

    def request_shutdown(self, *_: Any) -> None:
        """Signal handler (SIGTERM/SIGINT) and programmatic shutdown."""
        self.shutdown_requested.set()

    def _shutdown_step(self) -> bool:
        """True when the loop should exit now."""
        timeout = self.core.config.serving.shutdown_timeout
        if self._shutdown_deadline is None:
            # requests already queued when shutdown is first seen were sent before it: they are
            # in flight too (drained, or answered by the abort below), never dropped unanswered
            self._drain_input(block=False)
            self._shutdown_deadline = time.monotonic() + timeout
            log.info(
                "engine %d: shutting down (%s mode)",
                self.engine_index,
                "drain" if timeout > 0 else "abort",
            )
        if timeout > 0 and self.core.has_work() and time.monotonic() < self._shutdown_deadline:
            return False  # drain mode: keep stepping in-flight requests
        aborted = self.core.abort_all()
        if aborted:
            self.output_queue.put(
                EngineCoreOutputs(
                    engine_index=self.engine_index, outputs=aborted, timestamp=time.monotonic()
                )
            )
        return True

    def _on_executor_failure(self, error: BaseException) -> None:
        # runs on an executor thread: wake the busy loop, which raises it
        self.input_queue.put((RequestType.EXECUTOR_FAILED, error))

    def _send_dead(self, error: BaseException) -> None:
        message = f"{type(error).__name__}: {error}".encode()
        log.error(
            "engine %d died: %s", self.engine_index, "".join(traceback.format_exception(error))
        )
        # the third frame names the engine: a data-parallel client may fail its requests only
        self.output_queue.put([ENGINE_CORE_DEAD, message, str(self.engine_index).encode()])

    def _close(self) -> None:
        self.output_queue.put(_STOP)
        self._threads[1].join(timeout=5)  # let the last outputs (and DEAD) go out
        self.closing.set()
        self._threads[0].join(timeout=1)
        try:
            self.core.shutdown()
        finally:
            self.channel.close()
