"""The pipeline stage's runner hooks: the stock runner on this stage's layers, hidden states in and out.

Every stage applies every SchedulerOutput to its own copy of the persistent
batch and builds the step's inputs (positions, slots, attention metadata) itself;
only hidden states travel between stages (torch.distributed send/recv between
the same tensor-parallel rank of neighbouring stages). With
``tensor_parallel_size > 1`` the stage is also sharded (``baton.parallel.sharding``).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

from baton.errors import ExecutorError
from baton.parallel import get_parallel_context
from baton.parallel.sharding import shard_kv_shape, shard_model
from baton.runner import KVShape, LoadedModel, ModelRunnerHooks
from baton_pipeline.stages import StageIO, cut_stage


class PipelineStageHooks(ModelRunnerHooks):
    """One stage: receives the previous stage's hidden states, runs its layers, sends them on."""

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
