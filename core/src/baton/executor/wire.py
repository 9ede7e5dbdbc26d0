"""The calls between MultiprocExecutor and its workers, over a ``WorkerGroup`` (baton.executor.group).

The executor sends a step to every worker (the broadcast); only the driver rank
answers. Payloads: a SchedulerOutput / GrammarOutput / ModelRunnerOutput in
baton's msgpack codec; RPCs and their results pickled (a collective_rpc may carry
any callable); errors as UTF-8 text. The frame headers are the group's
(``baton.executor.member``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from baton.executor import member


class Kind(enum.IntEnum):
    READY = member.READY  # worker -> executor, once, after loading its shard (pickled WorkerReady)
    EXECUTE = 1  # payload: SchedulerOutput; only the driver answers (or any rank that failed)
    SAMPLE = 2  # payload: GrammarOutput or nothing; sent to the driver only
    RPC = 3  # payload: pickled (method, args, kwargs); every rank answers
    SHUTDOWN = member.SHUTDOWN  # no answer; the worker exits


@dataclass
class WorkerReady:
    """What a worker reports once its shard is loaded."""

    rank: int
    pid: int
    model_info: Any  # baton.protocol.ModelInfo
    capabilities: Any  # baton.protocol.ModelCapabilities
