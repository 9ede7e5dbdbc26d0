"""Load the tokenizer that goes with the configured model."""

from __future__ import annotations

from typing import Any

from baton.config import ModelSection
from baton.errors import ModelLoadError
from baton.model_info import ModelInfo


def load_tokenizer(model: ModelSection, info: ModelInfo) -> Any:
    """The fast tokenizer of ``model.tokenizer``, else of the model's folder ``info.path``."""
    from transformers import AutoTokenizer

    source = model.tokenizer or info.path
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"could not load a tokenizer from {source!r} (model.tokenizer): {e}"
        ) from e
    if getattr(tok, "_tokenizer", None) is None:
        raise ModelLoadError(
            f"the tokenizer in {source!r} has no fast (Rust) implementation; baton needs one"
        )
    return tok
