"""Cut a loaded Hugging Face causal LM down to one pipeline stage, in place.

Public (docs/stability.md): the pipeline executors of baton-plugin-pipeline and
baton-plugin-ray cut their stages with it (``baton.parallel.hooks.PipelineStageHooks``).

Stage ``s`` keeps a contiguous range of decoder layers; the first stage keeps
the embedding, the last the final norm and the LM head. Everything else is
replaced by weightless stand-ins, so the model's own forward still runs from
top to bottom on every stage (no per-architecture forward to maintain):

- decoder layers of other stages pass their input through (``Skip``);
- a later stage's embedding returns zeros: a forward pre-hook on its first
  layer swaps in the hidden states received from the previous stage;
- an earlier stage's norm is the identity and its head returns no logits; a
  forward hook on its last layer keeps that layer's output, which is sent on.

The attention modules of the kept layers are renumbered 0..n-1 (their
``layer_idx`` picks the KV cache), so the runner allocates the cache of this
stage's layers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from baton.errors import ConfigError, ExecutorError


def layer_ranges(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) per stage, as even as possible (earlier stages take the remainder)."""
    if pp_size > num_layers:
        raise ConfigError(
            f"executor.pipeline_parallel_size={pp_size} but the model has only {num_layers} layers; "
            f"use at most {num_layers} stages"
        )
    base, extra = divmod(num_layers, pp_size)
    out, start = [], 0
    for s in range(pp_size):
        end = start + base + (1 if s < extra else 0)
        out.append((start, end))
        start = end
    return out


class Skip(torch.nn.Module):
    """A decoder layer of another stage: returns its input."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class NoEmbedding(torch.nn.Module):
    """A later stage's embedding: zeros of the right shape (replaced by the received hidden states)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(
            *input_ids.shape, self.hidden_size, dtype=self.dtype, device=input_ids.device
        )


class NoHead(torch.nn.Module):
    """An earlier stage's LM head: no logits. ``weight`` (meta) keeps the vocabulary's shape for the runner."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], 0)


@dataclass
class StageIO:
    """The hidden states entering this stage's first layer and leaving its last one, per step."""

    start: int
    end: int
    num_layers: int
    input: torch.Tensor | None = None
    capture: bool = False
    output: torch.Tensor | None = None

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_layers

    def take_output(self) -> torch.Tensor:
        out, self.output = self.output, None
        if out is None:
            raise ExecutorError(
                f"pipeline stage of layers [{self.start}, {self.end}) produced no hidden states"
            )
        return out


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(
            f"executor 'pipeline': {type(model).__name__} keeps its decoder layers elsewhere than "
            "base_model.layers; this model cannot be split into stages"
        )
    return layers


def cut_stage(model: torch.nn.Module, pp_rank: int, pp_size: int) -> StageIO:
    """Keep stage ``pp_rank``'s part of ``model`` (see the module docstring); returns its StageIO."""
    layers = _decoder_layers(model)
    start, end = layer_ranges(len(layers), pp_size)[pp_rank]
    io = StageIO(start, end, len(layers))
    for i in range(len(layers)):
        if not start <= i < end:
            layers[i] = Skip()
    for local, i in enumerate(range(start, end)):
        attn = getattr(layers[i], "self_attn", None)
        if attn is None or not hasattr(attn, "layer_idx"):
            raise ConfigError(
                f"executor 'pipeline': decoder layer {i} has no self_attn.layer_idx to renumber"
            )
        attn.layer_idx = local  # index into this stage's KV cache
    text = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    if not io.is_first:
        emb = model.get_input_embeddings()
        model.set_input_embeddings(NoEmbedding(text.hidden_size, emb.weight.dtype))
        layers[start].register_forward_pre_hook(_swap_input(io), with_kwargs=True)
    if not io.is_last:
        norm = getattr(model.base_model, "norm", None)
        if norm is not None:
            model.base_model.norm = torch.nn.Identity()
        model.set_output_embeddings(NoHead(model.get_output_embeddings().weight))
        layers[end - 1].register_forward_hook(_keep_output(io))
    return io


def _swap_input(io: StageIO) -> Any:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if io.input is None:
            return None  # warm-up / profiling: run on the zeros
        hidden, io.input = io.input, None
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    return hook


def _keep_output(io: StageIO) -> Any:
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if io.capture:
            io.output = output[0] if isinstance(output, tuple) else output

    return hook
