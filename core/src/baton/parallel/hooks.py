"""The runner hooks of a tensor x pipeline parallel rank, for any executor that places ranks.

``StockRunner(TensorParallelHooks)`` is a tensor-parallel rank (baton-plugin-cuda-tp),
``StockRunner(PipelineStageHooks)`` a pipeline stage, sharded too when
``tensor_parallel_size > 1`` (baton-plugin-pipeline); ``parallel_runner(tp, pp)``
picks the one a layout needs, so an executor that starts its ranks elsewhere
(baton-plugin-ray's actors) runs the same model runner as the local executors.
``check_parallel_model`` refuses a layout the model cannot take before any
worker starts (heads that do not divide, more stages than layers).

The hooks read the rank's place from ``baton.parallel.get_parallel_context()``:
they are made in the worker, after ``baton.executor.rank.Rank`` joined the group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import torch

from baton.errors import ExecutorError
from baton.parallel.context import get_parallel_context
from baton.parallel.sharding import check_shardable, shard_kv_shape, shard_model
from baton.parallel.stages import StageIO, cut_stage, layer_ranges
from baton.runner import KVShape, LoadedModel, ModelRunnerHooks, StockRunner, model_config

if TYPE_CHECKING:
    from baton.config import BatonConfig
    from baton.interfaces import RunnerFactory


class TensorParallelHooks(ModelRunnerHooks):
    """Shards the model while it is still on the CPU; the rank's KV cache holds its KV heads."""

    def __init__(self) -> None:
        self.ctx = get_parallel_context()

    def prepare_model(self, model: torch.nn.Module) -> None:
        shard_model(model, self.ctx)

    def loaded(self, model: LoadedModel) -> KVShape:
        return shard_kv_shape(model.shape, self.ctx)

    def samples(self) -> bool:
        return self.ctx.is_driver  # other ranks hold a slice of the vocabulary's logits

    def runs_alone(self) -> bool:
        return False


class PipelineStageHooks(ModelRunnerHooks):
    """One stage: receives the previous stage's hidden states, runs its layers, sends them on.

    Every stage applies every SchedulerOutput to its own copy of the persistent
    batch and builds the step's inputs itself; only hidden states travel between
    stages (send/recv between the same tensor-parallel rank of neighbouring stages).
    With ``tensor_parallel_size > 1`` the stage is also sharded.
    """

    def __init__(self) -> None:
        self.ctx = get_parallel_context()
        self.io: StageIO | None = None
        self._recv_buf: torch.Tensor | None = None

    def prepare_model(self, model: torch.nn.Module) -> None:
        self.io = cut_stage(model, self.ctx.pp_rank, self.ctx.pp_size)
        if self.ctx.tp_size > 1:
            shard_model(model, self.ctx)

    def _stage(self) -> StageIO:
        if self.io is None:
            raise ExecutorError("pipeline stage hooks used before prepare_model cut the model")
        return self.io

    def loaded(self, model: LoadedModel) -> KVShape:
        io = self._stage()
        if not io.is_first:
            hidden = model.model.config.get_text_config().hidden_size
            self._recv_buf = torch.empty(
                model.max_num_tokens, hidden, dtype=model.dtype, device=model.device
            )
        # the KV cache holds this stage's layers (and with TP, this rank's heads) only
        shape = msgspec.structs.replace(model.shape, num_layers=io.end - io.start)
        return shard_kv_shape(shape, self.ctx)

    def forward(self, run: Callable[[], torch.Tensor], num_tokens: int) -> torch.Tensor:
        io = self._stage()
        if not io.is_first:
            assert self._recv_buf is not None
            io.input = self.ctx.recv_prev_stage(self._recv_buf[:num_tokens]).unsqueeze(0)
        io.capture = not io.is_last
        try:
            logits = run()
        finally:
            io.input, io.capture = None, False
        if not io.is_last:
            self.ctx.send_next_stage(io.take_output()[0])
        return logits

    def samples(self) -> bool:
        return self.ctx.is_driver  # earlier stages have no logits; other tp ranks a slice of them

    def runs_alone(self) -> bool:
        return False


def parallel_runner(tp_size: int, pp_size: int) -> RunnerFactory:
    """The runner factory of a rank of a ``tp_size`` x ``pp_size`` group: the stock runner,
    sharded (``pp_size == 1``) or cut into stages (and sharded when ``tp_size > 1``)."""
    if pp_size > 1:
        return StockRunner(PipelineStageHooks)
    return StockRunner(TensorParallelHooks)


def check_parallel_model(config: BatonConfig, tp_size: int, pp_size: int) -> None:
    """ConfigError when ``config``'s model cannot be split ``tp_size`` x ``pp_size`` ways
    (heads or MLP not divisible, no tensor-parallel plan, more stages than layers)."""
    hf_config = model_config(config)
    if pp_size > 1:
        layer_ranges(hf_config.get_text_config().num_hidden_layers, pp_size)
    check_shardable(hf_config, tp_size)
