"""Plugin module of baton-plugin-ray: registers executor ``ray`` and engine launcher ``ray``.

Settings of both come from the ``[executor.ray]`` sub-table (or
``BATON_EXECUTOR__RAY__<FIELD>``), validated by ``RaySettings``: the executor's
ranks take ``num_cpus`` / ``num_gpus`` / ``resources``, the data-parallel engine
actors ``engine_num_cpus`` / ``engine_num_gpus`` / ``engine_resources``. Ray
itself is imported only when the executor or the launcher starts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from baton import hookimpl

BATON_PLUGIN_API = 1


class RaySettings(BaseModel):
    """``[executor.ray]``: where the Ray cluster is, what each rank and each engine actor
    takes, timeouts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str | None = None
    """The Ray cluster: "auto" (the one `ray start` runs on this machine, or RAY_ADDRESS),
    an address like "10.0.0.1:6379", or unset: join the Ray instance this process is
    connected to already, else start a local one for this engine (stopped with it)."""
    namespace: str | None = None
    """Ray namespace of the actors (default: Ray's anonymous one)."""
    num_cpus: float = Field(1.0, gt=0)
    """Logical CPUs each rank reserves (its placement-group bundle)."""
    num_gpus: float | None = Field(None, ge=0)
    """GPUs each rank reserves; unset: 1 on CUDA, 0 on CPU."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each rank reserves, e.g. {"node_type_a100": 1}."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the ranks' bundles spread over the nodes (Ray placement-group strategies): PACK
    fills a node first, STRICT_PACK needs one node, SPREAD and STRICT_SPREAD spread."""
    placement_timeout: float = Field(120.0, gt=0)
    """Seconds to wait for the cluster to place every bundle before refusing to start."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of the rank actors, e.g. {"NCCL_SOCKET_IFNAME": "eth0"} (BATON_* and HF_*
    variables of the engine process are passed on already)."""
    broadcast_inline_max: int = Field(65536, ge=0)
    """A step's SchedulerOutput under this many bytes (encoded) is copied into every rank's
    call; a larger one is put in Ray's object store once (``ray.put``) and every rank reads it
    from there. 0: always the object store."""
    nice: int | None = Field(0, ge=-20, le=19)
    """Scheduling priority (nice) of the rank actors: Ray starts its workers at 15, which on
    a busy CPU lets anything else run first; 0 is that of a local executor's workers. None:
    Ray's. Below the current value needs the privilege to (root, CAP_SYS_NICE)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; "auto" is nccl on CUDA, gloo on CPU."""
    step_timeout: float = Field(120.0, gt=0)
    """Seconds a step may stay unanswered before the executor declares a rank hung and fails."""
    heartbeat_timeout: float = Field(4.0, gt=0)
    """Seconds a rank may leave a ping (every 0.5 s, answered by a thread of its own) unanswered
    before the executor declares it dead, stopped or unreachable and fails."""
    startup_timeout: float = Field(600.0, gt=0)
    """Seconds the ranks may take to start, load their shards, size and warm up the KV cache."""
    dist_timeout: float = Field(600.0, gt=0)
    """torch.distributed timeout of the rendezvous and of every collective."""
    engine_num_cpus: float = Field(1.0, gt=0)
    """With executor.data_parallel_backend = "ray": logical CPUs each engine-core actor
    reserves."""
    engine_num_gpus: float | None = Field(None, ge=0)
    """GPUs each engine-core actor reserves; unset: 0 with executor.device = "cpu" or a
    cluster without GPUs, else tensor_parallel_size * pipeline_parallel_size (an engine whose
    executor is `ray` places its ranks itself: set 0)."""
    engine_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each engine-core actor reserves, e.g. {"dp_node": 1}."""
    engine_scheduling: Literal["DEFAULT", "SPREAD"] = "DEFAULT"
    """Ray's scheduling strategy for the engine-core actors: DEFAULT (Ray packs them where
    resources are free) or SPREAD (over as many nodes as possible)."""
    engine_placement_timeout: float = Field(120.0, gt=0)
    """Seconds each engine-core actor may take to be placed and start its process before
    the frontend refuses to start."""
    engine_heartbeat_timeout: float = Field(4.0, gt=0)
    """Seconds an engine-core actor may leave a ping (every 0.5 s, answered by a thread of its
    own) unanswered before the frontend takes it for dead (a node gone without a word, a
    stopped process), kills it and handles it as routing.on_engine_death says."""


def create_executor(config: Any, settings: RaySettings | None = None) -> Any:
    """The registered factory: ``factory(config, settings)``."""
    from baton_ray.executor import RayExecutor

    return RayExecutor(config, settings)


def create_engine_launcher(config: Any, settings: RaySettings | None = None) -> Any:
    """The registered engine-launcher factory: ``factory(config, settings)``."""
    from baton_ray.launcher import RayEngineLauncher

    return RayEngineLauncher(config, settings)


@hookimpl
def register_executors(register: Any) -> None:
    register("ray", create_executor, settings_model=RaySettings)


@hookimpl
def register_engine_launchers(register: Any) -> None:
    register("ray", create_engine_launcher, settings_model=RaySettings)
