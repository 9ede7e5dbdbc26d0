"""How much memory a worker holds, and handing freed host memory back to the OS (sleep)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import platform
from collections.abc import Iterable
from typing import Any

import torch

from baton.protocol import WorkerMemory

log = logging.getLogger(__name__)


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one allocation count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def module_tensors(model: torch.nn.Module | None) -> list[torch.Tensor]:
    """A model's parameters and buffers (none for None)."""
    if model is None:
        return []
    return [*model.parameters(), *model.buffers()]


def release_host_memory() -> bool:
    """Collect garbage and return the heap's free pages to the OS (glibc ``malloc_trim``).

    baton's workers keep large freed blocks in the heap (``worker.tune_malloc``), so
    freed tensors would stay resident without this. False where this is not glibc.
    """
    gc.collect()
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.malloc_trim(0))


def release_device_memory(device: torch.device) -> None:
    """Give the CUDA caching allocator's free blocks back to the driver (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure(rank: int, device: torch.device | None, runner: Any) -> WorkerMemory:
    """This worker's memory: RSS, and the storages of the runner's KV cache and model.

    Reads the stock runner's ``kv_caches`` and ``model``; a runner without them reports 0.
    """
    import psutil

    model = getattr(runner, "model", None)
    weights = module_tensors(model)
    reserved = 0
    if device is not None and device.type == "cuda":
        reserved = int(torch.cuda.memory_reserved(device))
    return WorkerMemory(
        rank=rank,
        pid=os.getpid(),
        rss_bytes=psutil.Process().memory_info().rss,
        kv_cache_bytes=storage_bytes(getattr(runner, "kv_caches", None) or ()),
        weights_bytes=storage_bytes(weights),
        weights_device=str(weights[0].device) if weights else "",
        device_reserved_bytes=reserved,
    )
