"""The tensor-parallel rank's runner hooks: the stock runner on this rank's shard; only the driver samples."""

from __future__ import annotations

import torch

from baton.parallel import get_parallel_context
from baton.parallel.sharding import shard_kv_shape, shard_model
from baton.runner import KVShape, LoadedModel, ModelRunnerHooks


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
