"""One rank of a tensor x pipeline parallel group, in whatever process an executor placed it.

The local executors start their ranks as ``WorkerGroup`` processes
(``baton.executor.worker_proc.worker_main``); an executor that places ranks itself
(baton-plugin-ray's actors, another launcher) builds the same rank from the same
parts, so every executor runs the same model runner and the same step protocol:

- ``rank_bootstraps(...)``: what each rank needs (its config, device and threads,
  the runner factory, the torch.distributed rendezvous, the engine's plugin set);
- ``host_store(host)``: the rendezvous (a ``TCPStore``) bound at a free port, for
  rank 0 to host where the other ranks can reach it (a local executor binds it
  on 127.0.0.1 itself);
- ``Rank(boot, store)``: checks that this process sees the engine's plugin set
  (the same check as every process baton starts), joins the process group (gloo
  on CPU, NCCL on CUDA; ``GLOO/NCCL_SOCKET_IFNAME=lo`` when the rendezvous is on
  the loopback), builds the ``Worker`` with the runner factory and loads this
  rank's shard; ``ready()`` is what it reports, ``serve(member)`` answers calls
  until SHUTDOWN or a closed channel;
- ``StepCodec``: the payloads of the calls (``baton.executor.wire.Kind``): a
  SchedulerOutput / GrammarOutput / ModelRunnerOutput in baton's msgpack codec,
  RPCs pickled.

``serve`` takes any ``member`` with ``recv(timeout)``, ``reply(kind, call_id,
payload)`` and ``reply_error(kind, call_id, text)`` (``baton.executor.member.Member``
is one). A step's error fails the executor (``reply_error``); an RPC's error fails
that call alone (the member's ``reply_call_error``). Every rank runs every step; only the driver (tp rank 0 of the last
stage) answers EXECUTE and SAMPLE; other ranks answer nothing but errors. A
driver whose step waits for a grammar bitmask (EXECUTE answered with no frames)
takes no further step until that SAMPLE arrives: a later step's update would
move the batch rows the pending sample reads.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import pickle
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from baton.config import BatonConfig
from baton.errors import BatonError, ExecutorError
from baton.executor import wire
from baton.executor.member import Message
from baton.executor.wire import Kind
from baton.plugins.moved import retired

log = logging.getLogger(__name__)

#: Steps kept for parallel_stats (a ring: the latest ones).
STATS_WINDOW = 4096


@dataclass
class RankBootstrap:
    """Everything one rank needs (pickled to its process)."""

    config: BatonConfig  # device and num_threads already set for this rank
    rank: int
    tp_size: int
    pp_size: int
    backend: str  # "gloo" | "nccl"
    store_port: int
    runner: Any  # a baton.interfaces.RunnerFactory (pickled by reference)
    parent_fingerprint: list[tuple[str, str, str, str]]
    dist_timeout_s: float
    #: Where the rendezvous TCPStore listens.
    store_host: str = "127.0.0.1"
    #: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME unless the environment sets them (None: leave
    #: them to the environment, as on several hosts).
    socket_ifname: str | None = "lo"


class RankMember(Protocol):
    """What ``Rank.serve`` reads calls from and answers through (``Member`` is one).

    Optional: ``reply_call_error(kind, call_id, text)`` (``Member.reply_call_error``), which
    fails one call alone; ``serve`` answers a failed RPC with it, and without it with
    ``reply_error``, which fails the executor."""

    def recv(self, timeout: float | None = None) -> Message | None: ...

    def reply(self, kind: int, call_id: int, payload: list[Any] | tuple[Any, ...] = ()) -> None: ...

    def reply_error(self, kind: int, call_id: int, text: str) -> None: ...


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def rank_config(
    config: BatonConfig,
    world_size: int,
    device: str,
    cuda_index: int | None,
    rank: int,
    num_threads: int | None = None,
) -> BatonConfig:
    """``config`` for one rank: its device (``cuda:<cuda_index>``, default ``cuda:<rank>``)
    and on CPU its threads (``num_threads``, default an equal share of this machine's cores)."""
    threads = config.executor.num_threads or num_threads
    if threads is None and device == "cpu":  # the ranks share the cores
        threads = max(1, len(os.sched_getaffinity(0)) // world_size)
    index = rank if cuda_index is None else cuda_index
    return config.replace(
        **{
            "executor.device": f"cuda:{index}" if device == "cuda" else "cpu",
            "executor.num_threads": threads,
        }
    )


def rank_bootstraps(
    config: BatonConfig,
    tp_size: int,
    pp_size: int,
    *,
    runner: Any,
    backend: str,
    device: str,
    store_port: int,
    store_host: str = "127.0.0.1",
    dist_timeout_s: float = 600.0,
    cuda_index: int | None = None,
    num_threads: int | None = None,
) -> list[RankBootstrap]:
    """Each rank's RankBootstrap, in rank order (``rank = pp_rank * tp_size + tp_rank``).

    ``device``: "cpu" or "cuda"; on CUDA rank r takes ``cuda:r``, or ``cuda:<cuda_index>``
    for every rank (one visible device per process, as Ray gives its actors).
    ``num_threads``: torch threads per rank on CPU when ``executor.num_threads`` is unset
    (default: this machine's cores shared by the ranks). The plugin set checked on every
    rank is this process's.
    """
    from baton.plugins.registry import get_registry

    world = tp_size * pp_size
    fingerprint = get_registry().fingerprint()
    return [
        RankBootstrap(
            config=rank_config(config, world, device, cuda_index, rank, num_threads),
            rank=rank,
            tp_size=tp_size,
            pp_size=pp_size,
            backend=backend,
            store_port=store_port,
            runner=runner,
            parent_fingerprint=fingerprint,
            dist_timeout_s=dist_timeout_s,
            store_host=store_host,
            socket_ifname="lo" if is_loopback(store_host) else None,
        )
        for rank in range(world)
    ]


def host_store(host: str, timeout_s: float = 600.0) -> Any:
    """The rendezvous: a ``torch.distributed.TCPStore`` server at a free port (its ``port``),
    for ``host``'s peers; hand it to rank 0's ``Rank(boot, store)``."""
    import torch.distributed as dist

    return dist.TCPStore(
        host, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def _check_plugin_set(parent_fingerprint: list[tuple[str, str, str, str]], who: str) -> None:
    """BatonError when this process's plugins differ from the engine's (``who`` names it)."""
    from baton.plugins.registry import get_registry

    ours = get_registry().fingerprint()  # plugins load in every process baton starts
    if [tuple(x) for x in parent_fingerprint] != ours:
        theirs = {tuple(x) for x in parent_fingerprint}
        raise BatonError(
            f"{who} sees other plugins than the engine: only in engine "
            f"{sorted(theirs - set(ours))}, only in worker {sorted(set(ours) - theirs)}; "
            "install the same plugins in one environment"
        )


def _check_rpc_method(method: str | Callable[..., Any]) -> None:
    """ExecutorError when ``method`` names no Worker method (a typo must not fail every rank)."""
    if isinstance(method, str):
        from baton.worker.worker import Worker

        if not callable(getattr(Worker, method, None)):
            raise ExecutorError(f"the worker has no method {method!r}")


class StepCodec:
    """The payloads of the calls to the ranks, encoded once on the executor's side.

    Not thread-safe: one per thread, or under a lock."""

    def __init__(self) -> None:
        from baton.protocol import ModelRunnerOutput
        from baton.serial import MsgpackDecoder, MsgpackEncoder

        self._encoder = MsgpackEncoder()
        self._out_decoder = MsgpackDecoder(ModelRunnerOutput)

    def encode_step(self, scheduler_output: Any) -> list[Any]:
        """A SchedulerOutput's frames (EXECUTE), or a GrammarOutput's (SAMPLE)."""
        return self._encoder.encode(scheduler_output)

    encode_grammar = encode_step

    def decode_output(self, frames: list[Any]) -> Any:
        """The driver's answer to EXECUTE / SAMPLE: a ModelRunnerOutput, or None (no frames:
        the step waits for ``sample_tokens``)."""
        return self._out_decoder.decode(frames) if frames else None

    @staticmethod
    def encode_rpc(
        method: str | Callable[..., Any], args: tuple = (), kwargs: dict | None = None
    ) -> list[bytes]:
        """An RPC's frames; ExecutorError first when ``method`` names no Worker method (a typo
        must not fail every rank)."""
        _check_rpc_method(method)
        return [pickle.dumps((method, tuple(args), kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)]

    @staticmethod
    def decode_rpc(frames: list[Any]) -> Any:
        return pickle.loads(frames[0]) if frames else None


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


class Rank:
    """One rank in this process: its distributed context and its Worker (module docstring)."""

    def __init__(self, boot: RankBootstrap, store: Any = None) -> None:
        self.boot = boot
        self.rank = boot.rank
        _check_plugin_set(boot.parent_fingerprint, f"worker {self.rank}")
        self.ctx = self._init_distributed(store)
        from baton.worker.worker import Worker

        self.worker = Worker(boot.config, rank=self.rank, runner=boot.runner)
        self.worker.init_device()
        self.worker.load_model()
        self._deferred: deque[Message] = deque()
        self._awaiting_sample = False
        self._closed = False

    def _init_distributed(self, store: Any) -> Any:
        import torch.distributed as dist

        from baton.parallel.context import ParallelContext, set_parallel_context
        from baton.worker.worker import select_device

        b = self.boot
        if b.socket_ifname and sys.platform.startswith("linux"):
            # rendezvous and collectives on that interface (the loopback for one machine)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", b.socket_ifname)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", b.socket_ifname)
        device = select_device(b.config.executor.device)
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)
        timeout = timedelta(seconds=b.dist_timeout_s)
        if store is None:
            store = dist.TCPStore(b.store_host, b.store_port, None, False, timeout=timeout)
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

    def ready(self) -> wire.WorkerReady:
        """What this rank reports once its shard is loaded."""
        return wire.WorkerReady(
            rank=self.rank,
            pid=os.getpid(),
            model_info=self.worker.get_model_info(),
            capabilities=self.worker.get_model_capabilities(),
        )

    # ------------------------------------------------------------------ calls

    def serve(self, member: RankMember) -> None:
        """Answer ``member``'s calls in order until SHUTDOWN; the member's BatonError (its
        channel closed) ends it too, raised."""
        from baton.protocol import GrammarOutput, SchedulerOutput
        from baton.serial import MsgpackDecoder, MsgpackEncoder

        self._encoder = MsgpackEncoder()
        self._so_decoder = MsgpackDecoder(SchedulerOutput)
        self._grammar_decoder = MsgpackDecoder(GrammarOutput)
        while True:
            if self._deferred and not self._awaiting_sample:
                msg = self._deferred.popleft()
                waited_since = float("inf")
            else:
                waited_since = time.monotonic()
                got = member.recv(timeout=0.5)
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
                answer = self.handle(Kind(kind), payload, delivery)
                if answer is not None:
                    member.reply(kind, call_id, answer)
            except Exception as e:
                call_error = getattr(member, "reply_call_error", None)
                if kind == Kind.RPC and call_error is not None:  # that call fails, not the rank
                    log.warning(
                        "worker %d: collective_rpc failed: %s: %s", self.rank, type(e).__name__, e
                    )
                    call_error(kind, call_id, f"{type(e).__name__}: {e}")
                    continue
                # reported; the executor fails and shuts every rank down
                text = f"worker {self.rank} ({type(e).__name__}): {e}"
                log.error("%s\n%s", text, "".join(traceback.format_exception(e)))
                member.reply_error(kind, call_id, text)

    def handle(self, kind: Kind, payload: list[Any], delivery: float | None = None) -> Any:
        """Run one call; the answer's frames, or None when this rank does not answer it."""
        if kind == Kind.EXECUTE:
            return self._execute(payload, delivery)
        if kind == Kind.SAMPLE:
            grammar = self._grammar_decoder.decode(payload) if payload else None
            self._awaiting_sample = False
            return self._encoder.encode(self.worker.sample_tokens(grammar))
        if kind == Kind.RPC:
            method, args, kwargs = pickle.loads(payload[0])
            if isinstance(method, str):
                fn = getattr(self.worker, method, None)
                if fn is None or not callable(fn):
                    raise ExecutorError(f"the worker has no method {method!r}")
                result = fn(*args, **kwargs)
            else:
                result = method(self.worker, *args, **kwargs)
            return [pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)]
        raise ExecutorError(f"unknown message kind {kind}")

    def _execute(self, payload: list[Any], delivery: float | None) -> Any:
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
            return None
        if out is None:
            self._awaiting_sample = True
            return []
        return self._encoder.encode(out)

    def close(self) -> None:
        """Leave the process group (once)."""
        import torch.distributed as dist

        if self._closed:
            return
        self._closed = True
        try:
            self.ctx.wait_sends()
            if dist.is_initialized():
                dist.destroy_process_group()
        except RuntimeError as e:  # a peer died: its connections are gone, nothing left to flush
            log.info("worker %d: closing the process group: %s", self.rank, e)


__getattr__ = retired(
    __name__,
    {
        "check_rpc_method": ("_check_rpc_method", "StepCodec.encode_rpc checks the method"),
        "check_plugin_set": ("_check_plugin_set", "Rank(boot, store) checks the plugin set"),
    },
)
