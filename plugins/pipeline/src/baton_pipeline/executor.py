"""Executor ``pipeline``: ``pipeline_parallel_size`` stages (times ``tensor_parallel_size`` ranks each).

``max_concurrent_batches = pipeline_parallel_size``: the engine core keeps that
many batches in flight (``EngineCore.step_with_batch_queue``), so while the
last stage runs one batch the first already runs the next.
"""

from __future__ import annotations

from baton.config import BatonConfig
from baton.executor.multiproc import MultiprocExecutor
from baton.executor.workers import MultiprocSettings
from baton.interfaces import RunnerFactory
from baton.parallel.hooks import PipelineStageHooks
from baton.parallel.sharding import check_shardable
from baton.parallel.stages import layer_ranges
from baton.runner import StockRunner, model_config


def create_pipeline_executor(
    config: BatonConfig,
    settings: MultiprocSettings | None = None,
    runner: RunnerFactory | None = None,
) -> MultiprocExecutor:
    """Contiguous layer ranges per stage, hidden states passed stage to stage, a batch queue.
    ``runner`` replaces the ranks' runner factory (default: the stock runner, cut per stage)."""
    ex = config.executor
    hf_config = model_config(config)
    # clear errors before any process starts
    layer_ranges(hf_config.get_text_config().num_hidden_layers, ex.pipeline_parallel_size)
    check_shardable(hf_config, ex.tensor_parallel_size)
    return MultiprocExecutor(
        config,
        settings,
        ex.tensor_parallel_size,
        ex.pipeline_parallel_size,
        name="pipeline",
        runner=runner or StockRunner(PipelineStageHooks),
        max_concurrent_batches=ex.pipeline_parallel_size,
    )


#: The name this factory had when the executor was a MultiprocExecutor subclass.
PipelineExecutor = create_pipeline_executor
