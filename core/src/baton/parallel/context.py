"""Where a worker sits in a tensor x pipeline parallel group, and its timed collectives.

Ranks are laid out stage-major: ``rank = pp_rank * tp_size + tp_rank``. The
tensor-parallel group of a stage is its ``tp_size`` consecutive ranks; stage
``s`` hands its hidden states to the same tp rank of stage ``s + 1``. The
driver (the rank whose sampled tokens the executor returns) is tp rank 0 of the
last stage.

Every collective and point-to-point transfer of a worker goes through the
context, which times it (``CommTimers``): the executor reports the time per step
spent in all-reduce, gather and send/recv (``MultiprocExecutor.parallel_stats``).
On CUDA the NCCL calls are asynchronous, so the timers only count their launch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from baton.errors import ExecutorError


@dataclass
class CommTimers:
    """Seconds spent in each kind of communication since the last ``take``."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


@dataclass
class ParallelContext:
    """One worker's ranks and groups; the process-wide instance is ``get_parallel_context()``."""

    tp_size: int
    pp_size: int
    rank: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: The stage's tensor-parallel group (None while tp_size == 1 or before ``init_groups``).
    tp_group: Any = None
    timers: CommTimers = field(default_factory=CommTimers)
    #: Sends not yet known to be complete: (work, tensor kept alive until then).
    _sends: deque[tuple[Any, torch.Tensor]] = field(default_factory=deque)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """Samples and answers execute_model: tp rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    @staticmethod
    def driver_rank(tp_size: int, pp_size: int) -> int:
        return (pp_size - 1) * tp_size

    def init_groups(self) -> None:
        """Create every stage's tensor-parallel group (all ranks must call this, in the same order)."""
        for stage in range(self.pp_size):
            ranks = list(range(stage * self.tp_size, (stage + 1) * self.tp_size))
            group = dist.new_group(ranks) if self.tp_size > 1 else None
            if stage == self.pp_rank:
                self.tp_group = group

    # ------------------------------------------------------------------ tensor parallel

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` in place over the stage's tensor-parallel ranks."""
        if self.tp_size == 1:
            return t
        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.tp_group)
        self.timers.add("all_reduce", time.perf_counter() - t0)
        return t

    def sum_in_rank_order(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every tp rank's ``t``, added in rank order ((t0 + t1) + t2 ...) on every
        rank: each element's sum has one order whatever the tensor's length (batch-invariant
        mode). A ring all-reduce's order depends on which chunk of the buffer an element falls
        in, so on the buffer's length, from three ranks on."""
        if self.tp_size == 1:
            return t
        t = t.contiguous()
        t0 = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t, group=self.tp_group)
        self.timers.add("all_gather", time.perf_counter() - t0)
        out = parts[0]
        for p in parts[1:]:
            out.add_(p)
        return out

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every tp rank's ``t`` along the last dimension, on tp rank 0 only (else None)."""
        if self.tp_size == 1:
            return t
        t = t.contiguous()
        t0 = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(t, parts, group=self.tp_group, group_dst=0)
        self.timers.add("gather", time.perf_counter() - t0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    # ------------------------------------------------------------------ pipeline parallel

    def send_next_stage(self, t: torch.Tensor) -> None:
        """Hand ``t`` to the same tp rank of the next stage without waiting for it to arrive."""
        t = t.contiguous()
        t0 = time.perf_counter()
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()
        self._sends.append((dist.isend(t, self.rank + self.tp_size), t))
        while len(self._sends) > self.pp_size:  # bound what is kept alive
            self._sends.popleft()[0].wait()
        self.timers.add("send", time.perf_counter() - t0)

    def recv_prev_stage(self, out: torch.Tensor) -> torch.Tensor:
        """Receive the previous stage's tensor into ``out`` (its shape is known from the step)."""
        t0 = time.perf_counter()
        dist.recv(out, self.rank - self.tp_size)
        self.timers.add("recv", time.perf_counter() - t0)
        return out

    def wait_sends(self) -> None:
        while self._sends:
            self._sends.popleft()[0].wait()


_context: ParallelContext | None = None


def set_parallel_context(ctx: ParallelContext | None) -> None:
    global _context
    _context = ctx


def get_parallel_context() -> ParallelContext:
    """The worker process's context; ExecutorError outside a parallel worker."""
    if _context is None:
        raise ExecutorError(
            "no parallel context: this runner only runs in a worker started by a parallel executor"
        )
    return _context
