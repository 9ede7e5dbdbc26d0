"""The start-up check that one full-length sequence fits in the KV cache."""

from __future__ import annotations

import logging

from baton.errors import ConfigError

log = logging.getLogger(__name__)


def fit_max_model_len(
    num_blocks: int, block_size: int, max_model_len: int, *, explicit: bool
) -> int:
    """The ``max_model_len`` the engine runs with, given a cache of ``num_blocks`` blocks.

    ``num_blocks`` counts the null block 0, which holds no tokens, so
    ``(num_blocks - 1) * block_size`` tokens are usable. A limit the user set
    (``explicit``) that does not fit is a ConfigError naming the largest that
    does; a limit taken from the model is lowered to that with an info log.
    """
    fits = max(num_blocks - 1, 0) * block_size
    if max_model_len <= fits:
        if not explicit:
            log.info(
                "model.max_model_len = %d, the model's own limit (the KV cache holds %d tokens)",
                max_model_len,
                fits,
            )
        return max_model_len
    if not explicit and fits > 0:
        log.info(
            "model.max_model_len: the model allows %d tokens but the KV cache holds %d "
            "(%d blocks of %d after the null block), so max_model_len = %d; raise "
            "cache.kv_cache_memory (CPU) or cache.memory_utilization (CUDA) for more",
            max_model_len,
            fits,
            num_blocks - 1,
            block_size,
            fits,
        )
        return fits
    needed = -(-max_model_len // block_size)
    lower = f"set model.max_model_len <= {fits} (the largest that fits), or " if fits else ""
    raise ConfigError(
        f"cache: the KV cache holds {max(num_blocks - 1, 0)} usable blocks of {block_size} "
        f"tokens (block 0 is reserved), {fits} tokens, but one sequence of "
        f"model.max_model_len={max_model_len} needs {needed} blocks: {lower}raise "
        "cache.kv_cache_memory (CPU) / cache.memory_utilization (CUDA)"
    )
