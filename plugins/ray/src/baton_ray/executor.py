"""Executor ``ray``: the ranks of a tensor x pipeline parallel group as Ray actors.

Start-up: join (or start) Ray -> a placement group of ``tp * pp`` bundles (one
per rank: ``num_cpus``, ``num_gpus``, custom ``resources``; ``placement_strategy``)
-> one ``RankActor`` per bundle -> rank 0 binds the torch.distributed rendezvous
on its node (``ray.util.get_node_ip_address()``, a free port) -> every rank
builds ``baton.executor.rank.Rank`` (plugin set checked against this process's,
process group joined there: gloo on CPU, NCCL on CUDA; the runner is
``baton.parallel.hooks.parallel_runner(tp, pp)``, the local executors' own) and
reports READY.

A step's SchedulerOutput is encoded once and put in Ray's object store once
(``ray.put``); every rank gets the same reference (the broadcast), only the
driver's answer comes back. ``max_concurrent_batches = pipeline_parallel_size``
(the core's batch queue); a chained step's Future is resolved on a thread of its
own, so the core's callback that calls ``sample_tokens`` never blocks the
thread that resolves the sample.

Failure: a rank that dies (its actor or its node), reports an error, leaves its
ping unanswered for ``heartbeat_timeout`` seconds or a step unanswered for
``step_timeout`` seconds fails the executor: pending calls raise ExecutorError,
the failure callbacks run once, later calls raise. A ``collective_rpc`` target
that raises fails that call alone (as ``MultiprocExecutor``'s). ``shutdown`` stops the
ranks, kills the actors, removes the placement group and stops Ray if it
started it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from baton.config import BatonConfig
from baton.errors import ExecutorError, worker_error
from baton.executor.calls import Call, CallBook
from baton.executor.group_executor import GroupExecutor
from baton.executor.rank import StepCodec, rank_bootstraps
from baton.executor.wire import Kind
from baton.interfaces import RunnerFactory
from baton.parallel.hooks import check_parallel_model, parallel_runner
from baton_ray.cluster import actor_env, bundle, connect, describe_resources
from baton_ray.plugin import RaySettings

log = logging.getLogger(__name__)

#: Seconds between two pings of a rank, and between two looks at the step deadlines.
PING_INTERVAL = 0.5
WATCH_INTERVAL = 0.1


#: A rank's answer status for a call that failed there alone (the ``Inbox`` sends it).
CALL_FAILED = "call_error"


class RayExecutor(GroupExecutor):
    """Implements ``baton.interfaces.Executor`` with Ray actors (see the module docstring).

    ``runner`` replaces the ranks' runner factory (default: the stock runner, sharded
    and cut into stages as the local ``cuda-tp`` and ``pipeline`` executors do).
    """

    name = "ray"

    def __init__(
        self,
        config: BatonConfig,
        settings: RaySettings | None = None,
        runner: RunnerFactory | None = None,
    ) -> None:
        self.config = config
        self.settings = settings or RaySettings()
        ex = config.executor
        self.tp_size, self.pp_size = ex.tensor_parallel_size, ex.pipeline_parallel_size
        self.world_size = self.tp_size * self.pp_size
        self.driver = (self.pp_size - 1) * self.tp_size
        self.max_concurrent_batches = self.pp_size
        check_parallel_model(config, self.tp_size, self.pp_size)  # before anything starts
        self.runner: RunnerFactory = runner or parallel_runner(self.tp_size, self.pp_size)
        self.id = uuid.uuid4().hex[:8]
        self.model_info: Any = None
        self.model_capabilities: Any = None
        #: Seconds each step's broadcast took here: encode, put in the object store, submit.
        self.broadcast_s: deque[float] = deque(maxlen=4096)
        #: The rank actors' process ids (on their nodes), in rank order.
        self.pids: list[int] = []
        self.actors: list[Any] = []
        self.placement_group: Any = None
        self.started_ray = False
        #: The pending calls, settled once (answers arrive on Ray's threads: decoded one at a
        #: time); the completer thread of chained ones.
        self._calls = CallBook(
            self.name,
            kind_names={k: k.name.lower() for k in Kind},
            hangs="a rank hangs (executor step_timeout)",
            serial_decode=True,
        )
        self._latch = self._calls.latch
        self._codec = StepCodec()
        self._encode_lock = threading.Lock()
        self._submit_lock = threading.Lock()  # sequence numbers: every rank sees one order
        self._seq: list[int] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ray: Any = None
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start-up

    def _start(self) -> None:
        s = self.settings
        t0 = time.monotonic()
        self.started_ray = connect(s.address, s.namespace, self.world_size * s.num_cpus)
        import ray

        self._ray = ray
        device = self._device(ray)
        num_gpus = s.num_gpus if s.num_gpus is not None else (1.0 if device == "cuda" else 0.0)
        self._place(num_gpus)
        t_placed = time.monotonic()
        self._start_actors(num_gpus)
        self._seq = [0] * self.world_size
        host, port = self._get(
            self.actors[0].host_store.remote(s.dist_timeout), "rank 0's rendezvous"
        )
        t_actors = time.monotonic()
        backend = s.backend if s.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
        boots = rank_bootstraps(
            self.config,
            self.tp_size,
            self.pp_size,
            runner=self.runner,
            backend=backend,
            device=device,
            store_port=port,
            store_host=host,
            dist_timeout_s=s.dist_timeout,
            cuda_index=0,  # Ray shows each actor its own GPU(s) only
            num_threads=max(1, int(s.num_cpus)),
        )
        infos = self._start_ranks(boots)
        self.pids = [i.pid for i in infos]
        self.model_info = infos[self.driver].model_info
        self.model_capabilities = infos[self.driver].capabilities
        self._calls.start()
        watch = threading.Thread(target=self._watch_loop, name="baton-ray-watch", daemon=True)
        watch.start()
        self._threads.append(watch)
        now = time.monotonic()
        #: Seconds start-up took: Ray and the placement group, the actors up, the ranks loaded.
        self.startup_s = {
            "placement": round(t_placed - t0, 2),
            "actors": round(t_actors - t_placed, 2),
            "ranks": round(now - t_actors, 2),
        }
        log.info(
            "ray: %d ranks ready (tp=%d, pp=%d, %s, rendezvous %s:%d, pids %s) in %s s",
            self.world_size,
            self.tp_size,
            self.pp_size,
            backend,
            host,
            port,
            self.pids,
            self.startup_s,
        )

    def _place(self, num_gpus: float) -> None:
        """Reserve one bundle per rank (``placement_strategy``); ExecutorError when the cluster
        cannot place them within ``placement_timeout``."""
        from ray.util.placement_group import placement_group

        s, ray = self.settings, self._ray
        one = bundle(s.num_cpus, num_gpus, s.resources)
        self.placement_group = placement_group(
            [one] * self.world_size, strategy=s.placement_strategy, name=f"baton-ray-{self.id}"
        )
        ready, _ = ray.wait([self.placement_group.ready()], timeout=s.placement_timeout)
        if not ready:
            raise ExecutorError(
                f"executor 'ray': the cluster could not place {self.world_size} bundles of "
                f"{one} ({s.placement_strategy}) within {s.placement_timeout} s; "
                f"{describe_resources(ray)}"
            )

    def _start_actors(self, num_gpus: float) -> None:
        """One ``RankActor`` per bundle of the placement group, in rank order."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from baton_ray.actor import RankActor

        s = self.settings
        env = actor_env(s.env)
        level = self.config.observability.log_level
        self.actors = [
            RankActor.options(
                num_cpus=s.num_cpus,
                num_gpus=num_gpus,
                resources=dict(s.resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
                name=f"baton-ray-{self.id}-rank{rank}",
                namespace=s.namespace,
                max_restarts=0,
                max_task_retries=0,
            ).remote(env, level, s.nice)
            for rank in range(self.world_size)
        ]

    def _device(self, ray: Any) -> str:
        device = self.config.executor.device
        if device == "cpu" or device.startswith("cuda"):
            return "cpu" if device == "cpu" else "cuda"
        if device != "auto":
            raise ExecutorError(
                f"executor 'ray': executor.device={device!r}: use auto, cpu or cuda"
            )
        want = self.world_size * (self.settings.num_gpus or 1.0)
        return "cuda" if ray.cluster_resources().get("GPU", 0.0) >= want else "cpu"

    def _get(self, ref: Any, what: str) -> Any:
        ready, _ = self._ray.wait([ref], timeout=self.settings.startup_timeout)
        if not ready:
            raise ExecutorError(
                f"executor 'ray': timed out after {self.settings.startup_timeout} s waiting for {what}"
            )
        try:
            return self._ray.get(ref)
        except Exception as e:
            raise ExecutorError(f"executor 'ray': {what} failed: {e}") from e

    def _start_ranks(self, boots: list[Any]) -> list[Any]:
        ray = self._ray
        refs = {
            a.start.remote(b): r for r, (a, b) in enumerate(zip(self.actors, boots, strict=True))
        }
        infos: dict[int, Any] = {}
        deadline = time.monotonic() + self.settings.startup_timeout
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(refs[r] for r in pending)
                raise ExecutorError(
                    f"executor 'ray': ranks {missing} did not start within "
                    f"{self.settings.startup_timeout} s (startup_timeout)"
                )
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0))
            for ref in ready:
                rank = refs[ref]
                try:
                    status, value = ray.get(ref)
                except Exception as e:  # the actor died
                    raise ExecutorError(f"executor 'ray': worker {rank} died starting: {e}") from e
                if status != "ok":
                    raise ExecutorError(str(value))
                infos[rank] = value
        return [infos[r] for r in range(self.world_size)]

    # ------------------------------------------------------------------ calls

    def _call(
        self,
        kind: Kind,
        payload: Any,
        *,
        to: list[int] | None = None,
        reply_from: int | None = None,
        decode: Callable[[list[Any]], Any] = StepCodec.decode_rpc,
        fail_after: float | None = None,
        chained: bool = False,
    ) -> Future[Any]:
        """Send ``payload`` (frames, or an ObjectRef of them) to the ranks ``to`` (default all):
        a Future of their answers in rank order, or of ``reply_from``'s alone."""
        ranks = list(range(self.world_size)) if to is None else to
        call = self._calls.new(
            kind,
            ranks,
            decode=decode,
            reply_from=reply_from,
            fail_after=fail_after,
            chained=chained,
        )
        wall = time.time()
        try:
            with self._submit_lock:
                refs = []
                for r in ranks:
                    seq = self._seq[r]
                    self._seq[r] += 1
                    want = r in call.expect
                    ref = self.actors[r].call.remote(seq, int(kind), payload, want, wall)
                    if want:
                        refs.append((r, ref))
        except Exception as e:
            self._fail(ExecutorError(f"cannot reach a rank: {e}"))
            raise ExecutorError(f"the ray executor cannot reach a rank: {e}") from e
        for r, ref in refs:
            ref.future().add_done_callback(functools.partial(self._on_answer, call, r))
        return call.future

    def _on_answer(self, call: Call, rank: int, done: Future[Any]) -> None:
        """A rank's answer (on Ray's thread): settle the call once every rank answered."""
        try:
            status, value = done.result()
        except Exception as e:  # the actor or its node died, or the call could not run
            self._fail(ExecutorError(f"worker {rank} died: {type(e).__name__}: {e}"))
            return
        if status == CALL_FAILED:  # this call alone fails, at its first error
            self._calls.fail_call(call.id, worker_error(rank, str(value)))
        elif status != "ok":
            self._fail(ExecutorError(str(value)))
        else:
            self._calls.answer(call, rank, value)

    # ------------------------------------------------------------------ GroupExecutor

    def _book(self) -> CallBook:
        return self._calls

    def _step_payload(self, frames: list[Any]) -> Any:
        return self._put(frames)

    def _put(self, frames: list[Any]) -> Any:
        """The step's frames in the object store once (``ray.put``), for every rank; a step
        under ``broadcast_inline_max`` bytes (or a single rank): the frames themselves, copied
        into each rank's call, which costs less than a put and a fetch from the store."""
        size = sum(memoryview(f).nbytes for f in frames)
        if self.world_size == 1 or size < self.settings.broadcast_inline_max:
            return frames
        try:
            return self._ray.put(frames)
        except Exception as e:
            self._fail(ExecutorError(f"cannot put the step in Ray's object store: {e}"))
            raise ExecutorError(f"the ray executor failed: {e}") from e

    def worker_pids(self) -> list[int]:
        return list(self.pids)

    def check_health(self) -> None:
        self._latch.check()

    # ------------------------------------------------------------------ failure

    def _fail(self, error: BaseException) -> None:
        """The first failure wins: pending calls raise ExecutorError, the callbacks run once."""
        self._calls.fail(error)

    def _watch_loop(self) -> None:
        """Ping every rank (its monitor thread answers); fail on a death, a reported error, a
        silence over heartbeat_timeout, or a step past its step_timeout."""
        ray = self._ray
        limit = self.settings.heartbeat_timeout
        pings: dict[Any, tuple[int, float]] = {}
        next_ping = [0.0] * self.world_size
        while not self._stop.is_set():
            now = time.monotonic()
            busy = {r for r, _ in pings.values()}
            for r, actor in enumerate(self.actors):
                if r not in busy and now >= next_ping[r]:
                    try:
                        pings[actor.ping.remote()] = (r, now)
                    except Exception as e:
                        self._fail(ExecutorError(f"worker {r} cannot be reached: {e}"))
                        return
            if not pings:
                self._stop.wait(WATCH_INTERVAL)
                continue
            ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=WATCH_INTERVAL)
            if self._stop.is_set():
                return
            now = time.monotonic()
            for ref in ready:
                r, sent = pings.pop(ref)
                next_ping[r] = sent + PING_INTERVAL
                try:
                    error = ray.get(ref)
                except Exception as e:
                    self._fail(ExecutorError(f"worker {r} died: {type(e).__name__}: {e}"))
                    return
                if error:
                    self._fail(ExecutorError(error))
                    return
            silent = [(r, now - sent) for r, sent in pings.values() if now - sent > limit]
            if silent:
                r, quiet = silent[0]
                self._fail(
                    ExecutorError(
                        f"worker {r} (pid {self.pids[r]}) answered no heartbeat for {quiet:.1f} s: "
                        f"it is dead, stopped or unreachable (heartbeat_timeout={limit})"
                    )
                )
                return
            if self._calls.check_deadlines(now):
                return

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop the ranks, kill the actors, remove the placement group; stop Ray if this
        executor started it. Idempotent."""
        if not self._calls.close():
            return
        healthy = self._latch.failure is None
        self._stop.set()
        ray = self._ray
        if ray is not None and self.actors:
            grace = 5.0 if healthy else 1.0
            try:
                stops = [a.stop.remote(grace) for a in self.actors]
                ray.wait(stops, num_returns=len(stops), timeout=grace + 1.0)
            except Exception as e:
                log.debug("ray: stopping the ranks: %s", e)
            for a in self.actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception as e:
                    log.debug("ray: kill: %s", e)
        if ray is not None and self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception as e:
                log.warning("ray: removing placement group: %s", e)
        self.actors = []
        self._calls.stop()
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=2)
        if self.started_ray and ray is not None:
            ray.shutdown()
