"""Mapping the CPU KV cache's pages ahead of the requests that write them (``cache.prefault``).

A page the cache has never touched is mapped by a page fault the first time a request writes
it, inside a step's parallel region, where the other threads wait for it at the next barrier
(in a virtual machine often a fault on the host too). ``CachePrefault`` maps the pages on a
background thread with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+): the kernel faults them in
as a write would but leaves their contents alone, so requests may write the cache meanwhile and
the engine does not wait at start. It maps in the order the block pool hands out never-used
blocks (ascending block ids), every layer's K and V of a run of blocks together. Where that
call does not exist, ``prefault`` writes a zero into every page before the cache is used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger("baton.worker.model_runner")  # the runner's: its messages keep their logger

#: ``madvise`` advice: populate (prefault) page tables writable (Linux 5.14+).
MADV_POPULATE_WRITE = 23
#: Bytes of one layer's K or V that one ``madvise`` call maps (a huge page).
CHUNK_BYTES = 2 << 20


def prefault(tensor: torch.Tensor) -> float:
    """Write a zero into every memory page of a contiguous zero CPU tensor, so that the kernel
    maps them now; returns the seconds it took. Only before anything else writes the tensor."""
    start = time.perf_counter()
    flat = tensor.view(-1)
    flat[:: max(1, mmap.PAGESIZE // tensor.element_size())].zero_()
    flat[-1:].zero_()  # the last page, where the data does not start on a page boundary
    return time.perf_counter() - start


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise where ``MADV_POPULATE_WRITE`` works (tried on one page), else None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    page = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(page)
    ok = fn(ctypes.addressof(view), mmap.PAGESIZE, MADV_POPULATE_WRITE) == 0
    del view  # the mmap closes only with no view left
    page.close()
    return fn if ok else None


def populate_supported() -> bool:
    """Whether this OS maps pages with ``madvise(MADV_POPULATE_WRITE)``."""
    return _madvise() is not None


class CachePrefault:
    """Maps a KV cache's pages on a daemon thread (see the module docstring).

    ``cache`` is the runner's one allocation, ``[layers, K/V, blocks, ...]``. The thread holds
    it until it is done or ``stop`` is called, so the memory it maps is never another's.
    """

    def __init__(self, cache: torch.Tensor) -> None:
        fn = _madvise()
        if fn is None:
            raise RuntimeError("madvise(MADV_POPULATE_WRITE) is not available here")
        self._madvise = fn
        self._stop = threading.Event()
        self.done = threading.Event()
        #: Seconds the mapping took (None until done), and the error that ended it early, if any.
        self.seconds: float | None = None
        self.error: str | None = None
        self._thread = threading.Thread(
            target=self._run, args=(cache,), name="baton-kv-prefault", daemon=True
        )
        self._thread.start()

    def _run(self, cache: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            regions = cache.shape[0] * cache.shape[1]
            blocks = cache.shape[2]
            block_bytes = cache[0, 0, 0].numel() * cache.element_size()
            per_call = max(1, CHUNK_BYTES // block_bytes)
            base = cache.data_ptr()
            page = mmap.PAGESIZE
            for first in range(0, blocks, per_call):
                n = min(per_call, blocks - first)
                for region in range(regions):
                    if self._stop.is_set():
                        return
                    lo = base + (region * blocks + first) * block_bytes
                    hi = lo + n * block_bytes
                    lo -= lo % page  # madvise takes page-aligned starts
                    if self._madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
                        code = ctypes.get_errno()
                        self.error = f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
                        log.warning(
                            "KV cache: mapping its pages ahead stopped (madvise: %s); the rest "
                            "are mapped as requests first write them",
                            self.error,
                        )
                        return
            self.seconds = time.perf_counter() - start
            log.debug("KV cache: pages mapped in %.2f s (background)", self.seconds)
        finally:
            del cache
            self.done.set()

    def stop(self) -> None:
        """Stop mapping (after the current call) and let go of the cache."""
        self._stop.set()
        self._thread.join()
