"""The tensor-parallel model runner: the stock runner on this rank's shard; only the driver samples."""

from __future__ import annotations

import torch

from baton.config import BatonConfig
from baton.protocol import GrammarOutput, ModelRunnerOutput
from baton.worker.model_runner import ModelRunner
from baton.worker.parallel import get_parallel_context
from baton.worker.step_inputs import StepInputs
from baton_cuda_tp.sharding import adjust_runner, shard_model


class TPModelRunner(ModelRunner):
    """Shards the model while it is still on the CPU, then runs steps like ModelRunner."""

    def __init__(self, cfg: BatonConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.ctx = get_parallel_context()

    def prepare_model(self, model: torch.nn.Module) -> None:
        shard_model(model, self.ctx)

    def load_model(self) -> None:
        super().load_model()
        adjust_runner(self, self.ctx)

    def sample(
        self, logits: torch.Tensor, inputs: StepInputs, grammar: GrammarOutput | None
    ) -> ModelRunnerOutput:
        if (
            not self.ctx.is_driver
        ):  # its logits are a slice of the vocabulary; the driver has them all
            return ModelRunnerOutput()
        return super().sample(logits, inputs, grammar)
