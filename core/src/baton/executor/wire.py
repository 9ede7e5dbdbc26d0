"""Messages between a multiprocess executor and its workers (over a transport's channel).

Executor -> worker: ``[REQUEST header, *payload]``, the same frames to every
worker (the broadcast). Worker -> executor: ``[REPLY header, *payload]``.
Payloads: a SchedulerOutput / GrammarOutput / ModelRunnerOutput in baton's
msgpack codec; RPCs and their results pickled (a collective_rpc may carry any
callable); errors as UTF-8 text.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

#: kind (u8), call id (u64), time.monotonic() at send (f64)
REQUEST = struct.Struct("<BQd")
#: kind (u8), call id (u64), rank (u16), ok (u8)
REPLY = struct.Struct("<BQHB")


class Kind(enum.IntEnum):
    READY = 0  # worker -> executor, once, after loading its shard (payload: pickled WorkerReady)
    EXECUTE = 1  # payload: SchedulerOutput; only the driver answers (or any rank that failed)
    SAMPLE = 2  # payload: GrammarOutput or nothing; sent to the driver only
    RPC = 3  # payload: pickled (method, args, kwargs); every rank answers
    SHUTDOWN = 4  # no answer; the worker exits


@dataclass
class WorkerReady:
    """What a worker reports once its shard is loaded."""

    rank: int
    pid: int
    model_info: Any  # baton.protocol.ModelInfo
    capabilities: Any  # baton.protocol.ModelCapabilities


def request(kind: Kind, call_id: int, sent_at: float) -> bytes:
    return REQUEST.pack(kind, call_id, sent_at)


def reply(kind: Kind, call_id: int, rank: int, ok: bool = True) -> bytes:
    return REPLY.pack(kind, call_id, rank, 1 if ok else 0)
