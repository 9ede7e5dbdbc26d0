"""The rank actor: one rank of the group (``baton.executor.rank.Rank``) inside a Ray actor.

An asyncio actor with two concurrency groups. The default one takes the
executor's calls (``call``): each carries a per-actor sequence number, and the
actor's ``Inbox`` hands them in that order to the rank's serving thread (Ray
does not keep the submission order of an asyncio actor's calls), which runs
``Rank.serve`` exactly as a local worker process does: the same deferral of a
step while a sample is pending, the same answers (only the driver answers
EXECUTE and SAMPLE). A call that wants an answer awaits it; one that does not
(EXECUTE on the other ranks) returns once queued. The ``monitor`` group answers
``ping`` from its own thread, so a rank inside a long step still answers: the
executor's heartbeat, which also carries a rank's error when it reported one
for a call nobody awaits.

All of the rank's torch work (building it, its steps, leaving the process
group) runs on one thread of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from baton.errors import BatonError
from baton.executor.member import Message
from baton_ray.cluster import prepare_actor
from baton_ray.executor import CALL_FAILED

log = logging.getLogger(__name__)

#: The concurrency group of ``ping``.
MONITOR_GROUP = "monitor"


class Inbox:
    """The calls of one actor, in sequence order, and their answers (a ``Rank.serve`` member)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._cond = threading.Condition()
        self._pending: dict[int, Message] = {}
        self._next = 0
        self._waiters: dict[int, asyncio.Future[Any]] = {}
        self._closed = False
        #: The first error this rank reported (``ping`` returns it).
        self.failure: str | None = None

    def put(
        self, seq: int, kind: int, payload: Any, sent_wall: float, waiter: asyncio.Future | None
    ) -> None:
        # the executor's clock is time.time(); turn it into this process's time.monotonic()
        sent_at = time.monotonic() - max(0.0, time.time() - sent_wall)
        frames = list(payload) if payload is not None else []
        with self._cond:
            if waiter is not None:
                self._waiters[seq] = waiter
            self._pending[seq] = Message(kind, seq, sent_at, frames)
            self._cond.notify()

    def recv(self, timeout: float | None = None) -> Message | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed and self._next not in self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            if self._closed:
                raise BatonError("the rank's inbox is closed")
            msg = self._pending.pop(self._next)
            self._next += 1
            return msg

    def reply(self, kind: int, call_id: int, payload: list[Any] | tuple[Any, ...] = ()) -> None:
        frames = [bytes(f) if isinstance(f, memoryview | bytearray) else f for f in payload]
        self._settle(call_id, ("ok", frames))

    def reply_call_error(self, kind: int, call_id: int, text: str) -> None:
        """That call fails alone (a collective_rpc target raised); the rank stays healthy."""
        self._settle(call_id, (CALL_FAILED, text))

    def reply_error(self, kind: int, call_id: int, text: str) -> None:
        if self.failure is None:
            self.failure = text
        self._settle(call_id, ("error", text))

    def _settle(self, call_id: int, value: tuple[str, Any]) -> None:
        with self._cond:
            waiter = self._waiters.pop(call_id, None)
        if waiter is not None:
            self._loop.call_soon_threadsafe(_set_result, waiter, value)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiters, self._waiters = list(self._waiters.values()), {}
            self._cond.notify_all()
        for w in waiters:
            self._loop.call_soon_threadsafe(_set_result, w, ("error", "the rank stopped"))


#: Imported by a rank actor as soon as it exists (each takes seconds on a small machine).
PRELOAD = ("torch.distributed", "transformers", "baton.executor.rank", "baton.parallel.hooks")


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


@ray.remote(concurrency_groups={MONITOR_GROUP: 1})
class RankActor:
    """One rank (see the module docstring). ``env`` is applied before torch is imported."""

    def __init__(self, env: dict[str, str], log_level: str = "INFO", nice: int | None = 0) -> None:
        # the heavy imports start now, while the executor still waits for rank 0's rendezvous
        self._preload = prepare_actor(env, nice, "rank", PRELOAD)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-rank")
        self._store: Any = None
        self._rank: Any = None
        self._inbox: Inbox | None = None
        self._serving: asyncio.Future | None = None
        self._log_level = log_level

    async def host_store(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: bind the rendezvous on this node; its address for every rank."""
        self._preload.join()
        from baton.executor.rank import host_store

        host = ray.util.get_node_ip_address()
        loop = asyncio.get_running_loop()
        self._store = await loop.run_in_executor(self._pool, host_store, host, timeout_s)
        return host, int(self._store.port)

    async def start(self, boot: Any) -> tuple[str, Any]:
        """Build the rank (plugin check, process group, shard) and serve: ("ok", WorkerReady)
        or ("error", why)."""
        loop = asyncio.get_running_loop()
        self._inbox = Inbox(loop)
        try:
            self._rank = await loop.run_in_executor(self._pool, self._build, boot)
        except BaseException as e:
            text = f"worker {boot.rank} failed to start: {type(e).__name__}: {e}"
            log.error("%s\n%s", text, "".join(traceback.format_exception(e)))
            return "error", text
        self._serving = loop.run_in_executor(self._pool, self._serve)
        return "ok", self._rank.ready()

    def _build(self, boot: Any) -> Any:
        self._preload.join()
        from baton.executor.rank import Rank

        logging.basicConfig(
            level=self._log_level,
            format=f"%(asctime)s %(levelname)s worker{boot.rank} %(name)s: %(message)s",
        )
        store, self._store = self._store, None
        return Rank(boot, store)

    def _serve(self) -> None:
        assert self._inbox is not None
        try:
            self._rank.serve(self._inbox)
        except BatonError:
            pass  # stopped
        except BaseException as e:  # the serving loop itself broke: the executor fails
            self._inbox.reply_error(0, -1, f"worker {self._rank.rank} stopped serving: {e!r}")
        finally:
            self._rank.close()

    async def call(
        self, seq: int, kind: int, payload: Any, reply: bool, sent_wall: float
    ) -> tuple[str, Any] | None:
        """Queue call ``seq``; with ``reply``, its answer: ("ok", frames), ("error", why): the
        rank failed, or (CALL_FAILED, "Type: message"): that call alone failed."""
        inbox = self._inbox
        if inbox is None:
            return "error", "the rank has not started"
        waiter = asyncio.get_running_loop().create_future() if reply else None
        inbox.put(seq, kind, payload, sent_wall, waiter)
        return None if waiter is None else await waiter

    @ray.method(concurrency_group=MONITOR_GROUP)
    async def ping(self) -> str | None:
        """The heartbeat: None while healthy, else the first error this rank reported."""
        return None if self._inbox is None else self._inbox.failure

    async def stop(self, timeout_s: float) -> bool:
        """Stop serving and leave the process group; False when that took over ``timeout_s``."""
        if self._inbox is not None:
            self._inbox.close()
        if self._serving is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self._serving), timeout_s)
        except TimeoutError:
            return False
        return True
