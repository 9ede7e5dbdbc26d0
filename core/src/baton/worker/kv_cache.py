"""The model runner's paged KV cache: its size (from settings or the device's free memory),
its allocation and warm-up, block copies (copy-on-write of forks), the dummy forward of an idle
expert-parallel rank, and sleep / wake_up (free the cache, and the weights at level 2).

A mixin of ``baton.worker.model_runner.ModelRunner``: it reads the model and the shapes
``load_model`` set on the runner.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from baton.errors import ExecutorError
from baton.kernels.attention import META_KWARG, AttentionMetadata, DecodeGroup, PrefillSeq
from baton.model.no_lm_head import head_kwargs
from baton.protocol import KVCacheConfig, KVCacheSpec
from baton.worker.memory import release_device_memory, release_host_memory

if TYPE_CHECKING:
    from baton.config import CacheSection
    from baton.lora.model import LoRAModel
    from baton.worker.fast_decode import FastDecode
    from baton.worker.step_inputs import StepInputBuilder

log = logging.getLogger("baton.worker.model_runner")  # the runner's: its messages keep their logger

GiB = 1 << 30
#: KV cache on CPU when nothing is configured: enough for every sequence at full length, at most this.
CPU_DEFAULT_KV_BYTES = 1 * GiB
#: Fraction of device memory on CUDA when neither kv_cache_memory nor memory_utilization is set.
CUDA_DEFAULT_UTILIZATION = 0.9


def zeros_lazy(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU from calloc, so its pages cost memory only once written
    (``prefault`` maps them all now).

    Attention reads whole blocks, including slots no request wrote yet: zeros
    keep them finite. torch.zeros would touch (and make resident) every page.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    np_dtype = {
        torch.float32: np.float32,
        torch.float16: np.float16,
        torch.float64: np.float64,
    }.get(dtype)
    if np_dtype is None:  # bfloat16: same size as int16, zero bits are 0.0
        return torch.from_numpy(np.zeros(shape, dtype=np.int16)).view(dtype)
    return torch.from_numpy(np.zeros(shape, dtype=np_dtype))


def prefault(tensor: torch.Tensor) -> float:
    """Write a zero into every memory page of a contiguous zero CPU tensor, so that the kernel
    maps them now rather than when requests first write them; returns the seconds it took.

    A first touch is a page fault (and in a virtual machine often one on the host too) taken
    inside the model's parallel region, where the other thread waits for it at the next barrier.
    """
    start = time.perf_counter()
    flat = tensor.view(-1)
    flat[:: max(1, mmap.PAGESIZE // tensor.element_size())].zero_()
    flat[-1:].zero_()  # the last page, where the data does not start on a page boundary
    return time.perf_counter() - start


class KVCacheMixin:
    """The KV cache half of the model runner (sizing, allocation, warm-up, copies, sleep)."""

    cache: CacheSection
    device: torch.device
    model: torch.nn.Module | None
    dtype: torch.dtype
    kv_dtype: torch.dtype
    kv_caches: list[torch.Tensor | None]
    num_blocks: int
    block_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int
    no_lm_head: bool
    kernels: bool
    inputs: StepInputBuilder
    fast_decode: FastDecode | None
    lora: LoRAModel | None
    _pending: object | None
    #: what sleep freed, for wake_up: the cache's layout and the sleep level (0: awake)
    _kv_config: KVCacheConfig
    _sleep_level: int
    load_model: Callable[[], None]

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            block_size=self.block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=str(self.kv_dtype).removeprefix("torch."),
        )

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: kv_cache_memory if set; else a share of the device's memory."""
        cache = self.cache
        if cache.kv_cache_memory is not None:
            return int(cache.kv_cache_memory)
        if self.device.type == "cuda":
            return self._cuda_available_memory(cache.memory_utilization or CUDA_DEFAULT_UTILIZATION)
        if cache.memory_utilization is not None:
            import psutil

            return int(psutil.virtual_memory().available * cache.memory_utilization)
        spec = self.get_kv_cache_spec()
        per_token = spec.page_size_bytes // spec.block_size
        # a cache narrower than the activations (cache.dtype) keeps the default's tokens in less
        # memory: on CPU it is there to save memory (kv_cache_memory buys more blocks instead)
        cap = CPU_DEFAULT_KV_BYTES * min(1.0, self.kv_dtype.itemsize / self.dtype.itemsize)
        return min(int(cap), self.max_num_reqs * self.max_model_len * per_token)

    @torch.inference_mode()
    def _cuda_available_memory(self, utilization: float) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - before
        free, total = torch.cuda.mem_get_info(self.device)
        available = int(utilization * total - (total - free) - activations)
        if available <= 0:
            raise ExecutorError(
                f"no GPU memory left for the KV cache at memory_utilization={utilization} "
                f"(total {total / GiB:.1f} GiB, in use {(total - free) / GiB:.1f} GiB); raise it or set kv_cache_memory"
            )
        return available

    def _profile_run(self) -> None:
        """A forward over max_num_batched_tokens tokens without a cache, to measure activation memory."""
        n = min(self.max_num_tokens, self.max_model_len)
        ids = torch.zeros(1, n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)[None]
        meta = AttentionMetadata(None, None, self.block_size, [], [], n)
        keep = torch.tensor([n - 1], device=self.device)
        self.model(
            input_ids=ids,
            position_ids=pos,
            **head_kwargs(self.model, keep, int(ids.shape[1]), self.no_lm_head),
            use_cache=False,
            **{META_KWARG: meta},
        )

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        """Allocate ``config.num_blocks`` blocks for every layer, then warm up."""
        if config.block_size != self.block_size:
            raise ExecutorError(
                f"KV cache block_size {config.block_size} != cache.block_size {self.block_size}"
            )
        if config.num_blocks <= 0:
            raise ExecutorError(
                f"KV cache needs at least one block, got num_blocks={config.num_blocks}"
            )
        # [layers, K/V, blocks, kv_heads, block_size, head_dim]: a block is one contiguous gather
        cache = zeros_lazy(
            (
                self.num_layers,
                2,
                config.num_blocks,
                self.num_kv_heads,
                self.block_size,
                self.head_dim,
            ),
            self.kv_dtype,
            self.device,
        )
        # as vLLM's and llama.cpp's caches are: written once at start (cache.prefault)
        faulted_s = prefault(cache) if self.cache.prefault and cache.device.type == "cpu" else None
        self.kv_caches = list(cache.unbind(0))
        self.num_blocks = config.num_blocks
        attn_out = torch.empty(
            self.max_num_tokens * self.num_heads * self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.inputs.set_kv_caches(self.kv_caches, attn_out)
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%d layers, %d KV heads, head dim %d, %s)%s",
            config.num_blocks,
            self.block_size,
            config.num_blocks * self.block_size,
            cache.numel() * cache.element_size() / 2**20,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            str(self.kv_dtype).removeprefix("torch."),
            "" if faulted_s is None else f", pages mapped in {faulted_s:.2f} s",
        )
        self._warmup()

    @torch.inference_mode()
    def _warmup(self) -> None:
        """One prefill and one decode through the paged path (slots of block 0; nothing is cached yet)."""
        t0 = time.monotonic()
        n = min(self.block_size * self.num_blocks, 8, self.max_num_tokens)
        slots = torch.arange(n, device=self.device)
        nb = -(-n // self.block_size)
        blocks = torch.arange(nb, device=self.device)
        ctx = torch.tensor([n], device=self.device)
        for meta, ids, pos in (
            (
                AttentionMetadata(
                    self.kv_caches,
                    slots,
                    self.block_size,
                    [],
                    [PrefillSeq(0, n, 0, None)],
                    n,
                    kernels=self.kernels,
                ),
                torch.zeros(1, n, dtype=torch.long, device=self.device),
                slots[None],
            ),
            (
                AttentionMetadata(
                    self.kv_caches,
                    slots[n - 1 :],
                    self.block_size,
                    [DecodeGroup(0, 1, nb * self.block_size, blocks, ctx)],
                    [],
                    1,
                    kernels=self.kernels,  # warm the path the steps take
                ),
                torch.zeros(1, 1, dtype=torch.long, device=self.device),
                slots[None, n - 1 :],
            ),
        ):
            keep = torch.tensor([ids.shape[1] - 1], device=self.device)
            self.model(
                input_ids=ids,
                position_ids=pos,
                **head_kwargs(self.model, keep, int(ids.shape[1]), self.no_lm_head),
                use_cache=False,
                **{META_KWARG: meta},
            )
        log.debug("warm-up took %.2f s", time.monotonic() - t0)

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """A forward of one token no request owns, written to slot 0 of the null block (never a
        request's): an expert-parallel engine with nothing to run takes part in the MoE layers'
        collectives of the others' step (engine/dp_core_proc.py). The persistent batch is untouched."""
        if not self.kv_caches:
            raise ExecutorError("execute_dummy_batch before initialize_kv_cache")
        slot = torch.zeros(1, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            self.kv_caches, slot, self.block_size, [], [PrefillSeq(0, 1, 0, None)], 1
        )
        self.model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
            position_ids=slot[None],
            **head_kwargs(self.model, slot, 1, self.no_lm_head),
            use_cache=False,
            **{META_KWARG: meta},
        )

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source id, destination id) in every layer: forks' copy-on-write."""
        if not self.kv_caches:
            raise ExecutorError("copy_blocks before initialize_kv_cache")
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            if cache is not None:  # [K/V, blocks, ...]
                cache.index_copy_(1, dst, cache.index_select(1, src))

    def sleep(self, level: int) -> None:
        """Free the KV cache's storage; level 1 keeps the weights in host memory (moved off a
        GPU), level 2 drops them too (``wake_up`` loads them from the model folder again).

        The engine calls it only with no request in flight; what the cache held is gone.
        """
        if level not in (1, 2):
            raise ExecutorError(f"sleep level {level!r}: must be 1 or 2")
        if not self.kv_caches:
            raise ExecutorError("sleep before initialize_kv_cache, or while already asleep")
        self._pending = None
        self._kv_config = KVCacheConfig(num_blocks=self.num_blocks, block_size=self.block_size)
        self.kv_caches = []
        self.inputs.set_kv_caches([], None)
        if self.fast_decode is not None:
            self.fast_decode.forget_caches()
        if self.lora is not None:
            self.lora.release()  # the slots; adapters stay in host memory
        if level == 2:
            self.model = self.fast_decode = None
        elif self.device.type != "cpu":
            self.model.to("cpu")
        release_host_memory()
        release_device_memory(self.device)
        self._sleep_level = level
        log.info("asleep (level %d): KV cache%s freed", level, " and weights" if level == 2 else "")

    def wake_up(self) -> None:
        """Undo ``sleep``: load or move the weights back, allocate the KV cache again, warm up."""
        level = getattr(self, "_sleep_level", 0)
        if not level:
            return
        if level == 2:
            self.load_model()  # the weights as the model folder has them, prepared as at start
        elif self.device.type != "cpu":
            self.model.to(self.device)
        self.initialize_kv_cache(self._kv_config)
        self._sleep_level = 0
        log.info("awake (was asleep at level %d)", level)
