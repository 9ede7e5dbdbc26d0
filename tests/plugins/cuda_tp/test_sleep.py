"""sleep / wake_up through the multiprocess executor: every rank frees and brings back its shard."""

from __future__ import annotations

from baton import LLM
from baton.testing.tiny_model import tiny_model
from tests.core.test_sleep import prompts, tokens


def check_ranks_sleep_and_wake(**parallel) -> None:
    """Both ranks free their KV cache (and at level 2 their weights) and bring them back; the
    greedy tokens after each wake are those before."""
    with LLM(
        model=str(tiny_model("llama")),
        **parallel,
        device="cpu",
        num_threads=1,
        max_model_len=1024,
        kv_cache_memory=8 << 20,
    ) as llm:
        batch = prompts(n=3, length=100)
        before = tokens(llm, batch)
        mem = llm.get_memory_usage()
        assert [m.rank for m in mem] == [0, 1] and len({m.pid for m in mem}) == 2
        assert all(m.kv_cache_bytes > 0 and m.weights_bytes > 0 for m in mem)
        for level in (1, 2):
            llm.sleep(level)
            asleep = llm.get_memory_usage()
            assert [m.kv_cache_bytes for m in asleep] == [0, 0]
            kept = [m.weights_bytes for m in mem] if level == 1 else [0, 0]
            assert [m.weights_bytes for m in asleep] == kept
            llm.wake_up()
            assert [(m.kv_cache_bytes, m.weights_bytes) for m in llm.get_memory_usage()] == [
                (m.kv_cache_bytes, m.weights_bytes) for m in mem
            ]
            assert tokens(llm, batch) == before, f"tokens changed after sleep({level})"


def test_both_ranks_sleep_at_each_level_and_wake_with_the_same_tokens():
    check_ranks_sleep_and_wake(executor="cuda-tp", tensor_parallel_size=2)
