"""Executor ``cuda-tp``: ``executor.tensor_parallel_size`` worker processes, one shard each."""

from __future__ import annotations

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.executor.multiproc import MultiprocExecutor
from baton.executor.workers import MultiprocSettings
from baton.interfaces import RunnerFactory
from baton.parallel.hooks import TensorParallelHooks
from baton.parallel.sharding import check_shardable
from baton.runner import StockRunner, model_config


def create_tensor_parallel_executor(
    config: BatonConfig,
    settings: MultiprocSettings | None = None,
    runner: RunnerFactory | None = None,
) -> MultiprocExecutor:
    """Heads, MLP and vocabulary split over ``tensor_parallel_size`` ranks (gloo on CPU, NCCL on
    CUDA). ``runner`` replaces the ranks' runner factory (default: the stock runner, sharded)."""
    ex = config.executor
    if ex.pipeline_parallel_size != 1:
        raise ConfigError(
            f"executor 'cuda-tp' splits each layer, not the stack of layers: pipeline_parallel_size="
            f"{ex.pipeline_parallel_size} needs executor.backend = 'pipeline' (it composes with "
            "tensor_parallel_size)"
        )
    # a clear error before any process starts
    check_shardable(model_config(config), ex.tensor_parallel_size)
    return MultiprocExecutor(
        config,
        settings,
        ex.tensor_parallel_size,
        1,
        name="cuda-tp",
        runner=runner or StockRunner(TensorParallelHooks),
    )


#: The name this factory had when the executor was a MultiprocExecutor subclass.
TensorParallelExecutor = create_tensor_parallel_executor
