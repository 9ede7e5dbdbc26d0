"""Joining or starting the Ray instance, and what each rank reserves in it."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from typing import Any

from baton.errors import ExecutorError

log = logging.getLogger(__name__)

#: Prefixes of the engine process's environment variables passed on to the rank actors
#: (the plugin set, the config and the model hub must be the same there).
FORWARDED_ENV = ("BATON_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "MKL_")


def connect(address: str | None, namespace: str | None, local_cpus: float) -> bool:
    """Join the Ray cluster at ``address`` ("auto" or host:port); with no address, the
    instance this process joined already, else a new local one. True when this call
    started Ray here (the executor then stops it on shutdown).

    A local instance listens on the loopback only (Ray's RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
    unless set) and sends no usage statistics (RAY_USAGE_STATS_ENABLED=0, unless set): it
    lives and dies with this engine. It declares at least ``local_cpus`` logical CPUs, so a
    group larger than the machine's cores still gets placed (the ranks share the cores, as
    the local executors' processes do).
    """
    if address is None and "ray" not in sys.modules:
        # read once, when ray is imported
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return False
    if address is not None:
        try:
            ray.init(address=address, namespace=namespace, logging_level=logging.WARNING)
        except ConnectionError as e:
            raise ExecutorError(
                f"executor 'ray': cannot reach the Ray cluster at address={address!r}: {e} "
                "(start one with `ray start --head`, or leave [executor.ray] address unset for "
                "a local instance)"
            ) from e
        return False
    cpus = max(float(os.cpu_count() or 1), local_cpus)
    ray.init(
        address="local",
        num_cpus=int(-(-cpus // 1)),
        namespace=namespace,
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    log.info("executor 'ray': started a local Ray instance (%d logical CPUs)", int(cpus))
    return True


def actor_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment the rank actors get: the forwarded variables, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
    env.update(extra)
    return env


def bundle(num_cpus: float, num_gpus: float, resources: dict[str, float]) -> dict[str, float]:
    """One rank's placement-group bundle (zero amounts left out: Ray refuses them)."""
    out = {"CPU": float(num_cpus), "GPU": float(num_gpus), **resources}
    return {k: v for k, v in out.items() if v > 0}


def describe_resources(ray: Any) -> str:
    try:
        total = ray.cluster_resources()
        free = ray.available_resources()
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    except Exception as e:  # the cluster may be the problem
        return f"(resources unknown: {e})"

    def keep(r: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in r.items() if not k.startswith(("node:", "memory", "object_"))}

    return f"{nodes} nodes, total {keep(total)}, free {keep(free)}"


def prepare_actor(
    env: dict[str, str], nice: int | None, kind: str, preload: tuple[str, ...]
) -> threading.Thread:
    """What a baton actor (``kind``: "rank", "engine") does first in its process: take the
    engine's environment ``env``, the priority ``nice`` (Ray starts its workers at 15, which
    lets other processes starve them; None keeps it), and start importing ``preload`` on a
    daemon thread (seconds each on a small machine) while its caller still waits elsewhere.

    Returns that thread: the actor joins it before importing anything itself, since two
    threads importing transformers at once can fail (``KeyError: 'transformers'``, seen in CI)."""
    os.environ.update(env)
    if nice is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except OSError as e:  # lowering it needs the privilege to
            log.info("%s actor: cannot set nice %d: %s", kind, nice, e)
    thread = threading.Thread(
        target=_preload, args=(preload,), name=f"baton-{kind}-preload", daemon=True
    )
    thread.start()
    return thread


def _preload(modules: tuple[str, ...]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # the actor's own import will say what is wrong
            log.debug("preloading %s: %s", module, e)
            return
