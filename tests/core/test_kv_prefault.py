"""cache.prefault: the CPU KV cache's pages mapped when it is allocated (and again on waking),
or only as requests write them; the tokens are the same either way.

Residency is read with mincore(2) on the cache's one allocation, in a real in-process engine on
the tiny model (test_sleep's).
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from baton import LLM, SamplingParams
from tests.core.test_sleep import make_llm

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads page residency with Linux's mincore(2)"
)

#: Over glibc's largest mmap threshold (32 MiB): a smaller calloc may reuse heap memory, which
#: it zeroes (and so maps) itself.
KV_BYTES = 48 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [100 + 7 * i + j for j in range(40)]} for i in range(3)]


def resident_fraction(tensor: torch.Tensor) -> float:
    """The share of the pages under ``tensor`` that are mapped in this process."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = tensor.data_ptr() & ~(page - 1)
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = (end - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(start, end - start, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) / pages


def cache_of(llm: LLM) -> torch.Tensor:
    runner = llm.engine.core.executor.worker.model_runner
    return runner.kv_caches[0]._base  # the one allocation every layer's K and V view


def test_the_cache_is_mapped_at_allocation_and_again_after_waking():
    with make_llm(KV_BYTES) as llm:
        assert llm.engine.core.config.cache.prefault  # the default
        cache = cache_of(llm)
        assert cache.numel() * cache.element_size() >= 0.9 * KV_BYTES
        assert resident_fraction(cache) == 1.0
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.sleep(1)
        llm.wake_up()
        assert resident_fraction(cache_of(llm)) == 1.0
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_off_maps_only_what_requests_write_with_the_same_tokens():
    with make_llm(KV_BYTES, cache={"prefault": False}) as lazy:
        # the warm-up writes a few slots of block 0 in every layer's K and V: at most those
        # pages (a 2 MiB huge page each where the kernel gives them) are mapped
        assert resident_fraction(cache_of(lazy)) < 0.5
        lazy_tokens = [
            o.outputs[0].token_ids for o in lazy.generate(PROMPTS, GREEDY, use_tqdm=False)
        ]
    with make_llm(KV_BYTES) as eager:
        eager_tokens = [
            o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)
        ]
    assert lazy_tokens == eager_tokens
