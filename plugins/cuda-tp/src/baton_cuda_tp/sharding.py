"""Moved to ``baton.parallel.sharding`` (public, in baton-core); importing this path warns."""

import warnings
from typing import Any

from baton.parallel import ParallelContext
from baton.parallel.sharding import (  # noqa: F401
    COLWISE,
    REPLICATED,
    ROWWISE,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    check_shardable,
    column_parallel,
    shard_kv_shape,
    shard_model,
    text_config,
    tp_plan,
)

warnings.warn(
    "baton_cuda_tp.sharding moved to baton.parallel.sharding; this path goes away in "
    "baton-plugin-cuda-tp 0.2",
    DeprecationWarning,
    stacklevel=2,
)


def adjust_runner(runner: Any, ctx: ParallelContext) -> None:
    """Deprecated: ``baton.parallel.sharding.shard_kv_shape`` in ``ModelRunnerHooks.loaded``."""
    if ctx.tp_size > 1:
        runner.num_heads //= ctx.tp_size
        runner.num_kv_heads //= ctx.tp_size
