"""The pipeline-stage model runner: the stock runner on this stage's layers, hidden states in and out.

Every stage applies every SchedulerOutput to its own copy of the persistent
batch and builds the step's inputs (positions, slots, attention metadata) itself;
only hidden states travel between stages (torch.distributed send/recv between
the same tensor-parallel rank of neighbouring stages). With
``tensor_parallel_size > 1`` the stage is also sharded by baton-plugin-cuda-tp.
"""

from __future__ import annotations

from typing import Any

import torch

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.protocol import GrammarOutput, ModelRunnerOutput
from baton.worker.model_runner import ModelRunner
from baton.worker.parallel import get_parallel_context
from baton.worker.step_inputs import StepInputs
from baton_pipeline.stages import StageIO, cut_stage


def tp_sharding() -> Any:
    """baton_cuda_tp.sharding, which a pipeline with tensor_parallel_size > 1 needs."""
    try:
        from baton_cuda_tp import sharding
    except ImportError:
        raise ConfigError(
            "executor 'pipeline' with tensor_parallel_size > 1 shards each stage with baton-plugin-cuda-tp, "
            "which is not installed: pip install baton-plugin-cuda-tp"
        ) from None
    return sharding


class PipelineModelRunner(ModelRunner):
    """One stage: receives the previous stage's hidden states, runs its layers, sends them on."""

    def __init__(self, cfg: BatonConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.ctx = get_parallel_context()
        self.io: StageIO | None = None
        self._recv_buf: torch.Tensor | None = None

    def prepare_model(self, model: torch.nn.Module) -> None:
        self.io = cut_stage(model, self.ctx.pp_rank, self.ctx.pp_size)
        if self.ctx.tp_size > 1:
            tp_sharding().shard_model(model, self.ctx)

    def load_model(self) -> None:
        super().load_model()
        io = self._stage()
        self.num_layers = io.end - io.start  # the KV cache holds this stage's layers only
        if self.ctx.tp_size > 1:
            tp_sharding().adjust_runner(self, self.ctx)
        if not io.is_first:
            hidden = self.hf_config.get_text_config().hidden_size
            self._recv_buf = torch.empty(
                self.max_num_tokens, hidden, dtype=self.dtype, device=self.device
            )

    def _stage(self) -> StageIO:
        if self.io is None:
            raise RuntimeError("pipeline runner used before load_model")
        return self.io

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        io = self._stage()
        n = int(inputs.input_ids.shape[0])
        if not io.is_first:
            assert self._recv_buf is not None
            io.input = self.ctx.recv_prev_stage(self._recv_buf[:n]).unsqueeze(0)
        io.capture = not io.is_last
        try:
            logits = super().forward(inputs)
        finally:
            io.input, io.capture = None, False
        if not io.is_last:
            self.ctx.send_next_stage(io.take_output()[0])
        return logits

    def sample(
        self, logits: torch.Tensor, inputs: StepInputs, grammar: GrammarOutput | None
    ) -> ModelRunnerOutput:
        if not self.ctx.is_driver:  # earlier stages have no logits; other tp ranks a slice of them
            return ModelRunnerOutput()
        return super().sample(logits, inputs, grammar)
