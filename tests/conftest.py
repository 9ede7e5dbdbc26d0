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

#: Test files (or folders, or tests) that time the system under test (a deadline after a kill or
#: a hang, /health latency while a step runs, shutdown within its timeout, a check's cost), watch
#: the whole machine (Ray's daemons), or change what every test shares (a plugin installed into
#: the environment: an engine started meanwhile sees another plugin set): marked ``serial``.
#: `make test` runs every other test in two pytest-xdist workers, then these alone, so a
#: neighbour can neither push them past a limit nor see what they change.
SERIAL = (
    "tests/core/test_expert_parallel.py",
    "tests/core/test_meta.py::test_writing_a_plugin_followed_literally",
    "tests/core/test_validation.py",
    "tests/core/test_worker_group.py",
    "tests/e2e/test_containment.py",
    "tests/e2e/test_engine_process.py",
    "tests/plugins/cuda_tp/test_failures.py",
    "tests/plugins/openai/test_hardening.py",
    "tests/plugins/openai/test_large_bodies.py",
    "tests/plugins/openai/test_lifecycle.py",
    "tests/plugins/openai/test_limits.py",
    "tests/plugins/openai/test_shutdown.py",
    "tests/plugins/pipeline/test_failures.py",
    # the Ray package but its parity tests (they time nothing; their own cluster in a worker)
    "tests/plugins/ray/test_conformance.py",
    "tests/plugins/ray/test_data_parallel.py",
    "tests/plugins/ray/test_failures.py",
    "tests/plugins/ray/test_local_instance.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as an HF folder, converted once from its GGUF."""
    from baton.model.loader import resolve_model

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
