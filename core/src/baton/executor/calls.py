"""The call book of a group of ranks: calls waiting for answers, each settled once.

An executor that broadcasts calls to its ranks (``WorkerGroup``'s processes, the
Ray executor's actors) registers each call here with the ranks whose answers it
waits for (``new``), hands each answer over as it comes (``answer``, or
``fail_call`` for a rank that failed that call alone) and reads the Future.
The book fails the whole group once (``fail``: its ``FailureLatch`` trips, every
pending call raises ExecutorError, the failure callbacks run), fails it when a
call with ``fail_after`` stays unanswered that long (``check_deadlines``), drops
a call whose waiter timed out (``wait``) and settles what is left at ``close``.
A ``chained`` call's Future is resolved on the book's completer thread, so that
a done callback of it may wait on another call of the group while the thread
that delivers answers goes on.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from baton.errors import ExecutorError
from baton.executor.latch import FailureLatch


class Call:
    """A call waiting for answers from the ranks in ``expect``."""

    __slots__ = (
        "chained",
        "deadline",
        "decode",
        "expect",
        "fail_after",
        "future",
        "id",
        "kind",
        "one",
        "results",
    )

    def __init__(
        self,
        call_id: int,
        kind: int,
        expect: set[int],
        fail_after: float | None,
        decode: Callable[[Any], Any],
        one: bool,
        chained: bool,
    ) -> None:
        self.id = call_id
        self.kind = kind
        self.expect = expect
        self.fail_after = fail_after
        self.deadline = time.monotonic() + fail_after if fail_after else None
        self.decode = decode
        self.one = one
        self.chained = chained
        self.results: dict[int, Any] = {}
        self.future: Future[Any] = Future()


class CallBook:
    """Pending calls of the group ``name`` and its completer thread (see the module docstring).

    ``kind_names`` names call kinds in the hang message, which ends with ``hangs`` (e.g. "a
    worker hangs (executor step_timeout)"). ``serial_decode``: answers arrive on several
    threads, so decoding is serialized (a decoder need not be thread-safe).
    """

    def __init__(
        self,
        name: str,
        *,
        kind_names: dict[int, str],
        hangs: str,
        serial_decode: bool = False,
    ) -> None:
        self.name = name
        self.kind_names = kind_names
        self.hangs = hangs
        #: The first failure, the failure callbacks, the closed state.
        self.latch = FailureLatch(name)
        #: Guards the pending calls; held while the latch trips or closes, so no call slips in.
        self.lock = threading.Lock()
        self._decode_lock: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if serial_decode else contextlib.nullcontext()
        )
        self._calls: dict[int, Call] = {}
        self._ids = itertools.count(1)
        self._done: queue.SimpleQueue[tuple[Future[Any], Any, BaseException | None] | None] = (
            queue.SimpleQueue()
        )
        self._completer = threading.Thread(
            target=self._complete_loop, name=f"baton-{name}-done", daemon=True
        )

    def start(self) -> None:
        """Start the completer thread (before the first chained call is answered)."""
        self._completer.start()

    # ------------------------------------------------------------------ calls

    def new(
        self,
        kind: int,
        ranks: Iterable[int],
        *,
        decode: Callable[[Any], Any],
        reply_from: int | None = None,
        fail_after: float | None = None,
        chained: bool = False,
        call_id: int | None = None,
    ) -> Call:
        """Register a call to ``ranks``: its Future gets their answers in rank order, or
        ``reply_from``'s alone. Raises ExecutorError when the group failed or is closed."""
        expect = set(ranks) if reply_from is None else {reply_from}
        with self.lock:
            self.latch.check()
            call = Call(
                next(self._ids) if call_id is None else call_id,
                kind,
                expect,
                fail_after,
                decode,
                reply_from is not None,
                chained,
            )
            self._calls[call.id] = call
        return call

    def get(self, call_id: int) -> Call | None:
        """The pending call ``call_id``; None once it is settled or dropped."""
        with self.lock:
            return self._calls.get(call_id)

    def answer(self, call: Call, rank: int, raw: Any) -> None:
        """``rank``'s answer to ``call``: decoded, and the call settled once every rank answered.
        An unreadable answer fails the group."""
        if self.get(call.id) is None:
            return  # its waiter timed out, the group failed, or another rank failed the call
        try:
            with self._decode_lock:
                call.results[rank] = call.decode(raw)
        except Exception as e:
            self.fail(ExecutorError(f"worker {rank} sent an unreadable answer: {e}"))
            return
        if not call.expect.issubset(call.results):
            return
        with self.lock:
            if self._calls.pop(call.id, None) is None:
                return  # failed, timed out or settled meanwhile
        results = call.results
        one = call.one
        self._settle(call, results[rank] if one else [results[r] for r in sorted(call.expect)])

    def fail_call(self, call_id: int, error: BaseException) -> None:
        """Fail this call alone with ``error`` (a rank's error in it); the group goes on."""
        with self.lock:
            call = self._calls.pop(call_id, None)
        if call is not None:  # else: settled, dropped, or failed by another rank first
            self._settle(call, None, error)

    def wait(self, future: Future[Any], timeout: float | None, what: str) -> Any:
        """``future.result(timeout)``; on timeout the call is dropped (a late answer is ignored)
        and ExecutorError says what was awaited. The group stays healthy."""
        try:
            return future.result(timeout)
        except FutureTimeout:
            with self.lock:
                for call_id, call in list(self._calls.items()):
                    if call.future is future:
                        del self._calls[call_id]
            raise ExecutorError(
                f"{self.name}: timed out after {timeout} s waiting for {what}"
            ) from None

    # ------------------------------------------------------------------ failure, close

    def fail(self, error: BaseException) -> None:
        """Fail the group with ``error`` (the first failure wins): pending calls raise
        ExecutorError, the failure callbacks run once, later calls raise."""
        with self.lock:  # latched with the pending calls taken: no call slips in between
            callbacks = self.latch.trip(error)
            if callbacks is None:
                return
            calls, self._calls = list(self._calls.values()), {}
        for c in calls:
            self._settle(c, None, ExecutorError(f"the {self.name} executor failed: {error}"))
        self.latch.notify(error, callbacks)

    def check_deadlines(self, now: float) -> bool:
        """Fail the group when a call with ``fail_after`` is still unanswered at ``now``;
        whether one was."""
        with self.lock:
            late = [c for c in self._calls.values() if c.deadline is not None and now > c.deadline]
        if not late:
            return False
        call = late[0]
        kind = self.kind_names.get(call.kind, f"kind-{call.kind}")
        self.fail(
            ExecutorError(
                f"a {kind} call was not answered within {call.fail_after} s: {self.hangs}"
            )
        )
        return True

    def close(self) -> bool:
        """Close the latch and settle every pending call (they raise ExecutorError: shut down);
        False when it was closed already."""
        with self.lock:
            if not self.latch.close():
                return False
            calls, self._calls = list(self._calls.values()), {}
        for c in calls:
            self._settle(c, None, ExecutorError(f"the {self.name} executor is shut down"))
        return True

    def stop(self) -> None:
        """End the completer thread (after ``close``)."""
        self._done.put(None)
        t = self._completer
        if t.is_alive() and t is not threading.current_thread():
            t.join(timeout=2)

    # ------------------------------------------------------------------ settling

    def _settle(self, call: Call, value: Any, error: BaseException | None = None) -> None:
        """Resolve a call's Future once: a chained one on the completer thread."""
        if call.chained:
            self._done.put((call.future, value, error))
        elif not call.future.done():
            if error is not None:
                call.future.set_exception(error)
            else:
                call.future.set_result(value)

    def _complete_loop(self) -> None:
        while (item := self._done.get()) is not None:
            future, value, error = item
            if not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(value)
