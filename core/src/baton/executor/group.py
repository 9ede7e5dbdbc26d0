"""A group of worker processes and the broadcast channel to them, for building an executor.

``WorkerGroup(name, transport, world_size)`` holds the client end of a
multiprocess transport's channel (``create_client(num_engines=world_size)``).
``start(target, args)`` spawns one process per rank ("spawn": a fresh
interpreter, daemonic) running ``target(link, args[rank])``; the worker joins
with ``link.join()`` (``baton.executor.member``) and answers the start-up call
with ``Member.ready(value)``; ``start`` returns those values in rank order.

``call(kind, payload, to=ranks)`` sends the same frames to every rank in ``to``
(the broadcast) and returns a Future: the answers of those ranks in rank order,
or, with ``reply_from=rank``, that one rank's answer alone. Answers are decoded
by the call's ``decode`` (default: the first frame unpickled).

One thread reads the answers and watches the processes. The group fails when a
worker exits, reports an error (``Member.reply_error``), sends an unreadable
answer, misses its heartbeats for ``heartbeat_timeout`` seconds (a stopped or
frozen process) or leaves a call with ``fail_after`` unanswered that long (stuck
in its main thread): the first failure trips the group's ``FailureLatch``,
every pending call's Future raises ``ExecutorError``, the failure callbacks run
once, and every later call raises. A worker that answers one call with
``Member.reply_call_error`` fails that call alone: its Future raises the
worker's error (``baton.errors.worker_error``) and the group goes on. ``shutdown`` asks the workers to exit,
kills those that do not, and ends the threads.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from baton import processes
from baton.errors import BatonError, ExecutorError, worker_error
from baton.executor.calls import CallBook
from baton.executor.heartbeat import Heartbeats
from baton.executor.member import (
    CALL_FAILED,
    GROUP_FAILED,
    READY,
    REPLY,
    SHUTDOWN,
    MemberLink,
    request_header,
)

log = logging.getLogger(__name__)

#: Seconds between two looks at the workers' processes, heartbeats and call deadlines.
WATCH_INTERVAL = 0.05


def unpickle_first(frames: list[Any]) -> Any:
    """The default answer decoder: the first frame unpickled (None for an empty answer)."""
    return pickle.loads(frames[0]) if frames else None


class WorkerGroup:
    """Worker processes, the broadcast of calls to them, and their failure (see the module docstring).

    ``transport`` is a multiprocess baton transport (``baton.executor.workers.pick_transport``).
    ``kind_names`` names call kinds in error messages; ``hang_hint`` says which setting a call's
    ``fail_after`` came from (e.g. "executor step_timeout").
    """

    def __init__(
        self,
        name: str,
        transport: Any,
        world_size: int,
        *,
        heartbeat_timeout: float = 4.0,
        kind_names: dict[int, str] | None = None,
        hang_hint: str = "fail_after",
    ) -> None:
        self.name = name
        self.transport = transport
        self.world_size = world_size
        self.heartbeat_timeout = heartbeat_timeout
        self.kind_names = {READY: "ready", **(kind_names or {})}
        self.hang_hint = hang_hint
        #: The pending calls, settled once; the completer thread of chained ones.
        self.calls = CallBook(
            name, kind_names=self.kind_names, hangs=f"a worker hangs ({hang_hint})"
        )
        #: The first failure, the failure callbacks, the closed state.
        self.latch = self.calls.latch
        #: Each worker's last heartbeat, watched by the reader thread.
        self.heartbeats = Heartbeats(world_size)
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(
            target=self._read_loop, name=f"baton-{name}-reader", daemon=True
        )
        self.channel: Any = transport.create_client(world_size)

    # ------------------------------------------------------------------ start

    def start(
        self,
        target: Callable[[MemberLink, Any], None],
        args: Sequence[Any],
        timeout: float | None = None,
        what: str = "the workers to start",
    ) -> list[Any]:
        """Spawn one process per rank running ``target(link, args[rank])`` (both pickled: define
        ``target`` at module level) and wait up to ``timeout`` seconds for every rank's
        ``Member.ready(value)``; the values in rank order. Raises ExecutorError when a worker
        fails to start; the caller then calls ``shutdown``."""
        if len(args) != self.world_size:
            raise ExecutorError(
                f"{self.name}: {len(args)} worker arguments for {self.world_size} workers"
            )
        ready = self.calls.new(READY, range(self.world_size), decode=unpickle_first, call_id=0)
        self._reader.start()
        self.calls.start()
        for rank, arg in enumerate(args):
            link = MemberLink(
                group=self.name,
                rank=rank,
                world_size=self.world_size,
                transport=self.transport,
                address=self.channel.address,
                heartbeats=self.heartbeats,
                parent_pid=os.getpid(),
            )
            p = processes.start(
                target, (link, arg), name=f"baton-{self.name}-worker-{rank}", daemon=True
            )
            self.procs.append(p)
        return self.wait(ready.future, timeout, what)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ calls

    def call(
        self,
        kind: int,
        payload: Sequence[Any] = (),
        *,
        to: Iterable[int] | None = None,
        reply_from: int | None = None,
        decode: Callable[[list[Any]], Any] = unpickle_first,
        fail_after: float | None = None,
        chained: bool = False,
    ) -> Future[Any]:
        """Send ``[header, *payload]`` to each rank in ``to`` (default: all); a Future of the
        answers of those ranks in rank order, or of ``reply_from``'s answer alone (then only
        that rank answers). ``kind`` (1 to 254) tells the workers what the call is.

        ``fail_after``: seconds after which an unanswered call fails the whole group (a worker
        hangs). ``chained``: a done callback of this Future may wait on another call of the
        group (the engine core chains ``sample_tokens`` onto a step); its Future is then
        resolved on the group's completer thread, so that the reader keeps reading.
        """
        if not 0 < kind < SHUTDOWN:
            raise ExecutorError(f"{self.name}: call kind {kind} is reserved (use 1 to 254)")
        ranks = list(range(self.world_size)) if to is None else list(to)
        call = self.calls.new(
            kind,
            ranks,
            decode=decode,
            reply_from=reply_from,
            fail_after=fail_after,
            chained=chained,
        )
        self._send([request_header(kind, call.id, time.monotonic()), *payload], ranks)
        return call.future

    def wait(self, future: Future[Any], timeout: float | None, what: str) -> Any:
        """``future.result(timeout)``; on timeout the call is dropped (a late answer is ignored)
        and ExecutorError says what was awaited. The group stays healthy."""
        return self.calls.wait(future, timeout, what)

    def _send(self, frames: list[Any], ranks: list[int]) -> None:
        with self._send_lock:
            try:
                for r in ranks:
                    self.channel.send(frames, r)
            except BatonError as e:
                self.fail(ExecutorError(f"cannot reach a worker: {e}"))
                raise ExecutorError(f"the {self.name} executor cannot reach a worker: {e}") from e

    # ------------------------------------------------------------------ health

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """``callback(error)`` runs once on the group's first failure (at once if it failed)."""
        self.latch.register(callback)

    def check_health(self) -> None:
        """Look at the workers now; raise ExecutorError when the group failed or is shut down."""
        self._watch(time.monotonic())
        self.latch.check()

    def fail(self, error: BaseException) -> None:
        """Fail the group with ``error`` (the first failure wins): pending calls raise
        ExecutorError, the failure callbacks run once, later calls raise."""
        self.calls.fail(error)

    def pids(self) -> list[int]:
        """Each started worker's process id, in rank order (``start`` starts them all)."""
        return [p.pid for p in self.procs if p.pid is not None]

    def dead_workers(self) -> str | None:
        """Which workers exited, with their exit codes; None while all live."""
        dead = [
            f"worker {r} (pid {p.pid}) exited with code {p.exitcode}"
            for r, p in enumerate(self.procs)
            if p.exitcode is not None
        ]
        return "; ".join(dead) or None

    def _exited_workers(self, wait: float = 1.0) -> str | None:
        """``dead_workers()``, waiting up to ``wait`` s for an exit the channel saw first (a
        process started by a forkserver reports its exit code through it, a moment later)."""
        deadline = time.monotonic() + wait
        while (dead := self.dead_workers()) is None and time.monotonic() < deadline:
            for p in self.procs:
                p.join(0.02)
        return dead

    def _watch(self, now: float) -> None:
        if self.latch.closed or self.latch.failure is not None:
            return
        dead = self.dead_workers()
        if dead:
            self.fail(ExecutorError(dead))
            return
        limit = self.heartbeat_timeout
        silent = self.heartbeats.silent(now, limit)
        if silent:
            rank, quiet = silent[0]
            self.fail(
                ExecutorError(
                    f"worker {rank} (pid {self.procs[rank].pid}) sent no heartbeat for "
                    f"{quiet:.1f} s: it is stopped or frozen (heartbeat_timeout={limit})"
                )
            )
            return
        self.calls.check_deadlines(now)

    # ------------------------------------------------------------------ reader

    def _read_loop(self) -> None:
        next_check = 0.0
        while not self.latch.closed:
            try:
                frames = self.channel.recv(timeout=WATCH_INTERVAL)
            except BatonError as e:
                if not self.latch.closed:
                    # the transport names its peers as engines: a worker's exit says it better
                    dead = self._exited_workers()
                    self.fail(ExecutorError(dead or f"the worker channel failed: {e}"))
                return
            now = time.monotonic()
            if now >= next_check:
                next_check = now + WATCH_INTERVAL
                self._watch(now)
            if frames is not None:
                self._answer(frames)

    def _answer(self, frames: list[Any]) -> None:
        _, call_id, rank, status = REPLY.unpack(bytes(frames[0]))
        if status == GROUP_FAILED:
            self.fail(ExecutorError(bytes(frames[1]).decode(errors="replace")))
        elif status == CALL_FAILED:  # this call alone fails, at its first error
            text = bytes(frames[1]).decode(errors="replace") if len(frames) > 1 else ""
            self.calls.fail_call(call_id, worker_error(rank, text))
        elif (call := self.calls.get(call_id)) is not None:
            self.calls.answer(call, rank, list(frames[1:]))

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, grace: float = 5.0) -> bool:
        """Ask the workers to exit (``grace`` seconds, 1 after a failure), kill the rest, end the
        threads and close the channel; pending calls raise ExecutorError. False when it was
        shut down already."""
        if not self.calls.close():
            return False
        healthy = self.latch.failure is None
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        if alive:
            try:
                with self._send_lock:
                    frames = [request_header(SHUTDOWN, 0, time.monotonic())]
                    for r in alive:
                        self.channel.send(frames, r)
            except BatonError as e:
                log.debug("%s: shutdown message not delivered: %s", self.name, e)
        deadline = time.monotonic() + (grace if healthy else 1.0)
        for p in self.procs:
            p.join(timeout=max(0.05, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                log.warning("%s: worker pid %s did not exit; killing it", self.name, p.pid)
                p.kill()
                p.join(timeout=5)
        self.calls.stop()
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(timeout=2)
        self.channel.close()
        return True
