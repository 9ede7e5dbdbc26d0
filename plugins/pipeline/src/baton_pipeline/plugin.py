"""Plugin module of baton-plugin-pipeline: registers executor ``pipeline``.

Settings come from the ``[executor.pipeline]`` sub-table (or
``BATON_EXECUTOR__PIPELINE__<FIELD>``), validated by ``PipelineSettings``.
"""

from __future__ import annotations

from typing import Any

from baton import hookimpl
from baton.executor.workers import MultiprocSettings

BATON_PLUGIN_API = 1


class PipelineSettings(MultiprocSettings):
    """``[executor.pipeline]``: the worker channel, the torch.distributed backend and the timeouts."""


def create_executor(config: Any, settings: PipelineSettings | None = None) -> Any:
    """The registered factory: ``factory(config, settings)``."""
    from baton_pipeline.executor import create_pipeline_executor

    return create_pipeline_executor(config, settings)


@hookimpl
def register_executors(register: Any) -> None:
    register("pipeline", create_executor, settings_model=PipelineSettings)
