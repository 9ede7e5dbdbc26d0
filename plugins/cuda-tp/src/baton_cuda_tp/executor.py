"""Executor ``cuda-tp``: ``executor.tensor_parallel_size`` worker processes, one shard each."""

from __future__ import annotations

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.executor.multiproc import MultiprocExecutor
from baton.executor.workers import MultiprocSettings
from baton.worker.model_loader import load_hf_config
from baton_cuda_tp.sharding import check_shardable


class TensorParallelExecutor(MultiprocExecutor):
    """Heads, MLP and vocabulary split over ``tensor_parallel_size`` ranks (gloo on CPU, NCCL on CUDA)."""

    name = "cuda-tp"
    runner_cls = "baton_cuda_tp.runner:TPModelRunner"

    def __init__(self, config: BatonConfig, settings: MultiprocSettings | None = None) -> None:
        ex = config.executor
        if ex.pipeline_parallel_size != 1:
            raise ConfigError(
                f"executor 'cuda-tp' splits each layer, not the stack of layers: pipeline_parallel_size="
                f"{ex.pipeline_parallel_size} needs executor.backend = 'pipeline' (it composes with "
                "tensor_parallel_size)"
            )
        _, hf_config = load_hf_config(config)
        check_shardable(
            hf_config, ex.tensor_parallel_size
        )  # a clear error before any process starts
        super().__init__(config, settings, ex.tensor_parallel_size, 1)
