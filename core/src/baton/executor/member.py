"""A worker process's end of a ``WorkerGroup``: receive the group's calls, answer them.

``WorkerGroup.start`` runs ``target(link, arg)`` in each spawned process;
``link.join()`` starts the process's heartbeat and connects its end of the
group's channel, a ``Member``. The member then answers the group's start-up call
once (``ready``) and serves calls: ``recv`` gives the next ``Message`` (the
same frames every addressed rank received), ``reply`` answers it,
``reply_call_error`` answers it with an error that fails that call alone (a
utility call: ``collective_rpc``), ``reply_error`` reports a failure of the
worker itself, which fails the whole group (a step). A ``SHUTDOWN`` message
asks the process to exit.

On the wire a call is ``[request header, *payload]`` and an answer
``[reply header, *payload]``; the payload frames are whatever the executor and
its workers agree on (the group only carries them).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

from baton.executor.heartbeat import Heartbeats

#: kind (u8), call id (u64), time.monotonic() at send (f64)
REQUEST = struct.Struct("<BQd")
#: kind (u8), call id (u64), rank (u16), status (u8: OK, CALL_FAILED or GROUP_FAILED)
REPLY = struct.Struct("<BQHB")

#: A reply's status: the answer; the call failed here (the group goes on); the worker failed.
GROUP_FAILED, OK, CALL_FAILED = 0, 1, 2

#: The kind of the start-up call every worker answers once, with ``Member.ready``.
READY = 0
#: The kind of the message that asks a worker to exit; it is not answered.
SHUTDOWN = 255


def request_header(kind: int, call_id: int, sent_at: float) -> bytes:
    return REQUEST.pack(kind, call_id, sent_at)


def reply_header(kind: int, call_id: int, rank: int, status: int = OK) -> bytes:
    return REPLY.pack(kind, call_id, rank, status)


class Message(NamedTuple):
    """One call as a worker receives it."""

    kind: int
    call_id: int
    #: ``time.monotonic()`` when the group sent it (one clock for the processes of a machine).
    sent_at: float
    payload: list[Any]


@dataclass(frozen=True)
class MemberLink:
    """What a worker process needs to join its group; pickled to it by ``WorkerGroup.start``."""

    group: str
    rank: int
    world_size: int
    transport: Any  # a multiprocess baton transport
    address: Any  # the group's channel address
    heartbeats: Heartbeats
    parent_pid: int

    def join(self) -> Member:
        """In the worker: beat in this rank's heartbeat slot (exiting when the parent is gone)
        and connect this rank's end of the channel."""
        self.heartbeats.start_beating(self.rank, self.parent_pid)
        return Member(self.rank, self.transport.connect_engine(self.address, self.rank))


class Member:
    """One rank's end of the group's channel (see the module docstring)."""

    def __init__(self, rank: int, channel: Any) -> None:
        self.rank = rank
        self.channel = channel

    def recv(self, timeout: float | None = None) -> Message | None:
        """The next call, or None after ``timeout`` seconds without one.

        Raises the transport's ``BatonError`` once the group closed the channel."""
        frames = self.channel.recv(timeout=timeout)
        if frames is None:
            return None
        kind, call_id, sent_at = REQUEST.unpack(bytes(frames[0]))
        return Message(kind, call_id, sent_at, list(frames[1:]))

    def reply(self, kind: int, call_id: int, payload: list[Any] | tuple[Any, ...] = ()) -> None:
        """Answer call ``call_id`` (of ``kind``) with ``payload`` frames."""
        self.channel.send([reply_header(kind, call_id, self.rank), *payload])

    def reply_call_error(self, kind: int, call_id: int, text: str) -> None:
        """Answer call ``call_id`` with an error, ``text`` as ``"ClassName: message"``: that
        call's Future raises it (a baton error keeps its type, rebuilt by
        ``baton.errors.worker_error`` with this rank named); the group and its other calls go
        on. For a call whose failure leaves the worker sound (a ``collective_rpc`` target)."""
        self.channel.send([reply_header(kind, call_id, self.rank, CALL_FAILED), text.encode()])

    def reply_error(self, kind: int, call_id: int, text: str) -> None:
        """Report that this worker failed on call ``call_id``: the group fails with ``text``
        (every pending call raises, later calls too). For a step, or a fault that leaves the
        worker's state unknown."""
        self.channel.send([reply_header(kind, call_id, self.rank, GROUP_FAILED), text.encode()])

    def ready(self, value: Any) -> None:
        """Answer the start-up call with ``value`` (pickled)."""
        import pickle

        self.reply(READY, 0, [pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)])

    def close(self) -> None:
        self.channel.close()
