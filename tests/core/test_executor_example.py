"""docs/writing-a-plugin.md's worked executor ("timed", section 9): the page's module, installed
as a plugin (its worker process loads it too), passes the executor conformance suite, gives the
uniproc executor's greedy tokens, and its runner hooks timed every forward pass on the worker."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.interfaces import Executor
from baton.plugins.registry import reset_plugins
from baton.testing.tiny_model import tiny_model
from tests.core.plugin_fixtures import make_dist
from tests.plugins.parallel_common import ParallelConformance

PAGE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-plugin.md"
BLOCK = re.compile(r"^```python example=timed\n(.*?)^```[ \t]*$", re.S | re.M)
MODULE = "baton_docs_timed"


@pytest.fixture(scope="module", autouse=True)
def timed_plugin(tmp_path_factory: pytest.TempPathFactory):
    """The page's module as an installed distribution, here and in spawned worker processes."""
    [code] = BLOCK.findall(PAGE.read_text())
    site = make_dist(tmp_path_factory.mktemp("site"), "baton-docs-timed", MODULE, code, "timed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        mp.syspath_prepend(str(site))
        reset_plugins()
        yield sys.modules.get(MODULE) or __import__(MODULE)
        reset_plugins()
    sys.modules.pop(MODULE, None)


class TestTimedConformance(ParallelConformance):
    """The multiprocess executors' suite (tests/plugins/parallel_common.py) on the page's executor."""

    overrides: ClassVar[dict[str, Any]] = {"executor": "timed"}

    def test_the_worker_timed_every_forward(self, executor: Any, config: BatonConfig) -> None:
        assert isinstance(executor, Executor) and executor.model_info is not None
        sched = self.scheduler(executor, config)
        reqs = self.requests("t", [(20, 5), (70, 3)])
        self.run(executor, sched, reqs)
        [times] = executor.collective_rpc(sys.modules[MODULE].forward_times)
        # every scheduled token went through a timed forward: 20 + 5 - 1 and 70 + 3 - 1 tokens
        assert sum(tokens for tokens, _ in times) == 24 + 72
        assert all(seconds > 0 for _, seconds in times)


#: Three prompts of 9, 22 and 35 token ids for the greedy comparisons with uniproc.
PROMPTS = [
    {"prompt_token_ids": [3 + (7 * i + 5 * j) % 200 for j in range(9 + 13 * i)]} for i in range(3)
]


def tiny_llm(backend: str) -> LLM:
    """An LLM on the tiny random model with executor ``backend``, on one CPU thread."""
    return LLM(
        model=str(tiny_model("llama")),
        executor=backend,
        device="cpu",
        num_threads=1,
        kv_cache_memory="16MiB",
        max_model_len=256,
    )


def greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_greedy_tokens_equal_uniproc():
    out = {}
    for backend in ("uniproc", "timed"):
        with tiny_llm(backend) as llm:
            out[backend] = greedy(llm, 12)
    assert out["timed"] == out["uniproc"]
    assert all(len(t) == 12 for t in out["timed"])
