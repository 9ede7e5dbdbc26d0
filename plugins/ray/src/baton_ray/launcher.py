"""Engine launcher ``ray``: each data-parallel engine core as a Ray actor (``EngineActor``).

Made in the frontend's process when ``executor.data_parallel_backend = "ray"``: it
joins (or starts) Ray as the executor does (``[executor.ray] address``), then for
each engine places an actor (``engine_num_cpus`` / ``engine_num_gpus`` /
``engine_resources``, ``engine_scheduling``), waits until its process runs
(``engine_placement_timeout``), checks that the transport's address reaches the
actor's machine, and starts the engine core there. The handle reports the engine
dead as soon as its ``wait`` call returns or Ray reports the actor dead, its
process exits (an actor on this machine: its pid is watched), or it leaves a ping
unanswered for ``engine_heartbeat_timeout`` seconds (a node gone without a word,
which Ray takes longer to declare; a stopped process): the handle then kills it.
``close`` kills every actor it started and stops Ray if it started it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import time
import uuid
from typing import Any

from baton.config import BatonConfig
from baton.errors import ConfigError, ExecutorError
from baton.transport.peer import PeerWatch, machine_id
from baton_ray.cluster import actor_env, connect, describe_resources
from baton_ray.plugin import RaySettings

log = logging.getLogger(__name__)

#: Seconds between two pings of an engine actor.
PING_INTERVAL = 0.5
#: Transports whose two ends must share one machine.
SINGLE_HOST_TRANSPORTS = ("inproc", "shm")


def check_config(config: BatonConfig) -> None:
    """Refuse what cannot work with engines on Ray nodes (ConfigError naming the fix)."""
    transport = config.transport.name
    if transport in SINGLE_HOST_TRANSPORTS:
        raise ConfigError(
            f"executor.data_parallel_backend='ray' places engine cores on Ray nodes, but "
            f"transport.name={transport!r} works within one machine's processes only: use "
            "transport.name = 'zmq' ([transport.zmq] protocol = 'tcp', host = an address of "
            "this machine the nodes reach) or data_parallel_backend = 'mp'"
        )
    ex = config.executor
    if ex.expert_parallel and ex.data_parallel_size > 1:
        raise ConfigError(
            "executor.data_parallel_backend='ray' with executor.expert_parallel: expert-parallel "
            "engines meet at a TCPStore the frontend serves on 127.0.0.1, which engines on "
            "other nodes cannot reach; use data_parallel_backend = 'mp' or expert_parallel = false"
        )


def single_host_endpoint(address: Any) -> str | None:
    """An endpoint of the transport's ``address`` that only this machine reaches (an
    ``ipc://`` socket, ``tcp://`` on the loopback), or None. The address is the transport's
    own object: its string fields that are endpoints are read (zmq's ``input`` / ``output``)."""
    fields = vars(address).values() if hasattr(address, "__dict__") else ()
    for value in fields:
        if not isinstance(value, str):
            continue
        if value.startswith("ipc://"):
            return f"{value} (a unix socket of this machine)"
        if value.startswith("tcp://"):
            host = value[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
            if host == "localhost":
                return f"{value} (the loopback)"
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(host).is_loopback:
                    return f"{value} (the loopback)"
    return None


class RayEngineHandle:
    """One engine-core actor (``baton.interfaces.EngineHandle``)."""

    def __init__(
        self,
        ray: Any,
        actor: Any,
        name: str,
        pid: int,
        node: str,
        run: Any,
        local: bool,
        heartbeat_timeout: float,
    ) -> None:
        self._ray, self.actor, self.name = ray, actor, name
        self.pid, self.node = pid, node
        self._run = run  # the pending ``wait`` call: ready once the engine stopped
        self._how: str | None = None
        #: the actor's process, when it runs on this machine (its exit is seen at once)
        self._process = PeerWatch(pid, name) if local else None
        self._heartbeat_timeout = heartbeat_timeout
        self._ping = actor.ping.remote()
        self._ping_sent = time.monotonic()

    def is_alive(self) -> bool:
        if self._how is not None:
            return False
        ready, _ = self._ray.wait([self._run], timeout=0)
        if ready:
            return self._dead(self._outcome())
        if self._process is not None and not self._process.alive():
            return self._dead("its process exited")
        return self._heartbeat()

    def _heartbeat(self) -> bool:
        """Send the next ping when the last was answered; False once one is overdue."""
        now = time.monotonic()
        ready, _ = self._ray.wait([self._ping], timeout=0)
        if ready:
            if now - self._ping_sent >= PING_INTERVAL:
                self._ping, self._ping_sent = self.actor.ping.remote(), now
            return True
        if now - self._ping_sent <= self._heartbeat_timeout:
            return True
        self.kill()  # whatever it is doing, it must not come back
        return self._dead(
            f"its ping went unanswered for {self._heartbeat_timeout:g} s ([executor.ray] "
            "engine_heartbeat_timeout): its node is gone or unreachable, or it is stopped"
        )

    def _dead(self, how: str) -> bool:
        self._how = how
        if self._process is not None:
            self._process.close()
        return False

    def _outcome(self) -> str:
        try:
            error = self._ray.get(self._run, timeout=1.0)
        except self._ray.exceptions.RayActorError as e:  # killed, crashed, its node gone
            return f"the actor died: {str(e).splitlines()[0][:200]}"
        except self._ray.exceptions.RayError as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return "stopped" if error is None else f"stopped: {error}"

    def terminate(self) -> None:
        if self.is_alive():
            with contextlib.suppress(self._ray.exceptions.RayError):
                self.actor.stop.remote()

    def kill(self) -> None:
        with contextlib.suppress(self._ray.exceptions.RayError, ValueError):
            self._ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        self._ray.wait([self._run], timeout=timeout)

    def describe(self) -> str:
        where = f"Ray actor {self.name}, pid {self.pid} on node {self.node}"
        return where if self._how is None else f"{where}, {self._how}"


class RayEngineLauncher:
    """``baton.interfaces.EngineLauncher`` placing each engine core in a Ray actor."""

    def __init__(self, config: BatonConfig, settings: RaySettings | None = None) -> None:
        check_config(config)
        self.config = config
        self.settings = s = settings or RaySettings()
        self.id = uuid.uuid4().hex[:8]
        self.handles: list[RayEngineHandle] = []
        self.actors: list[Any] = []
        n = config.executor.data_parallel_size
        self.started_ray = connect(s.address, s.namespace, n * s.engine_num_cpus)
        import ray

        self._ray = ray
        self._num_gpus = s.engine_num_gpus if s.engine_num_gpus is not None else self._gpus()
        self._machine = machine_id()

    def _gpus(self) -> float:
        ex = self.config.executor
        if ex.device == "cpu" or not self._ray.cluster_resources().get("GPU", 0):
            return 0.0
        return float(ex.tensor_parallel_size * ex.pipeline_parallel_size)

    def launch(
        self,
        config: BatonConfig,
        address: Any,
        engine_index: int,
        fingerprint: list[tuple[str, str, str, str]],
    ) -> RayEngineHandle:
        from baton_ray.engine_actor import EngineActor

        ray, s = self._ray, self.settings
        name = f"baton-engine-{self.id}-{engine_index}"
        actor = EngineActor.options(
            num_cpus=s.engine_num_cpus,
            num_gpus=self._num_gpus,
            resources=dict(s.engine_resources),
            scheduling_strategy=s.engine_scheduling,
            name=name,
            namespace=s.namespace,
            max_restarts=0,
            max_task_retries=0,
        ).remote(actor_env(s.env), s.nice)
        self.actors.append(actor)
        where = actor.where.remote()
        ready, _ = ray.wait([where], timeout=s.engine_placement_timeout)
        if not ready:
            raise ExecutorError(
                f"engine launcher 'ray': engine {engine_index}'s actor (CPU "
                f"{s.engine_num_cpus}, GPU {self._num_gpus}, {dict(s.engine_resources)}) did not "
                f"start within {s.engine_placement_timeout} s ([executor.ray] "
                f"engine_placement_timeout); {describe_resources(ray)}"
            )
        try:
            pid, node, machine = ray.get(where)
        except ray.exceptions.RayError as e:
            raise ExecutorError(
                f"engine launcher 'ray': engine {engine_index}'s actor died: {e}"
            ) from e
        local_only = single_host_endpoint(address)
        if machine != self._machine and local_only is not None:
            raise ConfigError(
                f"engine {engine_index} was placed on node {node}, another machine than this "
                f"frontend's, which cannot reach {local_only}: set "
                "[transport.zmq] protocol = 'tcp' and host = an address of this machine the "
                "nodes reach (or pin the engines here with engine_resources)"
            )
        # awaited (it returns once the engine's thread runs): a start that fails (the config
        # does not unpickle there) must not leave a ``wait`` pending forever
        try:
            ray.get(
                actor.start.remote(config, address, engine_index, fingerprint),
                timeout=s.engine_placement_timeout,
            )
        except (ray.exceptions.RayError, TimeoutError) as e:
            raise ExecutorError(
                f"engine launcher 'ray': engine {engine_index} did not start in its actor "
                f"(pid {pid} on node {node}): {type(e).__name__}: {e}"
            ) from e
        handle = RayEngineHandle(
            ray,
            actor,
            name,
            pid,
            node,
            actor.wait.remote(),
            local=machine == self._machine,
            heartbeat_timeout=s.engine_heartbeat_timeout,
        )
        self.handles.append(handle)
        log.info("engine %d: %s", engine_index, handle.describe())
        return handle

    def close(self) -> None:
        actors, self.actors = self.actors, []
        for actor in actors:
            with contextlib.suppress(self._ray.exceptions.RayError, ValueError):
                self._ray.kill(actor, no_restart=True)
        if self.started_ray:
            self.started_ray = False
            self._ray.shutdown()
