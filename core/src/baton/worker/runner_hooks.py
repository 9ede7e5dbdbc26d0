"""The hooks of baton's stock model runner: what a runner variant (a tensor-parallel shard, a
pipeline stage) changes in it, and what it learns about the loaded model.

Public as ``baton.runner`` (``ModelRunnerHooks``, ``LoadedModel``, ``KVShape``), next to the
runner factory ``StockRunner`` that takes them; defined here, below the runner, so that
``baton.worker.model_runner`` reads them without importing ``baton.runner`` back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch


class KVShape(msgspec.Struct, frozen=True, kw_only=True):
    """The layers and heads one runner holds; its KV cache is sized from them."""

    num_layers: int
    num_heads: int
    num_kv_heads: int


class LoadedModel(msgspec.Struct, frozen=True, kw_only=True):
    """What ``ModelRunnerHooks.loaded`` learns about the model once it is on its device."""

    model: Any  # torch.nn.Module, after prepare_model, quantization and the move to the device
    device: Any  # torch.device
    dtype: Any  # torch.dtype of the activations
    #: Most tokens one step feeds the forward (scheduler.max_num_batched_tokens).
    max_num_tokens: int
    #: The model's own layers and heads (before any hook changed them).
    shape: KVShape


class ModelRunnerHooks:
    """What a runner variant changes in the stock runner. Every default changes nothing.

    One instance per runner, made in the worker process (where
    ``baton.parallel.get_parallel_context()`` is set).
    """

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Change the loaded model in place, on the CPU, before it moves to the device."""

    def loaded(self, model: LoadedModel) -> KVShape:
        """The layers and heads this runner's KV cache holds (default: the model's own)."""
        return model.shape

    def forward(self, run: Callable[[], torch.Tensor], num_tokens: int) -> torch.Tensor:
        """Run one step's forward (``run()``: logits for the positions that sample, then for
        the prompt positions that prompt_logprobs scores) over ``num_tokens`` flattened tokens;
        wrap it to do work before or after."""
        return run()

    def samples(self) -> bool:
        """Whether this runner samples: False for ranks whose logits are partial or absent."""
        return True

    def runs_alone(self) -> bool:
        """Whether this runner's forward involves no other rank, so that it may run several
        decode steps in one call (``SchedulerOutput.decode_steps``): False for hooks whose
        forward other ranks take part in (tensor, pipeline and expert parallel)."""
        return True


HooksFactory = Callable[[], ModelRunnerHooks]
