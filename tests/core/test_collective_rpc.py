"""collective_rpc from LLM to every worker: the allow-listed Worker methods and registered names
only, one result per worker, a failing target fails the call and not the engine."""

from __future__ import annotations

import msgspec
import pytest
import torch

from baton import LLM, SamplingParams
from baton.errors import BatonError, InvalidRequestError, PluginError
from baton.protocol import WorkerMemory
from baton.rpc import WORKER_RPC_METHODS, register_worker_rpc, worker_rpc_names
from baton.testing.tiny_model import tiny_model


@register_worker_rpc("test_blocks_times")
def blocks_times(worker, factor: int, offset: int = 0) -> dict:
    return {"rank": worker.rank, "value": worker.model_runner.num_blocks * factor + offset}


@register_worker_rpc("test_fails")
def fails(worker) -> None:
    raise ValueError("on purpose")


@register_worker_rpc("test_tensor")
def a_tensor(worker) -> torch.Tensor:
    return torch.zeros(2)


def make_llm(**overrides) -> LLM:
    return LLM(
        model=str(tiny_model("llama")),
        device="cpu",
        num_threads=1,
        max_model_len=512,
        kv_cache_memory=4 << 20,
        **overrides,
    )


def still_serves(llm: LLM) -> None:
    (out,) = llm.generate("still here", SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_registered_and_allow_listed_targets_in_process():
    with make_llm() as llm:
        blocks = llm.engine.core.num_blocks
        assert llm.collective_rpc("test_blocks_times", (3,), {"offset": 1}) == [
            {"rank": 0, "value": blocks * 3 + 1}
        ]
        (mem,) = llm.collective_rpc("memory_usage")  # msgpack builtins: the struct's fields
        assert msgspec.convert(mem, WorkerMemory).kv_cache_bytes > 0
        for name in ("shutdown", "load_model", "__init__", "model_runner"):  # not on the list
            with pytest.raises(InvalidRequestError, match=f"{name!r} is neither") as e:
                llm.collective_rpc(name)
            assert "memory_usage" in str(e.value) and "test_blocks_times" in str(e.value)
        with pytest.raises(BatonError, match="worker 0: on purpose"):
            llm.collective_rpc("test_fails")
        with pytest.raises(InvalidRequestError, match="cannot reach the client"):
            llm.collective_rpc("test_tensor")
        still_serves(llm)


def test_names_are_checked_at_registration():
    with pytest.raises(PluginError, match="is registered already"):
        register_worker_rpc("test_fails")(blocks_times)
    with pytest.raises(PluginError, match="is a Worker method already"):
        register_worker_rpc(next(iter(WORKER_RPC_METHODS)))
    with pytest.raises(PluginError, match="identifier"):
        register_worker_rpc("no spaces")
    assert {"test_fails", "memory_usage"} <= set(worker_rpc_names())


def test_an_engine_process_knows_only_its_own_registrations():
    """This module registered its names here, not in the engine process (zmq): there only the
    allow-list answers, and an unknown name is an error, not a dead engine."""
    with make_llm(transport="zmq") as llm:
        (spec,) = llm.collective_rpc("get_kv_cache_spec")
        assert spec[0] == 16  # KVCacheSpec's block_size, the first of its fields
        with pytest.raises(InvalidRequestError, match="'test_blocks_times' is neither"):
            llm.collective_rpc("test_blocks_times", (1,))
        still_serves(llm)
