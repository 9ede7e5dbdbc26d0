"""Several workers' connector reports: the merge (a load finished once every worker reported
it, with the fewest tokens), and the seam over the multiprocess executor (tensor parallel on CPU
through baton-plugin-cuda-tp): the metadata reaches every rank, each rank's half saves and loads
its own shard, the merged report admits the request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from baton.kv_transfer.merge import KVOutputMerger, sum_stats
from baton.protocol import KVConnectorOutput, KVTransferStats
from tests.core.plugin_fixtures import make_dist


def test_a_load_finishes_once_every_worker_reported_it_with_the_fewest_tokens() -> None:
    merger = KVOutputMerger(2)
    first = merger.merge([KVConnectorOutput(finished_loading={"a": 64, "b": 32}), None])
    assert first is None  # only one worker reported: nothing is finished yet
    second = merger.merge(
        [
            KVConnectorOutput(finished_loading={"c": 16}, finished_saving=["x"]),
            KVConnectorOutput(finished_loading={"a": 48, "b": 32}, finished_saving=["x"]),
        ]
    )
    assert second is not None
    assert second.finished_loading == {"a": 48, "b": 32} and second.finished_saving == ["x"]
    third = merger.merge([None, KVConnectorOutput(finished_loading={"c": 0})])
    assert third is not None and third.finished_loading == {"c": 0}


def test_a_request_any_worker_failed_fails_and_nothing_more_is_awaited_for_it() -> None:
    merger = KVOutputMerger(2)
    merger.merge([KVConnectorOutput(finished_loading={"a": 16}), None])
    out = merger.merge([None, KVConnectorOutput(failed={"a": "disk gone"}, step_error="boom")])
    assert out is not None and out.failed == {"a": "disk gone"} and out.step_error == "boom"
    assert merger.merge([None, KVConnectorOutput(finished_loading={"a": 16})]) is None


def test_workers_figures_add_up_and_tokens_served_are_not_counted_twice() -> None:
    a = KVTransferStats(hit_tokens={"CPU": 32}, load_bytes=10, tier_bytes={"CPU": 100})
    b = KVTransferStats(hit_tokens={"CPU": 32}, load_bytes=5, tier_bytes={"CPU": 50})
    total = sum_stats([a, b])
    assert (total.hit_tokens, total.load_bytes, total.tier_bytes) == ({"CPU": 32}, 15, {"CPU": 150})


SCRIPT = """
import json, sys
PRELUDE
from baton import LLM, SamplingParams
from baton.testing.tiny_model import tiny_model

prompt = list(range(1000, 1100))
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
out = {}
for name, kv in (("off", {"connector": "none"}),
                 ("on", {"connector": "memory", "memory": {"async_loads": ASYNC, "hold_blocks": False}})):
    llm = LLM(model=str(tiny_model("llama")), executor=EXECUTOR, tensor_parallel_size=2,
              device="cpu", num_threads=1, max_model_len=256, kv_cache_memory=4 << 20,
              kv_transfer=kv)
    try:
        runs = []
        for _ in range(2):
            (r,) = llm.generate({"prompt_token_ids": prompt}, params)
            assert r.error is None, r.error
            runs.append([r.outputs[0].token_ids, r.num_cached_tokens])
            assert llm.reset_prefix_cache()
        out[name] = runs
    finally:
        llm.shutdown()
print(json.dumps(out))
"""


def run_two_ranks(tmp_path: Path, executor: str, asynchronous: bool, prelude: str = "") -> None:
    """In a fresh process (its worker processes see the reference connector through an entry
    point, a distribution made here): two tensor-parallel ranks, each with its half and its
    shard of the tier, serve a prompt the pool forgot from the connector with the tokens of
    connector off (and of a second pass without it)."""
    source = "from baton.testing.kv_connector import register_kv_connectors  # noqa: F401\n"
    make_dist(tmp_path / "dist", "baton-test-memory-kv", "baton_test_memory_kv", source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "dist"), *sys.path])}
    script = (
        textwrap.dedent(SCRIPT)
        .replace("ASYNC", str(asynchronous))
        .replace("EXECUTOR", repr(executor))
        .replace("PRELUDE", prelude)
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    (off1, _), (off2, _) = out["off"]
    (on1, cached1), (on2, cached2) = out["on"]
    assert on1 == on2 == off1 == off2
    assert (cached1, cached2) == (0, 96)


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_seam_over_tensor_parallel_workers(tmp_path: Path, asynchronous: bool) -> None:
    pytest.importorskip("baton_cuda_tp")
    run_two_ranks(tmp_path, "cuda-tp", asynchronous)
