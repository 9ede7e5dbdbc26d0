"""What a multiprocess executor's workers need: settings, device, channel, per-rank arguments.

The processes themselves are started by ``baton.executor.group.WorkerGroup``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from baton.config import BatonConfig
from baton.errors import ExecutorError

#: Transports tried by ``transport = "auto"``, fastest first (docs/parallel.md has the figures).
AUTO_TRANSPORTS = ("shm", "zmq")


class MultiprocSettings(BaseModel):
    """Settings every multiprocess executor takes (``[executor.cuda-tp]``, ``[executor.pipeline]``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transport: str = "auto"
    """Channel between the executor and its workers: any multiprocess transport (shm, zmq);
    "auto" takes shm when installed, else zmq."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; "auto" is nccl on CUDA, gloo on CPU."""
    step_timeout: float = Field(120.0, gt=0)
    """Seconds a step may stay unanswered before the executor declares a worker hung and fails."""
    heartbeat_timeout: float = Field(4.0, gt=0)
    """Seconds without a heartbeat (every 0.5 s, from a thread of each worker, so long steps and
    collectives keep beating) before the executor declares the worker stopped and fails."""
    startup_timeout: float = Field(600.0, gt=0)
    """Seconds the workers may take to load their shards, size and warm up the KV cache."""
    dist_timeout: float = Field(600.0, gt=0)
    """torch.distributed timeout of the rendezvous and of every collective."""


def pick_device(config: BatonConfig, world_size: int, name: str) -> str:
    """ "cpu" or "cuda" for ``executor.device``; ExecutorError when there are fewer GPUs than workers."""
    import torch

    device = config.executor.device
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise ExecutorError(
            f"executor.device={device!r} but torch sees no CUDA device; use 'cpu' or 'auto'"
        )
    if torch.cuda.device_count() < world_size:
        raise ExecutorError(
            f"executor {name!r} needs {world_size} CUDA devices (one per worker) but "
            f"{torch.cuda.device_count()} are visible; lower tensor/pipeline_parallel_size or use device='cpu'"
        )
    return "cuda"


def pick_transport(config: BatonConfig, name: str) -> Any:
    """The transport of the worker channel: ``name``, or for "auto" the first of AUTO_TRANSPORTS installed."""
    from baton.plugins.registry import get_registry

    registry = get_registry()
    if name == "auto":
        installed = set(registry.names("transport"))
        name = next((n for n in AUTO_TRANSPORTS if n in installed), "")
        if not name:
            raise ExecutorError(
                "a multiprocess executor needs a multiprocess transport for its workers and none is "
                "installed: pip install baton-plugin-shm (or baton-plugin-zmq)"
            )
    entry = registry.get("transport", name)
    transport = entry.create(config, entry.settings(config))
    if not transport.multiprocess:
        raise ExecutorError(
            f"transport {name!r} cannot reach other processes; choose shm or zmq for the workers"
        )
    return transport


def worker_config(config: BatonConfig, rank: int, world_size: int, device: str) -> BatonConfig:
    """``config`` for one worker: its own device, and on CPU an equal share of the cores."""
    from baton.executor.rank import rank_config

    return rank_config(config, world_size, device, None, rank)


def worker_args(ex: Any, backend: str, device: str, store_port: int) -> list[Any]:
    """Each rank's RankBootstrap for executor ``ex`` (a MultiprocExecutor), in rank order:
    what ``WorkerGroup.start`` hands to ``baton.executor.worker_proc.worker_main``."""
    from baton.executor.rank import rank_bootstraps

    return rank_bootstraps(
        ex.config,
        ex.tp_size,
        ex.pp_size,
        runner=ex.runner,
        backend=backend,
        device=device,
        store_port=store_port,
        dist_timeout_s=ex.settings.dist_timeout,
    )
