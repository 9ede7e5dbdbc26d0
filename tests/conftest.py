"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from baton.request import Request

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


@pytest.fixture
def policy_sees(monkeypatch: pytest.MonkeyPatch) -> list[Request]:
    """Requests as an engine in this process (LLM, or a server's engine thread) gives them to
    the fcfs policy, in order."""
    from baton.sched.policies import FCFSPolicy

    seen: list[Request] = []
    add = FCFSPolicy.add

    def spy(self, request):
        seen.append(request)
        add(self, request)

    monkeypatch.setattr(FCFSPolicy, "add", spy)
    return seen
