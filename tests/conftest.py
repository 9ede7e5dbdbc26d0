"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as an HF folder, converted once from its GGUF."""
    from baton.worker.model_loader import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)
