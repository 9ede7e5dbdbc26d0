"""Plugin module of baton-plugin-cuda-tp: registers executor ``cuda-tp``.

Settings come from the ``[executor.cuda-tp]`` sub-table (or
``BATON_EXECUTOR__CUDA_TP__<FIELD>``), validated by ``CudaTPSettings``.
"""

from __future__ import annotations

from typing import Any

from baton import hookimpl
from baton.executor.workers import MultiprocSettings

BATON_PLUGIN_API = 1


class CudaTPSettings(MultiprocSettings):
    """``[executor.cuda-tp]``: the worker channel, the torch.distributed backend and the timeouts."""


def create_executor(config: Any, settings: CudaTPSettings | None = None) -> Any:
    """The registered factory: ``factory(config, settings)``."""
    from baton_cuda_tp.executor import create_tensor_parallel_executor

    return create_tensor_parallel_executor(config, settings)


@hookimpl
def register_executors(register: Any) -> None:
    register("cuda-tp", create_executor, settings_model=CudaTPSettings)
