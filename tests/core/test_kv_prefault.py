"""cache.prefault: the CPU KV cache's pages mapped when it is allocated (and again on waking),
or left to the requests that write them; the tokens are the same either way.

Residency is read with mincore(2): on the cache's one allocation in a real in-process engine on
the tiny model (test_sleep's), and on a fresh anonymous mapping for ``prefault`` itself.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import pytest
import torch

from baton import LLM
from baton.worker.kv_cache import prefault
from tests.core.test_sleep import KV_BYTES, make_llm, tokens

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads page residency with Linux's mincore(2)"
)

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
    with make_llm() as llm:
        assert llm.engine.core.config.cache.prefault  # the default
        cache = cache_of(llm)
        assert cache.numel() * cache.element_size() >= 0.9 * KV_BYTES
        assert resident_fraction(cache) == 1.0
        before = tokens(llm, PROMPTS)
        llm.sleep(1)
        llm.wake_up()
        assert resident_fraction(cache_of(llm)) == 1.0
        assert tokens(llm, PROMPTS) == before


def test_off_leaves_the_pages_to_the_requests_with_the_same_tokens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Whether a lazy cache's pages are mapped depends on glibc: a calloc it serves from freed
    # heap memory is zeroed (so mapped) by glibc itself, as in a process that ran engines before.
    # What prefault = false must do is not write them: the start-up log says so.
    def run(**overrides) -> tuple[list[list[int]], list[str]]:
        """The tokens of PROMPTS, and the KV cache's start-up log lines."""
        caplog.clear()
        with make_llm(**overrides) as llm:
            out = tokens(llm, PROMPTS)
        return out, [r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="baton.worker.model_runner"):
        lazy_tokens, lazy_log = run(cache={"prefault": False})
        eager_tokens, eager_log = run()
    assert len(lazy_log) == 1 and "pages mapped" not in lazy_log[0]
    assert len(eager_log) == 1 and "pages mapped in" in eager_log[0]
    assert lazy_tokens == eager_tokens


def test_prefault_maps_every_page_of_a_fresh_mapping_even_off_a_page_boundary() -> None:
    size = 8 << 20
    buf = mmap.mmap(-1, size + mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # 16 bytes in: the data starts and ends inside a page, as a calloc'd block's does
    tensor = torch.frombuffer(buf, dtype=torch.float32, offset=16, count=size // 4)
    assert resident_fraction(tensor) < 0.5  # an anonymous mapping nobody wrote
    assert prefault(tensor) >= 0.0
    assert resident_fraction(tensor) == 1.0
    assert not tensor.any()
