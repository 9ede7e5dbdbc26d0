"""start_profile / stop_profile: each worker writes a torch profiler chrome trace of the steps run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.errors import ConfigError, InvalidRequestError
from baton.testing.tiny_model import tiny_model

#: ops the tiny float32 Llama's forward runs on one CPU worker: its embedding and the native
#: layer stack (its prompt and decode steps are short enough that every step runs it)
MODEL_OPS = {"aten::embedding", "baton::decode_layers"}
#: ops of its prompt steps through transformers' modules (tensor-parallel ranks run those)
MODULE_OPS = {"aten::embedding", "aten::silu", "aten::scaled_dot_product_attention"}


def make_llm(**overrides) -> LLM:
    return LLM(
        model=str(tiny_model("llama")),
        device="cpu",
        num_threads=1,
        max_model_len=512,
        kv_cache_memory=4 << 20,
        **overrides,
    )


def profiled(llm: LLM) -> list[str]:
    llm.start_profile()
    llm.generate(["profile this prompt"], SamplingParams(max_tokens=4), use_tqdm=False)
    return llm.stop_profile()


def op_names(path: str) -> set[str]:
    trace = json.loads(Path(path).read_text())  # a chrome trace: {"traceEvents": [...]}
    return {e.get("name", "") for e in trace["traceEvents"]}


def check_traces(paths: list[str], folder: Path, workers: int, ops: set[str] = MODEL_OPS) -> None:
    assert len(paths) == workers and len(set(paths)) == workers
    for path in paths:
        assert Path(path).parent == folder and path.endswith(".pt.trace.json")
        missing = ops - op_names(path)
        assert not missing, f"{path} lacks the model's ops {missing}"


def test_a_trace_of_the_model_per_worker(tmp_path):
    folder = tmp_path / "traces"  # made on the first start
    with make_llm(**{"observability.profile_dir": str(folder)}) as llm:
        with pytest.raises(InvalidRequestError, match="not profiling"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(InvalidRequestError, match="already profiling"):
            llm.start_profile()
        llm.generate(["profile this prompt"], SamplingParams(max_tokens=4), use_tqdm=False)
        (path,) = llm.stop_profile()
        check_traces([path], folder, 1)
        assert "baton-worker0-" in Path(path).name
        second = profiled(llm)  # a second profile: a second file
        assert second != [path] and len(list(folder.iterdir())) == 2


def test_profiling_without_a_folder_is_refused_by_the_setting_name():
    with make_llm() as llm:
        with pytest.raises(ConfigError, match=r"observability\.profile_dir is not set"):
            llm.start_profile()
        assert llm.generate("still serves", SamplingParams(max_tokens=2), use_tqdm=False)


def test_the_engine_process_writes_the_trace(tmp_path):
    with make_llm(transport="zmq", **{"observability.profile_dir": str(tmp_path)}) as llm:
        check_traces(profiled(llm), tmp_path, 1)
