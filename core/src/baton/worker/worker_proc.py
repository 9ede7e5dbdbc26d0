"""A worker process of a multiprocess executor: one rank of a tensor x pipeline parallel group.

It is the target of the executor's ``WorkerGroup`` (baton.executor.group).
Start-up: join the group (heartbeat, this rank's end of the channel) -> check the
plugin set against the parent's -> join the torch.distributed group (gloo on CPU, NCCL
on CUDA; rendezvous at the executor's TCPStore on 127.0.0.1) -> build the
Worker with the executor's runner factory and load this rank's shard -> READY.
Then serve the calls in order (``baton.executor.wire``) until SHUTDOWN.

Every rank runs every step; only the driver (tp rank 0 of the last stage)
answers EXECUTE and SAMPLE. A driver whose step waits for a grammar bitmask
(EXECUTE answered None) takes no further step until that SAMPLE arrives: a
later step's update would move the batch rows the pending sample reads.

The worker exits when the executor closes the channel, when its parent
process is gone (a watchdog thread checks ``os.getppid()``, also while the main
thread is stuck in a collective), and on SHUTDOWN. The same thread writes the
rank's heartbeat (``baton.executor.heartbeat``), which the executor watches for
a stopped or frozen process.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from baton.config import BatonConfig
from baton.errors import BatonError, ExecutorError
from baton.executor import wire
from baton.executor.member import Member, MemberLink, Message
from baton.executor.wire import Kind
from baton.process_exit import exit_now

log = logging.getLogger(__name__)

#: Steps kept for parallel_stats (a ring: the latest ones).
STATS_WINDOW = 4096


@dataclass
class WorkerBootstrap:
    """Everything a worker process needs (pickled to the spawned process)."""

    config: BatonConfig  # device and num_threads already set for this rank
    rank: int
    tp_size: int
    pp_size: int
    backend: str  # "gloo" | "nccl"
    store_port: int
    runner: Any  # a baton.interfaces.RunnerFactory (pickled by reference)
    parent_fingerprint: list[tuple[str, str, str, str]]
    dist_timeout_s: float


class StepStats:
    """Per-step timings of this rank (seconds) and when each step ran, for ``parallel_stats``."""

    def __init__(self) -> None:
        self.steps: deque[dict[str, float]] = deque(maxlen=STATS_WINDOW)
        #: (step_id, start, end) in time.monotonic(), comparable across the processes of one machine
        self.timeline: deque[tuple[int, float, float]] = deque(maxlen=STATS_WINDOW)

    def record(self, step_id: int, start: float, end: float, row: dict[str, float]) -> None:
        self.steps.append(row)
        self.timeline.append((step_id, start, end))

    def summary(self) -> dict[str, Any]:
        """Per kind: how many steps had it, and its median and mean in microseconds."""
        import statistics

        keys = sorted({k for row in self.steps for k in row})
        out: dict[str, Any] = {"steps": len(self.steps)}
        for k in keys:
            vals = [row[k] for row in self.steps if k in row]
            out[k] = {
                "n": len(vals),
                "median_us": statistics.median(vals) * 1e6,
                "mean_us": statistics.fmean(vals) * 1e6,
            }
        return out


_stats = StepStats()


def parallel_stats(worker: Any, timeline: bool = False) -> dict[str, Any]:
    """collective_rpc target: this rank's per-step timings (broadcast delivery, collectives, step);
    with ``timeline``, also (step_id, start, end) of each step."""
    from baton.parallel.context import get_parallel_context

    ctx = get_parallel_context()
    runner = worker.model_runner
    return {
        "rank": ctx.rank,
        "tp_rank": ctx.tp_rank,
        "pp_rank": ctx.pp_rank,
        "pid": os.getpid(),
        "kv_cache_bytes": sum(  # the stock runner's; 0 for a runner that keeps none there
            c.numel() * c.element_size() for c in getattr(runner, "kv_caches", ()) if c is not None
        ),
        **_stats.summary(),
        **({"timeline": list(_stats.timeline)} if timeline else {}),
    }


def reset_parallel_stats(worker: Any) -> None:
    """collective_rpc target: forget the timings recorded so far."""
    _stats.steps.clear()
    _stats.timeline.clear()


class WorkerProc:
    """One rank: its end of the group's channel, its distributed context and its Worker."""

    def __init__(self, boot: WorkerBootstrap, member: Member) -> None:
        from baton.plugins import get_registry

        self.boot = boot
        self.member = member
        self.rank = boot.rank
        registry = get_registry()  # plugins load in every process the kernel spawns
        ours = registry.fingerprint()
        if [tuple(x) for x in boot.parent_fingerprint] != ours:
            theirs = {tuple(x) for x in boot.parent_fingerprint}
            raise BatonError(
                f"worker {self.rank} sees other plugins than the engine: only in engine "
                f"{sorted(theirs - set(ours))}, only in worker {sorted(set(ours) - theirs)}; "
                "install the same plugins in one environment"
            )
        self.ctx = self._init_distributed()
        from baton.worker.worker import Worker

        self.worker = Worker(boot.config, rank=self.rank)
        self.worker.runner_cls = boot.runner
        self.worker.init_device()
        self.worker.load_model()
        self._encoder = self._decoders = None
        self._deferred: deque[Message] = deque()
        self._awaiting_sample = False

    def _init_distributed(self) -> Any:
        import torch.distributed as dist

        from baton.parallel.context import ParallelContext, set_parallel_context
        from baton.worker.worker import select_device

        b = self.boot
        if sys.platform.startswith("linux"):  # rendezvous and collectives on the loopback only
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        device = select_device(b.config.executor.device)
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)
        timeout = timedelta(seconds=b.dist_timeout_s)
        store = dist.TCPStore("127.0.0.1", b.store_port, None, False, timeout=timeout)
        dist.init_process_group(
            b.backend,
            store=dist.PrefixStore("baton", store),
            rank=b.rank,
            world_size=b.tp_size * b.pp_size,
            timeout=timeout,
        )
        ctx = ParallelContext(tp_size=b.tp_size, pp_size=b.pp_size, rank=b.rank, device=device)
        ctx.init_groups()
        set_parallel_context(ctx)
        return ctx

    # ------------------------------------------------------------------ messages

    def _send(self, kind: Kind, call_id: int, payload: list[Any]) -> None:
        self.member.reply(kind, call_id, payload)

    def _fail(self, kind: int, call_id: int, error: BaseException) -> None:
        text = f"worker {self.rank} ({type(error).__name__}): {error}"
        log.error("%s\n%s", text, "".join(traceback.format_exception(error)))
        self.member.reply_error(kind, call_id, text)

    def serve(self) -> None:
        from baton.protocol import GrammarOutput, ModelRunnerOutput, SchedulerOutput
        from baton.serial import MsgpackDecoder, MsgpackEncoder

        self._encoder = MsgpackEncoder()
        self._so_decoder = MsgpackDecoder(SchedulerOutput)
        self._grammar_decoder = MsgpackDecoder(GrammarOutput)
        self._out_type = ModelRunnerOutput
        while True:
            if self._deferred and not self._awaiting_sample:
                msg = self._deferred.popleft()
                waited_since = float("inf")
            else:
                waited_since = time.monotonic()
                got = self.member.recv(timeout=0.5)
                if got is None:
                    continue
                msg = got
            kind, call_id, sent_at, payload = msg
            if kind == Kind.SHUTDOWN:
                return
            if kind == Kind.EXECUTE and self._awaiting_sample:
                self._deferred.append(msg)  # after the pending step's SAMPLE
                continue
            delivery = time.monotonic() - sent_at if waited_since <= sent_at else None
            try:
                self._handle(Kind(kind), call_id, payload, delivery)
            except Exception as e:  # reported; the executor fails and shuts every rank down
                self._fail(kind, call_id, e)

    def _handle(self, kind: Kind, call_id: int, payload: list[Any], delivery: float | None) -> None:
        if kind == Kind.EXECUTE:
            self._execute(call_id, payload, delivery)
        elif kind == Kind.SAMPLE:
            grammar = self._grammar_decoder.decode(payload) if payload else None
            self._awaiting_sample = False
            out = self.worker.sample_tokens(grammar)
            self._send(Kind.SAMPLE, call_id, self._encoder.encode(out))
        elif kind == Kind.RPC:
            method, args, kwargs = pickle.loads(payload[0])
            if isinstance(method, str):
                fn = getattr(self.worker, method, None)
                if fn is None or not callable(fn):
                    raise ExecutorError(f"the worker has no method {method!r}")
                result = fn(*args, **kwargs)
            else:
                result = method(self.worker, *args, **kwargs)
            self._send(Kind.RPC, call_id, [pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)])
        else:
            raise ExecutorError(f"unknown message kind {kind}")

    def _execute(self, call_id: int, payload: list[Any], delivery: float | None) -> None:
        so = self._so_decoder.decode(payload)
        timers = self.ctx.timers
        timers.take()
        start = time.monotonic()
        out = self.worker.execute_model(so)
        end = time.monotonic()
        row = {"step": end - start, **timers.take()}
        if delivery is not None:
            row["broadcast_delivery"] = delivery
        if so.total_num_scheduled_tokens:
            _stats.record(so.step_id, start, end, row)
        if not self.ctx.is_driver:
            if out is None:  # only the driver samples: drop this rank's pending step
                self.worker.sample_tokens(None)
            return
        if out is None:
            self._awaiting_sample = True
            self._send(Kind.EXECUTE, call_id, [])
        else:
            self._send(Kind.EXECUTE, call_id, self._encoder.encode(out))

    def close(self) -> None:
        import torch.distributed as dist

        try:
            self.ctx.wait_sends()
            if dist.is_initialized():
                dist.destroy_process_group()
        except RuntimeError as e:  # a peer died: its connections are gone, nothing left to flush
            log.info("worker %d: closing the process group: %s", self.rank, e)
        finally:
            self.member.close()


def worker_main(link: MemberLink, boot: WorkerBootstrap) -> None:
    """Entry point of a worker process (``WorkerGroup.start``'s target)."""
    cfg = boot.config
    logging.basicConfig(
        level=cfg.observability.log_level,
        format=f"%(asctime)s %(levelname)s worker{boot.rank} %(name)s: %(message)s",
    )
    member = link.join()
    try:
        proc = WorkerProc(boot, member)
        member.ready(
            wire.WorkerReady(
                rank=boot.rank,
                pid=os.getpid(),
                model_info=proc.worker.get_model_info(),
                capabilities=proc.worker.get_model_capabilities(),
            )
        )
    except BaseException as e:
        text = f"worker {boot.rank} failed to start: {type(e).__name__}: {e}"
        log.error("%s\n%s", text, "".join(traceback.format_exception(e)))
        try:
            member.reply_error(Kind.READY, 0, text)
            time.sleep(0.1)  # let the frame leave before the channel closes
        finally:
            member.close()
        raise SystemExit(1) from None
    try:
        proc.serve()
    except BatonError as e:  # the executor closed the channel or exited
        log.info("worker %d: channel closed (%s); exiting", boot.rank, e)
    finally:
        proc.close()
    exit_now(0)
