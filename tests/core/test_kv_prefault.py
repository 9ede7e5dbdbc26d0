"""cache.prefault: the CPU KV cache's pages mapped ahead of the requests (by a background
thread, or written at allocation where madvise(MADV_POPULATE_WRITE) is missing; again on
waking), or left to the requests that write them; the tokens are the same either way.

Residency is read with mincore(2): on the cache's one allocation in a real in-process engine on
the tiny model (test_sleep's), and on fresh anonymous mappings for the two mechanisms.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import pytest
import torch

from baton import LLM, SamplingParams
from baton.worker import kv_cache
from baton.worker.prefault import CachePrefault, populate_supported, prefault
from tests.core.test_sleep import KV_BYTES, make_llm

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads page residency with Linux's mincore(2)"
)

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
    return runner_of(llm).kv_caches[0]._base  # the one allocation every layer's K and V view


def runner_of(llm: LLM):
    return llm.engine.core.executor.worker.model_runner


def anonymous(shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
    """A float32 tensor on a fresh anonymous mapping (no page mapped yet), ``offset`` bytes in."""
    count = 1
    for n in shape:
        count *= n
    buf = mmap.mmap(-1, count * 4 + offset, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.float32, offset=offset, count=count).view(shape)


needs_populate = pytest.mark.skipif(
    not populate_supported(), reason="this kernel has no madvise(MADV_POPULATE_WRITE) (Linux 5.14+)"
)


@needs_populate
def test_the_cache_is_mapped_in_the_background_and_again_after_waking():
    with make_llm() as llm:
        assert llm.engine.core.config.cache.prefault  # the default
        # requests run while the pages are being mapped: the mapping leaves contents alone
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        runner = runner_of(llm)
        mapping = runner._prefault
        assert mapping is not None and mapping.done.wait(60) and mapping.error is None
        cache = cache_of(llm)
        assert cache.numel() * cache.element_size() >= 0.9 * KV_BYTES
        assert resident_fraction(cache) == 1.0
        llm.sleep(1)
        assert runner._prefault is None  # stopped: it let go of the cache sleep frees
        llm.wake_up()
        assert runner._prefault is not None and runner._prefault.done.wait(60)
        assert resident_fraction(cache_of(llm)) == 1.0
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_without_populate_the_pages_are_written_at_allocation(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # as on a kernel older than 5.14, or another OS
    monkeypatch.setattr(kv_cache, "populate_supported", lambda: False)
    with caplog.at_level(logging.INFO, logger="baton.worker.model_runner"), make_llm() as llm:
        assert runner_of(llm)._prefault is None
        assert resident_fraction(cache_of(llm)) == 1.0
    (line,) = [r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage()]
    assert "pages mapped in" in line


@needs_populate
def test_cache_prefault_maps_without_writing_and_stops_when_asked() -> None:
    cache = anonymous((3, 2, 700, 2, 16, 16), offset=16)  # layers, K/V, blocks, heads, slots, dim
    cache[1, 0, 5] = 7.0  # a request's KV, written before the mapping reaches it
    assert resident_fraction(cache) < 0.5
    mapping = CachePrefault(cache)
    assert mapping.done.wait(60) and mapping.error is None and mapping.seconds is not None
    assert resident_fraction(cache) == 1.0
    assert (cache[1, 0, 5] == 7.0).all() and int((cache != 0).sum()) == cache[1, 0, 5].numel()
    big = anonymous((30, 2, 20000, 3, 16, 64))  # 1.3 GiB: stopped long before it is done
    early = CachePrefault(big)
    early.stop()
    assert early.done.is_set()


def test_off_leaves_the_pages_to_the_requests_with_the_same_tokens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Whether a lazy cache's pages are mapped depends on glibc: a calloc it serves from freed
    # heap memory is zeroed (so mapped) by glibc itself, as in a process that ran engines before.
    # What prefault = false must do is not write them: the start-up log says so.
    with caplog.at_level(logging.INFO, logger="baton.worker.model_runner"):
        with make_llm(cache={"prefault": False}) as lazy:
            lazy_tokens = [
                o.outputs[0].token_ids for o in lazy.generate(PROMPTS, GREEDY, use_tqdm=False)
            ]
        lazy_log = [r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage()]
        caplog.clear()
        with make_llm() as eager:
            eager_tokens = [
                o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)
            ]
        eager_log = [r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage()]
    assert len(lazy_log) == 1 and "pages mapped" not in lazy_log[0]
    assert len(eager_log) == 1 and "pages mapp" in eager_log[0]
    assert lazy_tokens == eager_tokens


def test_prefault_maps_every_page_of_a_fresh_mapping_even_off_a_page_boundary() -> None:
    # 16 bytes in: the data starts and ends inside a page, as a calloc'd block's does
    tensor = anonymous((2 << 20,), offset=16)
    assert resident_fraction(tensor) < 0.5  # an anonymous mapping nobody wrote
    assert prefault(tensor) >= 0.0
    assert resident_fraction(tensor) == 1.0
    assert not tensor.any()
