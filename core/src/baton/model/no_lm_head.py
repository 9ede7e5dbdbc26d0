"""Base models without an LM head (BertModel, ...): pooling requests only.

Such a checkpoint (``ModelInfo.runner_type == "pooling"``) runs through the same
paged path as a causal LM: its attention modules say whether they are causal
(BERT's are not: then chunked prefill and prefix caching are off, so a prompt is
computed whole in one step), and the runner pools its final hidden states. It
computes no logits, so the frontends and the engine refuse generation requests.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def is_bidirectional(model: torch.nn.Module) -> bool:
    """Whether any attention module of ``model`` attends to later tokens (``is_causal`` False)."""
    return any(getattr(m, "is_causal", True) is False for m in model.modules())


def head_kwargs(
    model: torch.nn.Module, keep: torch.Tensor, num_tokens: int, no_lm_head: bool
) -> dict[str, Any]:
    """The forward's keyword arguments besides ids and positions: the logits to keep for a
    causal LM; for a base model none, but all-zero ``token_type_ids`` where it takes them (its
    default buffer is only max_position_embeddings long, shorter than a step may be)."""
    if not no_lm_head:
        return {"logits_to_keep": keep}
    if "token_type_ids" in inspect.signature(model.forward).parameters:
        return {"token_type_ids": torch.zeros(1, num_tokens, dtype=torch.long, device=keep.device)}
    return {}
