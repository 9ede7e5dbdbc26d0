"""Executor ``pipeline``: ``pipeline_parallel_size`` stages (times ``tensor_parallel_size`` ranks each).

``max_concurrent_batches = pipeline_parallel_size``: the engine core keeps that
many batches in flight (``EngineCore.step_with_batch_queue``), so while the
last stage runs one batch the first already runs the next.
"""

from __future__ import annotations

from baton.config import BatonConfig
from baton.executor.multiproc import MultiprocExecutor
from baton.executor.workers import MultiprocSettings
from baton.worker.model_loader import load_hf_config
from baton_pipeline.runner import tp_sharding
from baton_pipeline.stages import layer_ranges


class PipelineExecutor(MultiprocExecutor):
    """Contiguous layer ranges per stage, hidden states passed stage to stage, a batch queue."""

    name = "pipeline"
    runner_cls = "baton_pipeline.runner:PipelineModelRunner"

    def __init__(self, config: BatonConfig, settings: MultiprocSettings | None = None) -> None:
        ex = config.executor
        _, hf_config = load_hf_config(config)
        text = hf_config.get_text_config()
        layer_ranges(
            text.num_hidden_layers, ex.pipeline_parallel_size
        )  # clear errors before any process starts
        if ex.tensor_parallel_size > 1:
            tp_sharding().check_shardable(hf_config, ex.tensor_parallel_size)
        self.max_concurrent_batches = ex.pipeline_parallel_size
        super().__init__(config, settings, ex.tensor_parallel_size, ex.pipeline_parallel_size)
